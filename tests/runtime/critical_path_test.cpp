// The critical path of a virtual-clock replay: its steps tile the step from 0 to the makespan,
// each waits for the one before it, and a what-if replay equals replaying the graph built with
// the changed costs.
#include <gtest/gtest.h>

#include <stdexcept>

#include "random_step_graph.hpp"
#include "weave/runtime/critical_path.hpp"
#include "weave/runtime/virtual_clock.hpp"
#include "weave/runtime/what_if.hpp"

namespace weave::rt {
namespace {

// 1 flop = 1 ns; a message costs 100 ns and a byte 1 ns.
const UniformCostModel kModel(1e9, 100, 1e9);

TEST(CriticalPath, LengthIsTheStepTimeAndStepsTileIt) {
  for (unsigned seed = 1; seed <= 60; ++seed) {
    const Graph g = testing::random_step_graph(seed);
    for (bool one_engine : {true, false}) {
      VirtualClock clock(kModel, {.one_compute_engine_per_device = one_engine});
      const VirtualRunResult run = clock.run(g);
      const CriticalPath path = critical_path(g, run.trace);
      ASSERT_FALSE(path.steps.empty());
      EXPECT_EQ(path.length, run.makespan) << "seed " << seed;
      EXPECT_EQ(path.steps.front().begin, 0) << "seed " << seed;
      EXPECT_EQ(path.steps.back().end, run.makespan) << "seed " << seed;
      Nanos summed = 0;
      for (std::size_t i = 0; i < path.steps.size(); ++i) {
        const CriticalStep& s = path.steps[i];
        summed += s.end - s.begin;
        if (i > 0) {
          EXPECT_EQ(s.begin, path.steps[i - 1].end) << "seed " << seed << " step " << i;
        }
        if (!one_engine) {
          EXPECT_NE(s.waited_for, CriticalLink::engine);
        }
      }
      EXPECT_EQ(summed, run.makespan);
      const CriticalPathSummary sum = summarize(path, g.tasks());
      Nanos by_kind = 0, by_wait = 0;
      for (const PathShare& s : sum.by_kind)
        by_kind += s.time;
      for (const PathShare& s : sum.by_wait)
        by_wait += s.time;
      EXPECT_EQ(by_kind, run.makespan);
      EXPECT_EQ(by_wait, run.makespan);
    }
  }
}

TEST(CriticalPath, NamesWhatEachStepWaitedFor) {
  GraphBuilder b;
  const StreamId side = b.stream("side");
  const StreamId ep = b.stream("ep");
  // Device 0: x (100) then, waiting for the engine, y on another stream (50); y's result goes
  // out on ep (200 bytes + 100 latency), and z (10) follows x on the compute stream.
  const TaskId x =
      b.add({.device = 0, .kind = TaskKind::compute, .name = "x", .cost = {.flops = 100}});
  const TaskId y = b.add(
      {.device = 0, .stream = side, .kind = TaskKind::compute, .name = "y", .cost = {.flops = 50}});
  const TaskId a = b.add({.device = 0,
                          .stream = ep,
                          .kind = TaskKind::comm,
                          .name = "a2a",
                          .cost = {.bytes = 200, .messages = 1}});
  const TaskId z =
      b.add({.device = 0, .kind = TaskKind::compute, .name = "z", .cost = {.flops = 10}});
  b.precede(y, a);
  b.precede(a, z);
  const Graph g = b.build();
  const VirtualRunResult run = VirtualClock(kModel).run(g);
  ASSERT_EQ(run.makespan, 100 + 50 + 300 + 10);
  const CriticalPath path = critical_path(g, run.trace);
  ASSERT_EQ(path.steps.size(), 4u);
  EXPECT_EQ(path.steps[0].task, x);
  EXPECT_EQ(path.steps[1].task, y);
  EXPECT_EQ(path.steps[1].waited_for, CriticalLink::engine);
  EXPECT_EQ(path.steps[2].task, a);
  EXPECT_EQ(path.steps[2].waited_for, CriticalLink::dependency);
  EXPECT_EQ(path.steps[3].task, z);
  EXPECT_EQ(path.steps[3].waited_for, CriticalLink::dependency);
  const CriticalPathSummary sum = summarize(path, g.tasks());
  ASSERT_EQ(sum.by_kind.size(), 2u);
  EXPECT_EQ(sum.by_kind[0].what, "ep communication");
  EXPECT_EQ(sum.by_kind[0].time, 300);
  EXPECT_EQ(sum.by_kind[1].what, "compute");
  EXPECT_EQ(sum.by_kind[1].time, 160);
}

TEST(CriticalPath, ACollectiveWaitsForItsLastMember) {
  GraphBuilder b;
  const TaskId slow =
      b.add({.device = 1, .kind = TaskKind::compute, .name = "slow", .cost = {.flops = 500}});
  const TaskId m0 = b.add({.device = 0,
                           .stream = kCommStream,
                           .kind = TaskKind::comm,
                           .name = "m0",
                           .cost = {.bytes = 10, .messages = 1}});
  const TaskId m1 = b.add({.device = 1,
                           .stream = kCommStream,
                           .kind = TaskKind::comm,
                           .name = "m1",
                           .cost = {.bytes = 10, .messages = 1}});
  const TaskId after =
      b.add({.device = 0, .kind = TaskKind::compute, .name = "after", .cost = {.flops = 5}});
  b.precede(slow, m1);
  b.precede(m0, after);
  const TaskId members[] = {m0, m1};
  b.rendezvous("pair", members);
  const Graph g = b.build();
  const VirtualRunResult run = VirtualClock(kModel).run(g);
  const CriticalPath path = critical_path(g, run.trace);
  ASSERT_EQ(path.steps.size(), 3u);
  EXPECT_EQ(path.steps[0].task, slow);
  EXPECT_EQ(path.steps[1].task, m0);
  EXPECT_EQ(path.steps[1].last_member, m1);
  EXPECT_EQ(path.steps[1].begin, 500);
  EXPECT_EQ(path.steps[1].waited_for, CriticalLink::collective);
  EXPECT_EQ(path.steps[2].task, after);
  EXPECT_EQ((path.tasks()), (std::vector<TaskId>{slow, m1, m0, after}));
}

// The hints random_step_graph gives, changed by hand as each what-if says.
struct Case {
  const char* spec;
  testing::CostEdit edit;
};

TEST(WhatIf, EqualsReplayingTheGraphBuiltWithTheChangedCosts) {
  const Case cases[] = {
      {"ep=free",
       [](std::string_view s, TaskKind, CostHint c) {
         if (s == "ep") c.bytes = 0, c.messages = 0;
         return c;
       }},
      {"tp*2",
       [](std::string_view s, TaskKind, CostHint c) {
         if (s == "tp") c.bytes *= 2;
         return c;
       }},
      {"attention*0.5",
       [](std::string_view, TaskKind k, CostHint c) {
         if (k == TaskKind::compute) c.flops *= 0.75, c.attention_flops /= 2;
         return c;
       }},
      {"compute\u00d70.5,ep*3",
       [](std::string_view s, TaskKind k, CostHint c) {
         if (k == TaskKind::compute) c.flops /= 2, c.attention_flops /= 2;
         if (s == "ep") c.bytes *= 3;
         return c;
       }},
  };
  for (unsigned seed = 1; seed <= 8; ++seed) {
    const Graph g = testing::random_step_graph(seed);
    const Nanos before = VirtualClock(kModel).run(g).makespan;
    for (const Case& c : cases) {
      const WhatIfCostModel what_if(kModel, parse_cost_changes(c.spec));
      const Nanos changed = VirtualClock(what_if).run(g).makespan;
      const Graph rebuilt = testing::random_step_graph(seed, 20, 3, c.edit);
      EXPECT_EQ(changed, VirtualClock(kModel).run(rebuilt).makespan) << c.spec << " seed " << seed;
      if (std::string_view(c.spec) == "ep=free") {
        EXPECT_LE(changed, before);
      }
      if (std::string_view(c.spec) == "tp*2") {
        EXPECT_GE(changed, before);
      }
    }
  }
}

// A model that charges every transfer a latency whatever its hint says, as a cluster model
// prices a collective by its group.
class FixedLatencyModel : public CostModel {
 public:
  using CostModel::duration;
  Nanos duration(const TaskTable& tasks, TaskId task, const CostHint& cost) const override {
    return tasks[task].kind == TaskKind::compute ? static_cast<Nanos>(cost.flops)
                                                 : 1000 + static_cast<Nanos>(cost.bytes);
  }
};

TEST(WhatIf, AFreeStreamTakesNoTimeWhateverTheModelCharges) {
  GraphBuilder b;
  const StreamId ep = b.stream("ep");
  const TaskId x =
      b.add({.device = 0, .kind = TaskKind::compute, .name = "x", .cost = {.flops = 10}});
  const TaskId a = b.add({.device = 0, .stream = ep, .kind = TaskKind::comm, .name = "a2a"});
  const TaskId y =
      b.add({.device = 0, .kind = TaskKind::compute, .name = "y", .cost = {.flops = 10}});
  b.precede(x, a);
  b.precede(a, y);
  const Graph g = b.build();
  const FixedLatencyModel model;
  EXPECT_EQ(VirtualClock(model).run(g).makespan, 1020);
  const WhatIfCostModel free(model, parse_cost_changes("ep=free"));
  EXPECT_EQ(VirtualClock(free).run(g).makespan, 20);
  const WhatIfCostModel other(model, parse_cost_changes("tp=free"));
  EXPECT_EQ(VirtualClock(other).run(g).makespan, 1020);
}

TEST(WhatIf, WrongChangesAreRefusedNamingTheForms) {
  for (const char* bad : {"ep=slow", "tp", "tp*-1", "tp*x", "*2", ""}) {
    try {
      parse_cost_changes(bad);
      ADD_FAILURE() << bad;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("<stream>=free"), std::string::npos) << e.what();
    }
  }
  const auto changes = parse_cost_changes("ep=free,attention*0.5");
  ASSERT_EQ(changes.size(), 2u);
  EXPECT_EQ(changes[0].describe(), "ep=free");
  EXPECT_EQ(changes[1].describe(), "attention*0.5");
}

}  // namespace
}  // namespace weave::rt
