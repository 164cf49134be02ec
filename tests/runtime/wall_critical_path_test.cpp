// The critical path of a run on the wall clock: read from the recorded spans, its steps and their
// waits tile the run from the first task's start to the last task's end, and each step was
// reached from a graph predecessor (by that edge's kind) or the task before it on its device,
// the one of them that ended last. Only the recorded numbers are compared, never a time.
#include <gtest/gtest.h>

#include <algorithm>
#include <stdexcept>

#include "arenas.hpp"
#include "random_step_graph.hpp"
#include "weave/runtime/critical_path.hpp"
#include "weave/runtime/executor.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::rt {
namespace {

// The kind of the edge from `p` to `t`, if there is one.
bool has_edge(const Graph& g, TaskId p, TaskId t, EdgeKind kind) {
  const auto succ = g.successors(p);
  const auto kinds = g.successor_kinds(p);
  for (std::size_t i = 0; i < succ.size(); ++i)
    if (succ[i] == t && kinds[i] == kind) return true;
  return false;
}

TEST(WallCriticalPath, TilesTheRunThroughEdgesOrTheDevice) {
  testing::Arenas arenas(3, 1);
  Executor executor(arenas.pointers());
  for (unsigned seed = 1; seed <= 8; ++seed) {
    const Graph g = testing::random_step_graph(seed);
    const RunResult run = executor.run(g, {.record_trace = true});
    ASSERT_EQ(run.trace.spans().size(), g.size());
    // The run's span, from the recorded numbers alone.
    std::vector<Nanos> start(g.size()), end(g.size());
    Nanos first = run.trace.spans().front().start, last = run.trace.spans().front().end;
    for (const Span& s : run.trace.spans()) {
      start[s.task] = s.start;
      end[s.task] = s.end;
      first = std::min(first, s.start);
      last = std::max(last, s.end);
    }
    const CriticalPath path = wall_critical_path(g, run.trace);
    ASSERT_FALSE(path.steps.empty());
    EXPECT_EQ(path.clock, ClockKind::wall);
    EXPECT_EQ(path.start, first) << "seed " << seed;
    EXPECT_EQ(path.length, last - first) << "seed " << seed;
    EXPECT_EQ(end[path.steps.back().task], last) << "seed " << seed;
    EXPECT_EQ(path.steps.front().waited_for, CriticalLink::start);
    EXPECT_EQ(path.steps.front().begin - path.steps.front().waited, first);
    Nanos summed = 0, waits = 0;
    for (std::size_t i = 0; i < path.steps.size(); ++i) {
      const CriticalStep& s = path.steps[i];
      ASSERT_GE(s.waited, 0);
      ASSERT_LE(s.begin, s.end);
      summed += s.end - s.begin + s.waited;
      waits += s.waited;
      if (i == 0) continue;
      const CriticalStep& before = path.steps[i - 1];
      EXPECT_EQ(s.begin - s.waited, before.end) << "seed " << seed << " step " << i;
      // The member whose readiness started the step waited for the step before.
      const TaskId from = s.last_member, prev = before.task;
      switch (s.waited_for) {
        case CriticalLink::dependency:
          EXPECT_TRUE(has_edge(g, prev, from, EdgeKind::explicit_dependency));
          break;
        case CriticalLink::stream_order:
          EXPECT_TRUE(has_edge(g, prev, from, EdgeKind::stream_order));
          break;
        case CriticalLink::event:
          EXPECT_TRUE(has_edge(g, prev, from, EdgeKind::event));
          break;
        case CriticalLink::device:
          EXPECT_EQ(g.tasks()[prev].device, g.tasks()[from].device);
          EXPECT_LE(start[prev], start[from]);
          EXPECT_LE(end[prev], s.begin);
          break;
        default:
          ADD_FAILURE() << "seed " << seed << " step " << i << " reached by "
                        << to_string(s.waited_for);
      }
      // Of the member's graph predecessors, the one taken ended last.
      for (TaskId p = 0; p < g.size(); ++p)
        for (TaskId t : g.successors(p))
          if (t == from) {
            EXPECT_LE(end[p], end[prev]) << "seed " << seed << " step " << i;
          }
    }
    EXPECT_EQ(summed, last - first) << "seed " << seed;
    // Both summaries account for the whole run, the waits as one share.
    const CriticalPathSummary sum = summarize(path, g.tasks());
    for (const auto* shares : {&sum.by_kind, &sum.by_wait}) {
      Nanos total = 0, waited = 0;
      for (const PathShare& s : *shares) {
        total += s.time;
        if (s.what == kWallWait) waited = s.time;
      }
      EXPECT_EQ(total, last - first) << "seed " << seed;
      EXPECT_EQ(waited, waits) << "seed " << seed;
    }
  }
}

TEST(WallCriticalPath, RefusesAVirtualClockTrace) {
  const Graph g = testing::random_step_graph(3);
  const VirtualRunResult replay = VirtualClock(UniformCostModel(1e9, 100, 1e9)).run(g);
  EXPECT_THROW((void)wall_critical_path(g, replay.trace), std::invalid_argument);
  testing::Arenas arenas(3);
  Executor executor(arenas.pointers());
  const RunResult run = executor.run(g, {.record_trace = true});
  EXPECT_THROW((void)critical_path(g, run.trace), std::invalid_argument);
}

}  // namespace
}  // namespace weave::rt
