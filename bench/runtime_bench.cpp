// Runtime cost per task: building and running prebuilt graphs against a oneTBB flow graph of
// the same shape, the event round trip between two streams, and the virtual clock's replay rate.
//
// Shapes, the same tasks and edges for weave and the flow graph:
//   chain      n tasks, each after the previous: weave puts them on one stream.
//   fanout     a source, n independent tasks, a sink: weave gives each independent task its
//              own stream, since tasks on one stream run in order by design.
//   wavefront  an s x s grid, (i, j) after (i-1, j) and (i, j-1): weave puts column j on
//              stream j, whose order is the (i-1, j) edge anyway.
// Task bodies are a per-thread counter increment in both. Threads: TBB's max_allowed_parallelism
// is set to T and both run in one arena of T slots (weave: one device).
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <tbb/flow_graph.h>
#include <tbb/global_control.h>
#include <tbb/task_arena.h>

#include <malloc.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <vector>

#include "weave/runtime/cost_model.hpp"
#include "weave/runtime/event.hpp"
#include "weave/runtime/executor.hpp"
#include "weave/runtime/stream.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace {

using namespace weave;
using FlowNode = tbb::flow::continue_node<tbb::flow::continue_msg>;

constexpr int kChain = 100'000;
constexpr int kFan = 50'000;
constexpr int kSide = 250;  // 62,500 tasks

// The task body: a per-thread counter, so that the work itself moves no cache line between
// cores and only the runtimes' own hand-offs are measured.
thread_local long t_counter = 0;
void body() {
  benchmark::DoNotOptimize(++t_counter);
}

enum Shape { chain, fanout, wavefront };

// Names the streams a shape needs. Kept out of the build timing: a model names a handful of
// streams, while the fan-out encoding here names one per task.
void name_streams(rt::GraphBuilder& b, Shape shape) {
  const int streams = shape == fanout ? kFan : shape == wavefront ? kSide : 0;
  for (int i = 0; i < streams; ++i)
    b.stream(fmt::format("s{}", i));
}

rt::Graph build_weave(Shape shape, rt::GraphBuilder b) {
  auto work = [](rt::TaskContext&) { body(); };
  if (shape == chain) {
    rt::TaskId prev = rt::kNoTask;
    for (int i = 0; i < kChain; ++i) {
      const rt::TaskId t = b.add({.name = "c"}, work);
      if (prev != rt::kNoTask) b.precede(prev, t);
      prev = t;
    }
  } else if (shape == fanout) {
    const rt::TaskId source = b.add({.name = "source"}, work);
    std::vector<rt::TaskId> leaves(kFan);
    for (int i = 0; i < kFan; ++i) {
      leaves[i] = b.add({.stream = static_cast<rt::StreamId>(i + 2), .name = "f"}, work);
      b.precede(source, leaves[i]);
    }
    const rt::TaskId sink = b.add({.name = "sink"}, work);
    for (rt::TaskId t : leaves)
      b.precede(t, sink);
  } else {
    std::vector<rt::TaskId> above(kSide, rt::kNoTask);
    for (int i = 0; i < kSide; ++i) {
      rt::TaskId left = rt::kNoTask;
      for (int j = 0; j < kSide; ++j) {
        const rt::TaskId t = b.add({.stream = static_cast<rt::StreamId>(j + 2), .name = "w"}, work);
        if (above[j] != rt::kNoTask) b.precede(above[j], t);
        if (left != rt::kNoTask) b.precede(left, t);
        above[j] = left = t;
      }
    }
  }
  return b.build();
}

struct FlowGraph {
  tbb::flow::graph graph;
  std::vector<std::unique_ptr<FlowNode>> nodes;
  FlowNode* source = nullptr;
};

void build_flow(FlowGraph& f, Shape shape) {
  auto node = [&] {
    f.nodes.push_back(std::make_unique<FlowNode>(f.graph, [](tbb::flow::continue_msg) { body(); }));
    return f.nodes.back().get();
  };
  if (shape == chain) {
    FlowNode* prev = nullptr;
    for (int i = 0; i < kChain; ++i) {
      FlowNode* n = node();
      if (prev)
        tbb::flow::make_edge(*prev, *n);
      else
        f.source = n;
      prev = n;
    }
  } else if (shape == fanout) {
    f.source = node();
    std::vector<FlowNode*> leaves(kFan);
    for (int i = 0; i < kFan; ++i) {
      leaves[i] = node();
      tbb::flow::make_edge(*f.source, *leaves[i]);
    }
    FlowNode* sink = node();
    for (FlowNode* l : leaves)
      tbb::flow::make_edge(*l, *sink);
  } else {
    std::vector<FlowNode*> above(kSide, nullptr);
    for (int i = 0; i < kSide; ++i) {
      FlowNode* left = nullptr;
      for (int j = 0; j < kSide; ++j) {
        FlowNode* n = node();
        if (above[j]) tbb::flow::make_edge(*above[j], *n);
        if (left) tbb::flow::make_edge(*left, *n);
        if (!above[j] && !left) f.source = n;
        above[j] = left = n;
      }
    }
  }
}

// Reports wall time per task in ns (a rate of tasks, inverted, in units of 1e9 tasks).
void per_task(benchmark::State& state, std::size_t tasks, const char* name = "ns_per_task") {
  state.counters[name] = benchmark::Counter(
      static_cast<double>(tasks) * static_cast<double>(state.iterations()) * 1e-9,
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

template <Shape S>
void BM_WeaveRun(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);
  tbb::task_arena arena(threads, 0);
  rt::Executor executor({&arena});
  rt::GraphBuilder b;
  name_streams(b, S);
  const rt::Graph g = build_weave(S, std::move(b));
  executor.run(g);  // warm up: threads started, pages touched
  for (auto _ : state)
    executor.run(g);
  per_task(state, g.size());
}

template <Shape S>
void BM_FlowRun(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);
  tbb::task_arena arena(threads, 0);
  FlowGraph f;
  build_flow(f, S);
  auto once = [&] {
    arena.execute([&] {
      f.source->try_put(tbb::flow::continue_msg());
      f.graph.wait_for_all();
    });
  };
  once();
  for (auto _ : state)
    once();
  per_task(state, f.nodes.size());
}

template <Shape S>
void BM_WeaveBuild(benchmark::State& state) {
  std::size_t tasks = 0;
  for (auto _ : state) {
    state.PauseTiming();
    rt::GraphBuilder b;
    name_streams(b, S);
    state.ResumeTiming();
    const rt::Graph g = build_weave(S, std::move(b));
    tasks = g.size();
    benchmark::DoNotOptimize(g.size());
  }
  per_task(state, tasks);
}

template <Shape S>
void BM_FlowBuild(benchmark::State& state) {
  std::size_t tasks = 0;
  for (auto _ : state) {
    FlowGraph f;
    build_flow(f, S);
    tasks = f.nodes.size();
  }
  per_task(state, tasks);
}

// Ping-pong between the compute and comm streams of one device, or between two devices:
// A_i signals, B_i waits for it and signals back, A_{i+1} waits for B_i. Reported per round
// trip (two hand-offs).
void BM_EventRoundTripGraph(benchmark::State& state) {
  const bool two_devices = state.range(0) == 2;
  constexpr int kRounds = 20'000;
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, 2);
  tbb::task_arena a0(1, 0), a1(1, 0);
  std::vector<tbb::task_arena*> arenas{&a0};
  if (two_devices) arenas.push_back(&a1);
  rt::Executor executor(arenas);
  rt::GraphBuilder b;
  const rt::EventId ping = b.event("ping"), pong = b.event("pong");
  auto work = [](rt::TaskContext&) { body(); };
  for (int i = 0; i < kRounds; ++i) {
    const rt::TaskId a = b.add({.device = 0, .name = "a"}, work);
    const rt::TaskId c = b.add({.device = two_devices ? 1u : 0u,
                                .stream = rt::kCommStream,
                                .kind = rt::TaskKind::comm,
                                .name = "b"},
                               work);
    b.signal(a, ping, static_cast<std::uint64_t>(i + 1));
    b.wait(c, ping, static_cast<std::uint64_t>(i + 1));
    b.signal(c, pong, static_cast<std::uint64_t>(i + 1));
    if (i > 0) b.wait(a, pong, static_cast<std::uint64_t>(i));
  }
  const rt::Graph g = b.build();
  executor.run(g);
  for (auto _ : state)
    executor.run(g);
  per_task(state, kRounds, "ns_per_round_trip");
}

// The same ping-pong in eager mode, through Event objects and two streams.
void BM_EventRoundTripEager(benchmark::State& state) {
  constexpr int kRounds = 2'000;
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, 2);
  tbb::task_arena a0(1, 0), a1(1, 0);
  rt::Executor executor({&a0, &a1});
  rt::Stream s0 = executor.stream(0), s1 = executor.stream(1, rt::kCommStream);
  std::uint64_t v = 0;
  for (auto _ : state) {
    rt::Event ping("ping"), pong("pong");
    for (int i = 1; i <= kRounds; ++i) {
      s0.enqueue("a", body);
      s0.signal(ping, static_cast<std::uint64_t>(i));
      s1.wait(ping, static_cast<std::uint64_t>(i));
      s1.enqueue("b", body);
      s1.signal(pong, static_cast<std::uint64_t>(i));
      s0.wait(pong, static_cast<std::uint64_t>(i));
    }
    s0.synchronize();
    v += pong.value();
  }
  benchmark::DoNotOptimize(v);
  per_task(state, kRounds, "ns_per_round_trip");
}

// Replaying a 1 M-task graph (a 1000 x 1000 wavefront over 64 devices with an all-to-all
// every tenth row) on the virtual clock, work skipped.
void BM_VirtualClock(benchmark::State& state) {
  constexpr int kRows = 1000, kCols = 1000;
  rt::GraphBuilder b;
  b.reserve(static_cast<std::size_t>(kRows) * kCols, 2ull * kRows * kCols);
  std::vector<rt::TaskId> above(kCols, rt::kNoTask);
  for (int i = 0; i < kRows; ++i) {
    rt::TaskId left = rt::kNoTask;
    for (int j = 0; j < kCols; ++j) {
      const rt::TaskId t = b.add({.device = static_cast<rt::DeviceId>(j % 64),
                                  .name = "w",
                                  .cost = {.flops = 1e6 * (1 + (i + j) % 3)}});
      if (above[j] != rt::kNoTask) b.precede(above[j], t);
      if (left != rt::kNoTask && j % 64 != 0) b.precede(left, t);
      above[j] = left = t;
    }
  }
  const rt::Graph g = b.build();
  const rt::UniformCostModel model(1e11, 2'000, 20e9);
  rt::VirtualClock clock(model, {.record_trace = false});
  rt::Nanos makespan = 0;
  for (auto _ : state)
    makespan = clock.run(g).makespan;
  state.counters["tasks_per_s"] =
      benchmark::Counter(static_cast<double>(g.size()) * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
  state.counters["makespan_ms"] = static_cast<double>(makespan) * 1e-6;
}

}  // namespace

BENCHMARK(BM_WeaveRun<chain>)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_FlowRun<chain>)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_WeaveRun<fanout>)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_FlowRun<fanout>)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_WeaveRun<wavefront>)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_FlowRun<wavefront>)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_WeaveBuild<chain>)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FlowBuild<chain>)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_WeaveBuild<fanout>)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FlowBuild<fanout>)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_WeaveBuild<wavefront>)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FlowBuild<wavefront>)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_EventRoundTripGraph)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_EventRoundTripEager)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_VirtualClock)->Unit(benchmark::kMillisecond);

// WEAVE_BENCH_RETAIN_MEMORY=1 keeps freed memory in the process (glibc otherwise returns
// large blocks to the kernel, and every rebuilt graph first-touches fresh pages): build costs
// then show the steady state of a process that keeps building graphs, without page faults.
int main(int argc, char** argv) {
  if (const char* retain = std::getenv("WEAVE_BENCH_RETAIN_MEMORY"); retain && *retain == '1') {
    mallopt(M_MMAP_THRESHOLD, 1 << 30);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
