// Runtime cost per task: running and building graphs, against a oneTBB flow graph of the same
// shape; the event round trip between two streams; the virtual clock's replay rate.
//
// Threads. Each run benchmark takes T (1 or 2) as its argument, limits TBB with
// global_control(max_allowed_parallelism, T) and runs in one tbb::task_arena(T, 0): weave's
// executor gets it as its single device's arena, the flow graph is constructed and run inside
// it (a flow graph attaches to the arena it is constructed in).
//
// Shapes, with the same tasks and the same edges in both runtimes. In weave, tasks on one
// (device, stream) run in the order they were added: GraphBuilder::add() turns that into a
// stream-order edge from the stream's previous task, and the executor knows no other stream
// state. So the fair encoding gives each task a stream such that the stream-order edges are
// exactly edges of the shape, and calls precede() only for the rest:
//   chain      n tasks, each after the previous: all on one stream, ordered by the stream
//              alone (an explicit precede() as well would add each edge twice).
//   fanout     a source, n independent tasks, a sink (edges source -> task -> sink, made with
//              precede()): each independent task on its own named stream, so nothing but
//              those edges orders them; source and sink on the compute and comm streams.
//   fanout8    the same tasks and explicit edges, but the independent tasks round-robin over
//              eight named streams "s0".."s7", as a program with a handful of streams would
//              write it: stream order adds an edge from task i-8 to task i (n - 8 extra edges,
//              and eight chains instead of n independent tasks). Flow graph: same as fanout.
//   wavefront  an s x s grid, (i, j) after (i-1, j) and (i, j-1): column j on stream "c<j>",
//              whose stream order is the (i-1, j) edge; precede() gives the (i, j-1) one.
// Task bodies are the same in both: a relaxed increment of a per-thread counter on its own
// cache line (so the work moves no line between cores). The counters are summed after each
// benchmark to check that every task ran once per iteration.
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <malloc.h>
#include <tbb/flow_graph.h>
#include <tbb/global_control.h>
#include <tbb/task_arena.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
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
constexpr int kFan = 50'000;  // below the 65,535 stream names a graph can have
constexpr int kSide = 250;    // 62,500 tasks

// ------------------------------------------------------------------------------ task body

struct alignas(64) TaskCounter {
  std::atomic<std::uint64_t> n{0};
};
std::mutex g_counters_mutex;
std::deque<TaskCounter> g_counters;  // one per thread that ever ran a task; never freed

TaskCounter& my_counter() {
  thread_local TaskCounter* const c = [] {
    std::lock_guard lock(g_counters_mutex);
    return &g_counters.emplace_back();
  }();
  return *c;
}

// Only the owning thread writes its counter: a load and a store, no locked instruction.
void body() {
  TaskCounter& c = my_counter();
  c.n.store(c.n.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
}

std::uint64_t tasks_run() {
  std::lock_guard lock(g_counters_mutex);
  std::uint64_t total = 0;
  for (const TaskCounter& c : g_counters)
    total += c.n.load(std::memory_order_acquire);
  return total;
}

// Fails the benchmark unless exactly `expected` task bodies ran since `before`.
void check_count(benchmark::State& state, std::uint64_t before, std::uint64_t expected) {
  const std::uint64_t ran = tasks_run() - before;
  if (ran != expected) {
    state.SkipWithError(fmt::format("{} task bodies ran, expected {}", ran, expected).c_str());
  }
}

// Wall time per task, in seconds (the console prints it with an SI prefix, e.g. "21.3ns"):
// a rate of tasks per second (count / the benchmark's time, real time where UseRealTime),
// inverted.
void per_task(benchmark::State& state, std::uint64_t tasks, const char* name = "per_task") {
  state.counters[name] =
      benchmark::Counter(static_cast<double>(tasks) * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

// ---------------------------------------------------------------------------------- shapes

enum Shape { chain, fanout, fanout8, wavefront };

rt::Graph build_weave(Shape shape) {
  rt::GraphBuilder b;
  auto work = [](rt::TaskContext&) { body(); };
  if (shape == chain) {
    for (int i = 0; i < kChain; ++i)
      b.add({.name = "c"}, work);  // stream order chains them
  } else if (shape == fanout || shape == fanout8) {
    const int stream_count = shape == fanout ? kFan : 8;
    const rt::StreamId first = b.streams("s", stream_count);  // "s0", "s1", ...
    const rt::TaskId source = b.add({.stream = rt::kComputeStream, .name = "source"}, work);
    std::vector<rt::TaskId> leaves(kFan);
    for (int i = 0; i < kFan; ++i) {
      leaves[i] =
          b.add({.stream = static_cast<rt::StreamId>(first + i % stream_count), .name = "f"}, work);
      b.precede(source, leaves[i]);
    }
    const rt::TaskId sink = b.add({.stream = rt::kCommStream, .name = "sink"}, work);
    for (rt::TaskId t : leaves)
      b.precede(t, sink);
  } else {
    const rt::StreamId column = b.streams("c", kSide);  // column j on stream "c<j>"
    for (int i = 0; i < kSide; ++i) {
      rt::TaskId left = rt::kNoTask;
      for (int j = 0; j < kSide; ++j) {
        const rt::TaskId t =
            b.add({.stream = static_cast<rt::StreamId>(column + j), .name = "w"}, work);
        if (left != rt::kNoTask) b.precede(left, t);  // (i-1, j) is the stream's previous task
        left = t;
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
    FlowNode* prev = f.source = node();
    for (int i = 1; i < kChain; ++i) {
      FlowNode* n = node();
      tbb::flow::make_edge(*prev, *n);
      prev = n;
    }
  } else if (shape == fanout || shape == fanout8) {
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

// ------------------------------------------------------------------------------------ run

template <Shape S>
void BM_WeaveRun(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);
  tbb::task_arena arena(threads, 0);
  rt::Executor executor({&arena});
  const rt::Graph g = build_weave(S);
  executor.run(g);  // warm up: threads started, pages touched
  const std::uint64_t before = tasks_run();
  for (auto _ : state)
    executor.run(g);
  check_count(state, before, g.size() * state.iterations());
  per_task(state, g.size());
}

template <Shape S>
void BM_FlowRun(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);
  tbb::task_arena arena(threads, 0);
  std::optional<FlowGraph> f;
  arena.execute([&] {
    f.emplace();  // the graph attaches to the arena it is constructed in
    build_flow(*f, S);
  });
  auto once = [&] {
    arena.execute([&] {
      f->source->try_put(tbb::flow::continue_msg());
      f->graph.wait_for_all();
    });
  };
  once();
  const std::uint64_t before = tasks_run();
  for (auto _ : state)
    once();
  check_count(state, before, f->nodes.size() * state.iterations());
  per_task(state, f->nodes.size());
  arena.execute([&] { f.reset(); });
}

// ---------------------------------------------------------------------------------- build

// Times construction only: the previous graph is destroyed with the timer paused.
template <Shape S>
void BM_WeaveBuild(benchmark::State& state) {
  std::size_t tasks = 0;
  for (auto _ : state) {
    rt::Graph g = build_weave(S);
    tasks = g.size();
    state.PauseTiming();
    g = rt::Graph();
    state.ResumeTiming();
  }
  per_task(state, tasks);
}

template <Shape S>
void BM_FlowBuild(benchmark::State& state) {
  std::size_t tasks = 0;
  for (auto _ : state) {
    auto f = std::make_unique<FlowGraph>();
    build_flow(*f, S);
    tasks = f->nodes.size();
    state.PauseTiming();
    f.reset();
    state.ResumeTiming();
  }
  per_task(state, tasks);
}

// ------------------------------------------------------------------------ event round trip

// Ping-pong in a graph: round i is a_i on one stream, which signals `ping` to i, and b_i on
// another, which waits for ping >= i and signals `pong` to i; a_{i+1} waits for pong >= i.
// Reported per round trip (two hand-offs). Argument 1: the two streams are compute and comm of
// one device, whose arena has 2 slots; 2: the compute stream of device 0 and the comm stream
// of device 1, each device an arena of one slot, so every hand-off crosses threads.
void BM_EventRoundTripGraph(benchmark::State& state) {
  const bool two_devices = state.range(0) == 2;
  constexpr int kRounds = 20'000;
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, 2);
  tbb::task_arena a0(two_devices ? 1 : 2, 0), a1(1, 0);
  std::vector<tbb::task_arena*> arenas{&a0};
  if (two_devices) arenas.push_back(&a1);
  rt::Executor executor(arenas);
  rt::GraphBuilder b;
  const rt::EventId ping = b.event("ping"), pong = b.event("pong");
  auto work = [](rt::TaskContext&) { body(); };
  for (int i = 1; i <= kRounds; ++i) {
    const auto v = static_cast<std::uint64_t>(i);
    const rt::TaskId a = b.add({.device = 0, .name = "a"}, work);
    const rt::TaskId c =
        b.add({.device = two_devices ? 1u : 0u, .stream = rt::kCommStream, .name = "b"}, work);
    b.signal(a, ping, v);
    b.wait(c, ping, v);
    b.signal(c, pong, v);
    if (i > 1) b.wait(a, pong, v - 1);
  }
  const rt::Graph g = b.build();
  executor.run(g);
  const std::uint64_t before = tasks_run();
  for (auto _ : state)
    executor.run(g);
  check_count(state, before, g.size() * state.iterations());
  per_task(state, kRounds, "per_round_trip");
}

// The same ping-pong in eager mode, with Stream and Event: stream A runs a task and signals
// ping, stream B waits for ping, runs a task and signals pong, A waits for pong. Everything is
// enqueued behind a gate event first and the clock runs from opening the gate (a host
// signal) to the end of the last round, so the host's enqueueing is not timed. Argument as
// for the graph version.
void BM_EventRoundTripEager(benchmark::State& state) {
  const bool two_devices = state.range(0) == 2;
  constexpr int kRounds = 5'000;
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, 2);
  tbb::task_arena a0(two_devices ? 1 : 2, 0), a1(1, 0);
  std::vector<tbb::task_arena*> arenas{&a0};
  if (two_devices) arenas.push_back(&a1);
  rt::Executor executor(arenas);
  rt::Stream sa = executor.stream(0), sb = executor.stream(two_devices ? 1 : 0, rt::kCommStream);
  const std::uint64_t before = tasks_run();
  for (auto _ : state) {
    rt::Event gate("gate"), ping("ping"), pong("pong");
    sa.wait(gate, 1);
    for (int i = 1; i <= kRounds; ++i) {
      const auto v = static_cast<std::uint64_t>(i);
      sa.enqueue("a", body);
      sa.signal(ping, v);
      sb.wait(ping, v);
      sb.enqueue("b", body);
      sb.signal(pong, v);
      sa.wait(pong, v);
    }
    const auto t0 = std::chrono::steady_clock::now();
    gate.signal(1);
    executor.wait(pong, kRounds);
    const auto t1 = std::chrono::steady_clock::now();
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
    sa.synchronize();
    sb.synchronize();
  }
  check_count(state, before, 2ull * kRounds * state.iterations());
  per_task(state, kRounds, "per_round_trip");
}

// -------------------------------------------------------------------------- virtual clock

// Replays a 1,000,000-task graph on the virtual clock with the work skipped and no trace: a
// 1000 x 1000 wavefront over 8 devices (columns 0-124 on device 0, ...), column j on its own
// stream of its device, compute tasks of three sizes, so each device's compute engine has
// many ready tasks to choose from and every row crosses devices 7 times.
void BM_VirtualClock(benchmark::State& state) {
  constexpr int kRows = 1000, kCols = 1000, kDevices = 8;
  rt::GraphBuilder b;
  b.reserve(static_cast<std::size_t>(kRows) * kCols, static_cast<std::size_t>(kRows) * kCols);
  const rt::StreamId column = b.streams("c", kCols);
  for (int i = 0; i < kRows; ++i) {
    rt::TaskId left = rt::kNoTask;
    for (int j = 0; j < kCols; ++j) {
      const rt::TaskId t = b.add({.device = static_cast<rt::DeviceId>(j / (kCols / kDevices)),
                                  .stream = static_cast<rt::StreamId>(column + j),
                                  .name = "w",
                                  .cost = {.flops = 1e6 * (1 + (i + j) % 3)}});
      if (left != rt::kNoTask) b.precede(left, t);
      left = t;
    }
  }
  const rt::Graph g = b.build();
  const rt::UniformCostModel model(1e11, 2'000, 20e9);
  rt::VirtualClock clock(model, {.execute = false, .record_trace = false});
  rt::Nanos makespan = 0;
  for (auto _ : state)
    makespan = clock.run(g).makespan;
  state.counters["tasks_per_s"] =
      benchmark::Counter(static_cast<double>(g.size()) * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
  state.counters["makespan_ms"] = static_cast<double>(makespan) * 1e-6;
}

}  // namespace

#define WEAVE_RUN_BENCH(fn) \
  BENCHMARK(fn)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime()
WEAVE_RUN_BENCH(BM_WeaveRun<chain>);
WEAVE_RUN_BENCH(BM_FlowRun<chain>);
WEAVE_RUN_BENCH(BM_WeaveRun<fanout>);
WEAVE_RUN_BENCH(BM_WeaveRun<fanout8>);
WEAVE_RUN_BENCH(BM_FlowRun<fanout>);
WEAVE_RUN_BENCH(BM_WeaveRun<wavefront>);
WEAVE_RUN_BENCH(BM_FlowRun<wavefront>);
BENCHMARK(BM_WeaveBuild<chain>)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FlowBuild<chain>)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_WeaveBuild<fanout>)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_WeaveBuild<fanout8>)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FlowBuild<fanout>)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_WeaveBuild<wavefront>)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FlowBuild<wavefront>)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_EventRoundTripGraph)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_EventRoundTripEager)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_VirtualClock)->Unit(benchmark::kMillisecond);

// WEAVE_BENCH_RETAIN_MEMORY=1 keeps freed memory in the process: glibc otherwise hands large
// freed blocks back to the kernel, so each rebuilt graph first-touches fresh pages (a page
// fault costs microseconds on this host). With it the build figures show a process that keeps
// building graphs in memory it already owns; without it, a process building a graph afresh.
int main(int argc, char** argv) {
  if (const char* retain = std::getenv("WEAVE_BENCH_RETAIN_MEMORY"); retain && *retain == '1') {
    // glibc refuses an mmap threshold above 32 MiB (HEAP_MAX_SIZE / 2) and keeps its default
    // then, so ask for that maximum rather than more.
    if (mallopt(M_MMAP_THRESHOLD, 32 << 20) != 1 || mallopt(M_TRIM_THRESHOLD, 1 << 30) != 1) {
      std::fprintf(stderr, "WEAVE_BENCH_RETAIN_MEMORY: mallopt refused the thresholds\n");
      return 1;
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
