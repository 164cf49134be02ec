// Shared-memory collectives in the style of nccl-tests: time per operation, algorithm bandwidth
// algbw = S / t and bus bandwidth busbw = algbw x the nccl-tests factor (all-reduce 2(n-1)/n,
// all-gather, reduce-scatter and all-to-all (n-1)/n), for 2, 4 and 8 devices from 8 B to
// 64 MiB, the link model off. S follows nccl-tests: the all-reduce buffer, the all-gather
// output, the reduce-scatter input, each rank's all-to-all buffer. In the same run, memcpy
// bandwidth (S / t for copying S bytes) on one thread and split over two, to compare against.
#include <benchmark/benchmark.h>
#include <tbb/global_control.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/runtime/executor.hpp"

namespace {

using namespace weave;

enum Op { all_reduce, all_gather, reduce_scatter, all_to_all };

double bus_factor(Op op, int n) {
  const double f = static_cast<double>(n - 1) / n;
  return op == all_reduce ? 2 * f : f;
}

template <Op op>
void BM_Collective(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  const std::size_t bytes = static_cast<std::size_t>(state.range(1));
  const std::size_t count =
      std::max<std::size_t>(bytes / sizeof(float), static_cast<std::size_t>(n));
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, 2);
  std::vector<std::unique_ptr<tbb::task_arena>> arenas;
  std::vector<tbb::task_arena*> raw;
  for (int d = 0; d < n; ++d) {
    arenas.push_back(std::make_unique<tbb::task_arena>(1, 0));
    raw.push_back(arenas.back().get());
  }
  rt::Executor executor(raw);
  std::vector<rt::DeviceId> devices(static_cast<std::size_t>(n));
  std::iota(devices.begin(), devices.end(), 0u);
  const devices::ProcessGroup group("bench", devices);
  devices::SharedMemoryCommunicator comm;
  // Inputs and outputs sized per nccl-tests' convention; touched once so no page faults count.
  const std::size_t per_rank = op == all_reduce || op == all_to_all ? count : count / n;
  const std::size_t in_size = op == all_gather ? per_rank : count;
  const std::size_t out_size = op == reduce_scatter ? per_rank : count;
  std::vector<std::vector<float>> in(n, std::vector<float>(in_size, 1.f)),
      out(n, std::vector<float>(out_size, 0.f));
  std::vector<std::span<float>> in_mut;
  std::vector<std::span<const float>> in_const;
  std::vector<std::span<float>> out_mut;
  for (int r = 0; r < n; ++r) {
    in_mut.emplace_back(in[r]);
    in_const.emplace_back(in[r]);
    out_mut.emplace_back(out[r]);
  }
  rt::GraphBuilder b;
  if constexpr (op == all_reduce) comm.all_reduce(b, group, in_mut, devices::ReduceOp::sum);
  if constexpr (op == all_gather) comm.all_gather(b, group, in_const, out_mut);
  if constexpr (op == reduce_scatter)
    comm.reduce_scatter(b, group, in_const, out_mut, devices::ReduceOp::sum);
  if constexpr (op == all_to_all) comm.all_to_all(b, group, in_const, out_mut);
  const rt::Graph graph = b.build();
  executor.run(graph);
  for (auto _ : state)
    executor.run(graph);
  const double s = static_cast<double>(count * sizeof(float));
  state.counters["algbw_GB/s"] = benchmark::Counter(
      s * 1e-9 * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["busbw_GB/s"] =
      benchmark::Counter(s * 1e-9 * bus_factor(op, n) * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
}

// Copies S bytes on `threads` threads, each its contiguous share.
void BM_Memcpy(benchmark::State& state) {
  const std::size_t bytes = static_cast<std::size_t>(state.range(0));
  const int threads = static_cast<int>(state.range(1));
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, 2);
  tbb::task_arena arena(threads, 0);
  std::vector<char> from(bytes, 1), to(bytes, 0);
  auto once = [&] {
    arena.execute([&] {
      tbb::parallel_for(
          0, threads,
          [&](int t) {
            const std::size_t first = bytes * t / threads, last = bytes * (t + 1) / threads;
            std::memcpy(to.data() + first, from.data() + first, last - first);
          },
          tbb::static_partitioner());
    });
  };
  once();
  for (auto _ : state)
    once();
  state.counters["GB/s"] = benchmark::Counter(
      static_cast<double>(bytes) * 1e-9 * static_cast<double>(state.iterations()),
      benchmark::Counter::kIsRate);
}

void sizes(benchmark::internal::Benchmark* b) {
  for (int n : {2, 4, 8})
    for (std::int64_t s = 8; s <= (64 << 20); s *= 8)
      b->Args({n, s});
  for (int n : {2, 4, 8})
    b->Args({n, 64 << 20});
}

}  // namespace

BENCHMARK(BM_Memcpy)
    ->ArgsProduct({{8, 512, 32 << 10, 2 << 20, 16 << 20, 64 << 20}, {1, 2}})
    ->ArgNames({"bytes", "threads"})
    ->UseRealTime();
BENCHMARK(BM_Collective<all_reduce>)->Apply(sizes)->ArgNames({"n", "bytes"})->UseRealTime();
BENCHMARK(BM_Collective<all_gather>)->Apply(sizes)->ArgNames({"n", "bytes"})->UseRealTime();
BENCHMARK(BM_Collective<reduce_scatter>)->Apply(sizes)->ArgNames({"n", "bytes"})->UseRealTime();
BENCHMARK(BM_Collective<all_to_all>)->Apply(sizes)->ArgNames({"n", "bytes"})->UseRealTime();
BENCHMARK_MAIN();
