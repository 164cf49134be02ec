// Kernel speed: GEMM GFLOP/s against the host's derived fp32 peak, and attention forward +
// backward time.
//
// The peak is derived, not measured: FLOP per cycle = 2 (an FMA is a multiply and an add) x
// fp32 lanes per FMA instruction x FMA instructions per cycle, times the clock. Zen 4 runs
// AVX-512 FMAs as two 256-bit halves on two 256-bit FMA pipes: 2 x 8 x 2 = 32 FLOP/cycle, the
// same as AVX2 on two pipes; Intel cores with AVX-512 and two 512-bit FMA ports reach 64. The
// clock is measured: a chain of dependent integer adds retires one add per cycle, so adds per
// second is the running clock (boost included; /proc/cpuinfo's "cpu MHz" is often the base
// clock instead). WEAVE_PEAK_GFLOPS overrides the result.
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <tbb/global_control.h>
#include <tbb/task_arena.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>

#include "weave/ops/attention.hpp"
#include "weave/ops/gemm.hpp"
#include "weave/ops/tensor.hpp"

namespace {

using namespace weave;

struct Peak {
  double ghz = 0;
  int flop_per_cycle = 0;
  double gflops_per_core() const { return ghz * flop_per_cycle; }
};

// Cycles per second of the calling thread's core, from a chain of dependent adds.
double measured_ghz() {
#if defined(__x86_64__)
  constexpr int kRounds = 2'000'000;
  double best = 0;
  for (int attempt = 0; attempt < 5; ++attempt) {
    std::uint64_t x = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kRounds; ++i) {
      // 50 adds, each waiting for the one before: 50 cycles.
      asm volatile(
          ".rept 50\n\t"
          "add $1, %0\n\t"
          ".endr"
          : "+r"(x));
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 50.0 * kRounds / s * 1e-9);
  }
  return best;
#else
  return 0;
#endif
}

Peak derive_peak() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line, vendor, flags;
  double mhz = 0;
  while (std::getline(cpuinfo, line)) {
    const auto value = line.substr(line.find(':') + 1);
    if (line.rfind("vendor_id", 0) == 0 && vendor.empty()) vendor = value;
    if (line.rfind("cpu MHz", 0) == 0 && mhz == 0) mhz = std::atof(value.c_str());
    if (line.rfind("flags", 0) == 0 && flags.empty()) flags = value + " ";
  }
  const bool avx512 = flags.find(" avx512f ") != std::string::npos;
  const bool fma = flags.find(" fma ") != std::string::npos;
  const bool amd = vendor.find("AMD") != std::string::npos;
  int lanes = 4, pipes = fma ? 2 : 1;
  if (fma) lanes = 8;
  if (avx512 && !amd) lanes = 16;  // Zen 4 double-pumps 512-bit FMAs through 256-bit pipes
  const double ghz = measured_ghz();
  return {ghz > 0 ? ghz : mhz / 1000.0, (fma ? 2 : 1) * lanes * pipes};
}

double peak_gflops_per_core() {
  static const double peak = [] {
    if (const char* v = std::getenv("WEAVE_PEAK_GFLOPS")) return std::atof(v);
    const Peak p = derive_peak();
    fmt::print("fp32 peak per core: {:.2f} GHz x {} FLOP/cycle = {:.1f} GFLOP/s\n", p.ghz,
               p.flop_per_cycle, p.gflops_per_core());
    return p.gflops_per_core();
  }();
  return peak;
}

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
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state)
    once();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double gflops = 2.0 * static_cast<double>(n * n * n) *
                        static_cast<double>(state.iterations()) * 1e-9 / seconds;
  state.counters["GFLOP/s"] = gflops;
  // Per core, as a percentage of the derived peak.
  state.counters["peak%"] = 100.0 * gflops / (threads * peak_gflops_per_core());
}

// Causal attention, forward then backward, [1, s, 8 heads, 64]: the flops of the two products
// forward (half of them masked away) and the four backward (recomputing the scores).
void BM_Attention(benchmark::State& state) {
  const std::int64_t s = state.range(0), heads = 8, d = 64;
  const int threads = static_cast<int>(state.range(1));
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);
  tbb::task_arena arena(threads, 0);
  const ops::Shape shape{1, s, heads, d};
  const ops::Tensor q = random_tensor(shape, 1), k = random_tensor(shape, 2),
                    v = random_tensor(shape, 3), d_o = random_tensor(shape, 4);
  const ops::Tensor o = ops::Tensor::empty(shape), lse = ops::Tensor::empty({1, heads, s});
  const ops::Tensor dq = ops::Tensor::empty(shape), dk = ops::Tensor::zeros(shape),
                    dv = ops::Tensor::zeros(shape);
  auto once = [&] {
    arena.execute([&] {
      ops::attention_forward({}, q, k, v, o, lse);
      ops::attention_backward({}, q, k, v, o, lse, d_o, dq, dk, dv);
    });
  };
  once();
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state)
    once();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Causal: about half of the s x s scores; forward 2 products, backward 5 (scores again, dV,
  // dP, dQ, dK), each 2 s^2 d / 2 FLOP per head.
  const double flops = 7.0 * static_cast<double>(s * s * d) * heads;
  state.counters["GFLOP/s"] = flops * 1e-9 * static_cast<double>(state.iterations()) / seconds;
}

}  // namespace

BENCHMARK(BM_Gemm)
    ->ArgsProduct({{128, 256, 512, 1024, 2048}, {1, 2}})
    ->ArgNames({"n", "threads"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Attention)
    ->ArgsProduct({{512, 2048}, {1, 2}})
    ->ArgNames({"seq", "threads"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  peak_gflops_per_core();  // prints the derivation first
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
