// The executor on the wall clock: ordering, events, rendezvous, deferral, failures, re-runs.
// Timing is never asserted, except that a link-model hold is never shorter than modelled.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "arenas.hpp"
#include "weave/runtime/error.hpp"
#include "weave/runtime/executor.hpp"

namespace weave::rt {
namespace {

using testing::Arenas;
using testing::limit_threads;

std::string fmt_name(DeviceId d, int i) {
  return fmt::format("d{}.t{}", d, i);
}

// Thread counts x device counts: the same behaviour on one thread as on several.
class ExecutorShapes : public ::testing::TestWithParam<std::tuple<int, int>> {};

// A random DAG over several devices and streams: every task runs exactly once, after all its
// predecessors (checked with a global sequence counter), whatever the thread count.
TEST_P(ExecutorShapes, RandomGraphRunsEachTaskOnceAfterItsPredecessors) {
  const auto [threads, devices] = GetParam();
  auto limit = limit_threads(threads);
  Arenas arenas(devices, 2);
  Executor executor(arenas.pointers());

  constexpr int kTasks = 600;
  std::mt19937 rng(1234);
  GraphBuilder b;
  std::vector<std::atomic<int>> runs(kTasks);
  std::vector<std::atomic<long>> started(kTasks), ended(kTasks);
  std::atomic<long> clock{0};
  std::vector<std::vector<TaskId>> preds(kTasks);
  const StreamId extra = b.stream("extra");
  for (int i = 0; i < kTasks; ++i) {
    const auto device = static_cast<DeviceId>(rng() % static_cast<unsigned>(devices));
    const StreamId streams[] = {kComputeStream, kCommStream, extra};
    const StreamId stream = streams[rng() % 3];
    const TaskId t = b.add({.device = device,
                            .stream = stream,
                            .kind = stream == kComputeStream ? TaskKind::compute : TaskKind::comm,
                            .name = fmt::format("t{}", i)},
                           [&, i](TaskContext&) {
                             started[i] = clock.fetch_add(1);
                             runs[i].fetch_add(1);
                             ended[i] = clock.fetch_add(1);
                           });
    for (int k = 0; k < 3 && i > 0; ++k) {
      const auto p = static_cast<TaskId>(rng() % static_cast<unsigned>(i));
      b.precede(p, t);
      preds[i].push_back(p);
    }
  }
  const Graph g = b.build();
  for (int i = 0; i < kTasks; ++i) {
    for (TaskId s : g.successors(static_cast<TaskId>(i)))
      preds[s].push_back(static_cast<TaskId>(i));
  }
  for (int rep = 0; rep < 3; ++rep) {
    executor.run(g);
    for (int i = 0; i < kTasks; ++i) {
      ASSERT_EQ(runs[i].load(), rep + 1) << "task " << i;
      for (TaskId p : preds[i])
        ASSERT_LT(ended[p].load(), started[i].load()) << p << " -> " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(ThreadsAndDevices, ExecutorShapes,
                         ::testing::Combine(::testing::Values(1, 2, 4),
                                            ::testing::Values(1, 3, 8)));

TEST(Executor, TasksOnAStreamRunInOrderOneAtATime) {
  auto limit = limit_threads(4);
  Arenas arenas(1, 4);  // four slots: only stream order keeps them serial
  Executor executor(arenas.pointers());
  GraphBuilder b;
  std::vector<int> order;
  std::atomic<int> inside{0}, most{0};
  for (int i = 0; i < 200; ++i) {
    b.add({.name = fmt::format("s{}", i)}, [&, i](TaskContext&) {
      const int now = inside.fetch_add(1) + 1;
      most.store(std::max(most.load(), now));
      order.push_back(i);
      inside.fetch_sub(1);
    });
  }
  executor.run(b.build());
  ASSERT_EQ(order.size(), 200u);
  for (int i = 0; i < 200; ++i)
    EXPECT_EQ(order[i], i);
  EXPECT_EQ(most.load(), 1);
}

TEST(Executor, CrossStreamEventWaitSeesTheProducersWrites) {
  auto limit = limit_threads(2);
  Arenas arenas(2, 2);
  Executor executor(arenas.pointers());
  GraphBuilder b;
  const EventId ready = b.event("ready");
  std::vector<int> produced(64, 0), seen(64, -1);
  for (int i = 0; i < 64; ++i) {
    const TaskId p = b.add({.device = 1,
                            .stream = kCommStream,
                            .kind = TaskKind::comm,
                            .name = fmt::format("produce{}", i)},
                           [&, i](TaskContext&) { produced[i] = i * 7 + 1; });
    const TaskId c = b.add({.device = 0, .name = fmt::format("consume{}", i)},
                           [&, i](TaskContext&) { seen[i] = produced[i]; });
    b.signal(p, ready, static_cast<std::uint64_t>(i + 1));
    b.wait(c, ready, static_cast<std::uint64_t>(i + 1));
  }
  const Graph g = b.build();
  const RunResult r = executor.run(g, {.record_trace = true});
  for (int i = 0; i < 64; ++i)
    EXPECT_EQ(seen[i], i * 7 + 1);
  for (int i = 0; i < 64; ++i) {
    const Span* p = r.trace.find(fmt::format("produce{}", i));
    const Span* c = r.trace.find(fmt::format("consume{}", i));
    ASSERT_TRUE(p && c);
    EXPECT_LE(p->end, c->start);
  }
}

TEST(Executor, GraphRunsManyTimesWithFreshState) {
  auto limit = limit_threads(2);
  Arenas arenas(3);
  Executor executor(arenas.pointers());
  GraphBuilder b;
  std::atomic<int> total{0};
  std::vector<std::uint64_t> seen_runs;
  TaskId prev = kNoTask;
  for (DeviceId d = 0; d < 3; ++d) {
    for (int i = 0; i < 10; ++i) {
      const TaskId t = b.add({.device = d, .name = "t"}, [&, d, i](TaskContext& ctx) {
        total.fetch_add(1);
        if (d == 0 && i == 0) seen_runs.push_back(ctx.run_index());
      });
      if (prev != kNoTask && i == 0) b.precede(prev, t);
      prev = t;
    }
  }
  const Graph g = b.build();
  for (int rep = 1; rep <= 25; ++rep) {
    executor.run(g);
    ASSERT_EQ(total.load(), rep * 30);
  }
  ASSERT_EQ(seen_runs.size(), 25u);
  for (std::size_t i = 0; i < seen_runs.size(); ++i)
    EXPECT_EQ(seen_runs[i], i);
}

// The failure scenario: 8 devices on 2 threads, one task throws. The run ends (no
// hang), the error names the task, and nothing that depends on it runs.
TEST(Executor, ThrowingTaskCancelsRunNamesTaskAndSkipsDependents) {
  auto limit = limit_threads(2);
  Arenas arenas(8);
  Executor executor(arenas.pointers());
  GraphBuilder b;
  std::atomic<int> dependents_run{0};
  std::vector<TaskId> heads;
  TaskId failing = kNoTask;
  for (DeviceId d = 0; d < 8; ++d) {
    for (int i = 0; i < 20; ++i) {
      const bool fails = d == 3 && i == 10;
      const bool after = d == 3 && i > 10;
      const TaskId t =
          b.add({.device = d, .name = fmt_name(d, i)}, [&, fails, after](TaskContext&) {
            if (fails) throw std::runtime_error("boom: tensor shape (3, 4) vs (4, 3)");
            if (after) dependents_run.fetch_add(1);
          });
      if (fails) failing = t;
      if (i == 0) heads.push_back(t);
    }
  }
  // A task on another device that depends on the failing one must not run either.
  const TaskId downstream = b.add({.device = 6, .stream = kCommStream, .name = "downstream"},
                                  [&](TaskContext&) { dependents_run.fetch_add(1); });
  b.precede(failing, downstream);
  const Graph g = b.build();
  for (int rep = 0; rep < 3; ++rep) {
    dependents_run = 0;
    try {
      executor.run(g);
      FAIL() << "the run should have failed";
    } catch (const TaskError& e) {
      EXPECT_EQ(e.task_name(), "d3.t10");
      EXPECT_EQ(e.task(), failing);
      const std::string msg = e.what();
      EXPECT_NE(msg.find("'d3.t10'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("boom: tensor shape"), std::string::npos) << msg;
      EXPECT_NE(msg.find("device 3"), std::string::npos) << msg;
    }
    EXPECT_EQ(dependents_run.load(), 0);
  }
}

// The rendezvous scenario: 8 members on a single thread. No member's work starts
// before every member is ready, and no member completes before every member's work is done.
TEST(Executor, RendezvousOfEightMembersOnOneThread) {
  for (int threads : {1, 2}) {
    auto limit = limit_threads(threads);
    Arenas arenas(8);
    Executor executor(arenas.pointers());
    GraphBuilder b;
    std::vector<std::atomic<bool>> ready(8), worked(8);
    std::atomic<int> early_start{0}, early_finish{0};
    std::vector<TaskId> members;
    for (DeviceId d = 0; d < 8; ++d) {
      const TaskId before = b.add({.device = d, .name = "before"}, [&, d](TaskContext&) {
        for (int i = 0; i < 1000 * static_cast<int>(d); ++i)
          std::atomic_signal_fence(std::memory_order_seq_cst);
        ready[d] = true;
      });
      const TaskId member =
          b.add({.device = d, .stream = kCommStream, .kind = TaskKind::comm, .name = "allreduce"},
                [&, d](TaskContext&) {
                  for (auto& r : ready)
                    early_start += r ? 0 : 1;
                  worked[d] = true;
                });
      const TaskId after = b.add({.device = d, .name = "after"}, [&](TaskContext&) {
        for (auto& w : worked)
          early_finish += w ? 0 : 1;
      });
      b.precede(before, member);
      b.precede(member, after);
      members.push_back(member);
    }
    b.rendezvous("allreduce", members);
    const Graph g = b.build();
    for (int rep = 0; rep < 5; ++rep) {
      for (auto& r : ready)
        r = false;
      for (auto& w : worked)
        w = false;
      executor.run(g);
      for (auto& w : worked)
        EXPECT_TRUE(w.load());
    }
    EXPECT_EQ(early_start.load(), 0) << threads << " thread(s)";
    EXPECT_EQ(early_finish.load(), 0) << threads << " thread(s)";
  }
}

TEST(Executor, DeferredCompletionFromAnotherThread) {
  auto limit = limit_threads(2);
  Arenas arenas(2);
  Executor executor(arenas.pointers());
  GraphBuilder b;
  std::atomic<int> value{0};
  int seen = -1;
  std::thread completer;
  const TaskId d =
      b.add({.device = 0, .stream = kCommStream, .kind = TaskKind::comm, .name = "dma"},
            [&](TaskContext& ctx) {
              completer = std::thread([&value, c = ctx.defer()]() mutable {
                std::this_thread::sleep_for(std::chrono::milliseconds(20));
                value = 42;
                c.complete();
              });
            });
  const TaskId use = b.add({.device = 1, .name = "use"}, [&](TaskContext&) { seen = value; });
  b.precede(d, use);
  executor.run(b.build());
  completer.join();
  EXPECT_EQ(seen, 42);
}

TEST(Executor, DeferredCompletionCompletedBeforeTheFunctionReturns) {
  Arenas arenas(1);
  Executor executor(arenas.pointers());
  GraphBuilder b;
  int order = 0, seen = 0;
  const TaskId d = b.add({.name = "inline"}, [&](TaskContext& ctx) {
    Completion c = ctx.defer();
    c.complete();
    order = 1;
  });
  const TaskId next = b.add({.name = "next"}, [&](TaskContext&) { seen = order; });
  b.precede(d, next);
  executor.run(b.build());
  EXPECT_EQ(seen, 1);
}

TEST(Executor, DroppedOrFailedCompletionFailsTheTask) {
  Arenas arenas(1);
  Executor executor(arenas.pointers());
  {
    GraphBuilder b;
    b.add({.name = "forgetful"}, [](TaskContext& ctx) { Completion dropped = ctx.defer(); });
    try {
      executor.run(b.build());
      FAIL();
    } catch (const TaskError& e) {
      EXPECT_EQ(e.task_name(), "forgetful");
      EXPECT_NE(std::string(e.what()).find("destroyed without complete()"), std::string::npos);
    }
  }
  {
    GraphBuilder b;
    bool ran = false;
    const TaskId t = b.add({.name = "failing-dma"}, [](TaskContext& ctx) {
      ctx.defer().fail(std::make_exception_ptr(std::runtime_error("link down")));
    });
    const TaskId after = b.add({.name = "after"}, [&](TaskContext&) { ran = true; });
    b.precede(t, after);
    EXPECT_THROW(executor.run(b.build()), TaskError);
    EXPECT_FALSE(ran);
  }
}

TEST(Executor, StalledDeferredTaskIsReportedNotHung) {
  auto limit = limit_threads(2);
  Arenas arenas(2);
  Executor executor(arenas.pointers());
  GraphBuilder b;
  Completion stuck;
  b.add({.device = 1, .stream = kCommStream, .kind = TaskKind::comm, .name = "never-done"},
        [&](TaskContext& ctx) { stuck = ctx.defer(); });
  b.add({.device = 0, .name = "fine"});
  try {
    executor.run(b.build(), {.stall_timeout = 200'000'000});
    FAIL();
  } catch (const TaskError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("stalled"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'never-done'"), std::string::npos) << msg;
  }
  stuck.complete();  // after the run: ignored, harmless
}

TEST(Executor, CommTaskIsHeldForItsModelledDuration) {
  auto limit = limit_threads(2);
  Arenas arenas(2);
  Executor executor(arenas.pointers());
  // 1 ms latency + 2 MB at 100 MB/s = 21 ms.
  const UniformCostModel link(1e12, 1'000'000, 100e6);
  GraphBuilder b;
  const TaskId send = b.add({.device = 0,
                             .stream = kCommStream,
                             .kind = TaskKind::comm,
                             .name = "send",
                             .cost = {.bytes = 2e6}});
  const TaskId recv = b.add({.device = 1,
                             .stream = kCommStream,
                             .kind = TaskKind::comm,
                             .name = "recv",
                             .cost = {.bytes = 2e6}});
  const TaskId pair[] = {send, recv};
  b.rendezvous("p2p", pair);
  const TaskId use = b.add({.device = 1, .name = "use"});
  b.precede(recv, use);
  const TaskId alone = b.add({.device = 0,
                              .stream = kCommStream,
                              .kind = TaskKind::copy,
                              .name = "copy",
                              .cost = {.bytes = 1e6}});
  const Graph g = b.build();
  const RunResult held = executor.run(g, {.record_trace = true, .link_model = &link});
  const Nanos modelled = link.duration(g.tasks(), send);
  ASSERT_EQ(modelled, 21'000'000);
  for (const char* name : {"send", "recv"}) {
    const Span* s = held.trace.find(name);
    ASSERT_NE(s, nullptr);
    EXPECT_GE(s->end - s->start, modelled) << name;
  }
  EXPECT_GE(held.trace.find("use")->start, held.trace.find("recv")->end);
  EXPECT_GE(held.trace.find("copy")->end - held.trace.find("copy")->start,
            link.duration(g.tasks(), alone));
}

TEST(Executor, TaskOnMissingDeviceIsRefusedBeforeRunning) {
  Arenas arenas(2);
  Executor executor(arenas.pointers());
  GraphBuilder b;
  bool ran = false;
  b.add({.device = 0, .name = "ok"}, [&](TaskContext&) { ran = true; });
  b.add({.device = 5, .name = "far-away"});
  try {
    executor.run(b.build());
    FAIL();
  } catch (const GraphError& e) {
    EXPECT_NE(std::string(e.what()).find("'far-away' is placed on device 5"), std::string::npos);
  }
  EXPECT_FALSE(ran);
}

TEST(Executor, NestedRunFromATaskIsRefused) {
  Arenas arenas(1);
  Executor executor(arenas.pointers());
  GraphBuilder inner_builder;
  inner_builder.add({.name = "inner"});
  const Graph inner = inner_builder.build();
  GraphBuilder b;
  b.add({.name = "outer"}, [&](TaskContext&) { executor.run(inner); });
  try {
    executor.run(b.build());
    FAIL();
  } catch (const TaskError& e) {
    EXPECT_NE(std::string(e.what()).find("inside a task"), std::string::npos);
  }
}

TEST(Executor, TraceHasASpanPerTaskInStreamOrder) {
  auto limit = limit_threads(2);
  Arenas arenas(2);
  Executor executor(arenas.pointers());
  GraphBuilder b;
  for (DeviceId d = 0; d < 2; ++d) {
    for (int i = 0; i < 50; ++i)
      b.add({.device = d, .name = "t"});
  }
  const Graph g = b.build();
  const RunResult r = executor.run(g, {.record_trace = true});
  ASSERT_EQ(r.trace.spans().size(), g.size());
  for (const Span& s : r.trace.spans()) {
    EXPECT_LE(s.start, s.end);
    for (TaskId next : g.successors(s.task))
      EXPECT_LE(s.end, r.trace.find(next)->start);
  }
  EXPECT_TRUE(executor.run(g).trace.empty());
}

TEST(Executor, EmptyGraphRuns) {
  Arenas arenas(1);
  Executor executor(arenas.pointers());
  EXPECT_EQ(executor.run(Graph()).trace.spans().size(), 0u);
}

}  // namespace
}  // namespace weave::rt
