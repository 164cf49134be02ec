// Faults injected into runs (FaultPlan): a task that throws, a collective member that never
// arrives, a task that never starts, a run past its deadline; on the wall clock and the virtual
// clock. Each run must end with an error
// naming the task and its device, skip what depended on the fault, wait for every task already
// running, and leave the executor able to run again. Times bound only how long a hang may last.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "arenas.hpp"
#include "weave/runtime/error.hpp"
#include "weave/runtime/executor.hpp"
#include "weave/runtime/fault_plan.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::rt {
namespace {

using testing::Arenas;
using testing::limit_threads;

constexpr Nanos kMillisecond = 1'000'000;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Three devices: per device a compute task, then the device's member of an all-reduce on the
// comm stream, then a task using the result. Counts how often each piece of work ran.
struct ReduceGraph {
  static constexpr int kDevices = 3;
  std::atomic<int> computed{0}, reduced{0}, used{0};
  Graph graph;

  ReduceGraph() {
    GraphBuilder b;
    std::vector<TaskId> members;
    for (DeviceId d = 0; d < kDevices; ++d) {
      const std::string n = std::to_string(d);
      const TaskId compute =
          b.add({.device = d, .name = "compute" + n, .tags = {.phase = Phase::forward}},
                [this](TaskContext&) { computed.fetch_add(1); });
      const TaskId member = b.add({.device = d,
                                   .stream = kCommStream,
                                   .kind = TaskKind::comm,
                                   .name = "grads.dp[" + n + "]"},
                                  [this](TaskContext&) { reduced.fetch_add(1); });
      const TaskId use =
          b.add({.device = d, .name = "update" + n}, [this](TaskContext&) { used.fetch_add(1); });
      b.precede(compute, member);
      b.precede(member, use);
      members.push_back(member);
    }
    b.rendezvous("grads.dp", members);
    graph = b.build();
  }
  void reset() { computed = reduced = used = 0; }
  bool ran_completely() const {
    return computed == kDevices && reduced == kDevices && used == kDevices;
  }
};

// Worker threads: 1 (the caller alone) and 3.
class FaultInjection : public ::testing::TestWithParam<int> {};

TEST(FaultPlan, PatternsMatchWholeNamesWithStarAndQuestionMark) {
  EXPECT_TRUE(matches_task_pattern("L1.c1.dispatch[0]", "L1.c1.dispatch[0]"));
  EXPECT_FALSE(matches_task_pattern("L1.c1.dispatch[0]", "L1.c1.dispatch[0]x"));
  EXPECT_TRUE(matches_task_pattern("L1.c?.dispatch[*]", "L1.c0.dispatch[12]"));
  EXPECT_FALSE(matches_task_pattern("L1.c?.dispatch[*]", "L1.c10.dispatch[1]"));
  EXPECT_TRUE(matches_task_pattern("*dp[1]", "layers.0.attention/dense.dp[1]"));
  EXPECT_FALSE(matches_task_pattern("*dp[1]", "layers.0.attention/dense.dp[0]"));
  EXPECT_TRUE(matches_task_pattern("*", ""));
  EXPECT_TRUE(matches_task_pattern("a*b*c", "aXbYbZc"));
  EXPECT_FALSE(matches_task_pattern("a*b*c", "aXbYbZ"));
}

TEST(FaultPlan, PointsMatchDevicePhaseMicroBatchAndRun) {
  GraphBuilder b;
  const TaskId f =
      b.add({.device = 1, .name = "L0.qkv", .tags = {.micro_batch = 2, .phase = Phase::forward}});
  const TaskId w = b.add({.device = 1,
                          .name = "L0.qkv_weight_grad",
                          .tags = {.micro_batch = 2, .phase = Phase::weight}});
  const Graph g = b.build();
  const FaultPoint point{
      .task = "L0.qkv*", .device = 1, .phase = Phase::forward, .micro_batch = 2, .run = 3};
  EXPECT_TRUE(point.matches(g.tasks(), f, 3));
  EXPECT_FALSE(point.matches(g.tasks(), f, 2));
  EXPECT_FALSE(point.matches(g.tasks(), w, 3));
  EXPECT_FALSE((FaultPoint{.device = 0}.matches(g.tasks(), f, 0)));
  EXPECT_FALSE((FaultPoint{.micro_batch = 1}.matches(g.tasks(), f, 0)));
  const FaultPlan plan{
      .points = {{.task = "nothing"}, {.task = "*grad", .kind = FaultKind::never_arrive}}};
  EXPECT_EQ(plan.fault_for(g.tasks(), w, 0), FaultKind::never_arrive);
  EXPECT_EQ(plan.fault_for(g.tasks(), f, 0), std::nullopt);
}

TEST_P(FaultInjection, ChosenTaskThrowsInTheChosenRunOnly) {
  auto limit = limit_threads(GetParam());
  Arenas arenas(ReduceGraph::kDevices);
  Executor executor(arenas.pointers());
  ReduceGraph g;
  executor.set_fault_plan({.points = {{.task = "compute*", .device = 1, .run = 1}}});

  executor.run(g.graph);  // run 0 under the plan: no fault
  EXPECT_TRUE(g.ran_completely());

  g.reset();
  try {
    executor.run(g.graph);
    FAIL() << "the injected fault did not fail the run";
  } catch (const TaskError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.task_name(), "compute1");
    EXPECT_TRUE(contains(msg, "task 'compute1' (device 1")) << msg;
    EXPECT_TRUE(contains(msg, "fault injected")) << msg;
    EXPECT_THROW(std::rethrow_exception(e.cause()), InjectedFault);
  }
  // The collective needed device 1's member, which depended on the failed task: none of the
  // reduction's work and no update ran.
  EXPECT_EQ(g.reduced, 0);
  EXPECT_EQ(g.used, 0);

  g.reset();
  executor.run(g.graph);  // run 2: the point was for run 1 only
  EXPECT_TRUE(g.ran_completely());
}

TEST_P(FaultInjection, CollectiveMemberThatNeverArrivesIsNamedWithThoseThatDid) {
  auto limit = limit_threads(GetParam());
  Arenas arenas(ReduceGraph::kDevices);
  Executor executor(arenas.pointers());
  ReduceGraph g;
  executor.set_fault_plan(
      {.points = {{.task = "grads.dp[*]", .device = 2, .kind = FaultKind::never_arrive}},
       .stall_timeout = 200 * kMillisecond});
  try {
    executor.run(g.graph);
    FAIL() << "a collective missing a member completed";
  } catch (const TaskError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.task_name(), "grads.dp[2]");
    EXPECT_TRUE(contains(msg, "task 'grads.dp[2]' (device 2")) << msg;
    EXPECT_TRUE(contains(msg, "stalled")) << msg;
    EXPECT_TRUE(contains(msg, "Collective 'grads.dp' has 2 of its 3 members")) << msg;
    EXPECT_TRUE(contains(msg, "arrived 'grads.dp[0]' (device 0), 'grads.dp[1]' (device 1)")) << msg;
    EXPECT_TRUE(
        contains(msg, "never arrived 'grads.dp[2]' (device 2, held back by the fault plan)"))
        << msg;
  }
  EXPECT_EQ(g.computed, 3);  // everything before the collective ran
  EXPECT_EQ(g.reduced, 0);   // the members waiting for the missing one were released unrun
  EXPECT_EQ(g.used, 0);

  executor.set_fault_plan({});
  g.reset();
  executor.run(g.graph);
  EXPECT_TRUE(g.ran_completely());
}

TEST_P(FaultInjection, TaskThatNeverStartsStallsTheRunNamingIt) {
  auto limit = limit_threads(GetParam());
  Arenas arenas(2);
  Executor executor(arenas.pointers());
  std::atomic<int> ran{0};
  GraphBuilder b;
  const TaskId first = b.add({.device = 0, .name = "first"}, [&](TaskContext&) { ++ran; });
  const TaskId hung = b.add({.device = 1, .name = "hung"}, [&](TaskContext&) { ++ran; });
  const TaskId last = b.add({.device = 0, .name = "last"}, [&](TaskContext&) { ++ran; });
  b.precede(first, hung);
  b.precede(hung, last);
  const Graph graph = b.build();
  executor.set_fault_plan({.points = {{.task = "hung", .kind = FaultKind::never_arrive}},
                           .stall_timeout = 100 * kMillisecond});
  try {
    executor.run(graph);
    FAIL();
  } catch (const TaskError& e) {
    EXPECT_EQ(e.task_name(), "hung");
    EXPECT_TRUE(contains(e.what(), "never started: 'hung' (device 1)")) << e.what();
  }
  EXPECT_EQ(ran, 1);
  executor.set_fault_plan({});
  ran = 0;
  executor.run(graph);
  EXPECT_EQ(ran, 3);
}

TEST_P(FaultInjection, DeadlineCancelsARunWaitingForACompletionThatNeverComes) {
  auto limit = limit_threads(GetParam());
  Arenas arenas(2);
  Executor executor(arenas.pointers());
  Completion forgotten;
  bool after_ran = false;
  GraphBuilder b;
  const TaskId wait =
      b.add({.device = 1, .stream = kCommStream, .kind = TaskKind::comm, .name = "remote-recv"},
            [&](TaskContext& ctx) { forgotten = ctx.defer(); });
  const TaskId after =
      b.add({.device = 1, .name = "after"}, [&](TaskContext&) { after_ran = true; });
  b.precede(wait, after);
  try {
    // No stall watchdog: only the deadline can end this run.
    executor.run(b.build(), {.stall_timeout = 0, .deadline = 200 * kMillisecond});
    FAIL();
  } catch (const TaskError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.task_name(), "remote-recv");
    EXPECT_TRUE(contains(msg, "deadline")) << msg;
    EXPECT_TRUE(contains(msg, "waited for their Completion: 'remote-recv' (device 1)")) << msg;
  }
  EXPECT_FALSE(after_ran);
  forgotten.complete();  // too late: ignored
}

TEST_P(FaultInjection, DeadlineWaitsForTheTasksRunningAndNamesThem) {
  auto limit = limit_threads(GetParam());
  Arenas arenas(2);
  Executor executor(arenas.pointers());
  std::atomic<bool> slow_returned{false}, next_ran{false};
  GraphBuilder b;
  const TaskId slow = b.add({.device = 0, .name = "slow"}, [&](TaskContext&) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    slow_returned = true;
  });
  const TaskId next = b.add({.device = 0, .name = "next"}, [&](TaskContext&) { next_ran = true; });
  b.precede(slow, next);
  try {
    executor.run(b.build(), {.deadline = 50 * kMillisecond});
    FAIL();
  } catch (const TaskError& e) {
    EXPECT_EQ(e.task_name(), "slow");
    EXPECT_TRUE(contains(e.what(), "Still running: 'slow' (device 0)")) << e.what();
  }
  // run() returned only once the running task had: no thread is left in the run.
  EXPECT_TRUE(slow_returned);
  EXPECT_FALSE(next_ran);
}

TEST_P(FaultInjection, ThrowingTaskCancelsTheRestAndTheRunWaitsForTasksAlreadyRunning) {
  auto limit = limit_threads(GetParam());
  Arenas arenas(2);
  Executor executor(arenas.pointers());
  std::atomic<bool> started{false}, finished{false};
  GraphBuilder b;
  // Device 1 is busy when device 0's task fails (with one thread, it ran first).
  b.add({.device = 1, .name = "busy"}, [&](TaskContext&) {
    started = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    finished = true;
  });
  b.add({.device = 0, .name = "boom"});
  executor.set_fault_plan({.points = {{.task = "boom"}}});
  EXPECT_THROW(executor.run(b.build()), TaskError);
  EXPECT_EQ(started.load(), finished.load());
}

INSTANTIATE_TEST_SUITE_P(Threads, FaultInjection, ::testing::Values(1, 3));

TEST(VirtualClockFaults, ChosenTaskFailsTheReplayOfTheChosenRunWithOrWithoutTheWork) {
  ReduceGraph g;
  const UniformCostModel model(1e9, 1000, 1e9);
  const FaultPlan plan{.points = {{.task = "update2", .run = 1}}};
  for (bool execute : {false, true}) {
    VirtualClock clock(model, {.execute = execute, .faults = &plan});
    clock.run(g.graph);
    try {
      clock.run(g.graph);
      FAIL() << "execute " << execute;
    } catch (const TaskError& e) {
      EXPECT_EQ(e.task_name(), "update2");
      EXPECT_TRUE(contains(e.what(), "task 'update2' (device 2")) << e.what();
      EXPECT_THROW(std::rethrow_exception(e.cause()), InjectedFault);
    }
    clock.run(g.graph);
  }
}

TEST(VirtualClockFaults, MemberThatNeverArrivesEndsTheReplayNamingTheCollective) {
  ReduceGraph g;
  const UniformCostModel model(1e9, 1000, 1e9);
  const FaultPlan plan{.points = {{.task = "grads.dp[0]", .kind = FaultKind::never_arrive}}};
  VirtualClock clock(model, {.execute = true, .faults = &plan});
  try {
    clock.run(g.graph);
    FAIL();
  } catch (const TaskError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.task_name(), "grads.dp[0]");
    EXPECT_TRUE(contains(msg,
                         "Collective 'grads.dp' has 2 of its 3 members: arrived "
                         "'grads.dp[1]' (device 1), 'grads.dp[2]' (device 2); never arrived "
                         "'grads.dp[0]' (device 0, held back by the fault plan)"))
        << msg;
  }
  EXPECT_EQ(g.computed, 3);
  EXPECT_EQ(g.reduced, 0);
  EXPECT_EQ(g.used, 0);
}

}  // namespace
}  // namespace weave::rt
