// Kernel speed: fp32 and bf16 matrix products in GFLOP/s, as a percentage of the host's peak
// measured in the same run (bench/measured_peak.hpp), and attention forward + backward time.
//
// Products: squares of 512-2048 in a linear layer's forward layout, and the products of a
// transformer layer of issue 24's benchmark (hidden 1024, sequence 512, micro-batch 4: 2048
// tokens; fused QKV 1024 -> 3072, the MLP's 1024 -> 4096 and 4096 -> 1024) in their forward,
// input-gradient and weight-gradient layouts. Each runs on 1 and 2 threads of one arena, timed on
// the process's CPU time divided by the threads (the peaks are CPU-time rates too). peak%
// is against the measured peak of the same precision and thread count: the FMA loop for fp32,
// the AMX loop for bf16 where oneDNN uses AMX (the vdpbf16ps loop otherwise); dpbf16% is bf16
// against the vdpbf16ps loop, the peak of a CPU with AVX512_BF16 but no AMX (AMD Zen 4, 5).
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <tbb/global_control.h>
#include <tbb/task_arena.h>

#include <chrono>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "measured_peak.hpp"
#include "weave/ops/attention.hpp"
#include "weave/ops/bfloat16.hpp"
#include "weave/ops/gemm.hpp"
#include "weave/ops/gemm_bf16.hpp"
#include "weave/ops/tensor.hpp"

namespace {

using namespace weave;
using bench::PeakKind;

// GFLOP/s of each loop on 1 and 2 threads, measured once, before the benchmarks.
struct Peaks {
  std::map<std::pair<PeakKind, int>, double> gflops;
  double of(PeakKind kind, int threads) const { return gflops.at({kind, threads}); }
};

const Peaks& peaks() {
  static const Peaks p = [] {
    Peaks r;
    const std::pair<PeakKind, const char*> kinds[] = {{PeakKind::fp32_fma, "fp32 vfmadd231ps"},
                                                      {PeakKind::bf16_dot, "bf16 vdpbf16ps"},
                                                      {PeakKind::amx_bf16, "bf16 AMX tdpbf16ps"}};
    for (const auto& [kind, name] : kinds)
      for (int threads : {1, 2}) {
        r.gflops[{kind, threads}] = bench::measured_peak_gflops(kind, threads);
        fmt::print("measured peak, {} on {} thread{}: {:.1f} GFLOP/s\n", name, threads,
                   threads > 1 ? "s" : "", r.gflops[{kind, threads}]);
      }
    fmt::print("bf16 products run on: {}\n", ops::to_string(ops::bf16_kernel()));
    return r;
  }();
  return p;
}

double percent(double gflops, double peak) {
  return peak > 0 ? 100.0 * gflops / peak : 0;
}

ops::Tensor random_tensor(const ops::Shape& shape, unsigned seed) {
  ops::Tensor t = ops::Tensor::empty(shape);
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  for (std::int64_t i = 0; i < t.numel(); ++i)
    t.data()[i] = dist(gen);
  return t;
}

std::vector<ops::bf16> rounded(const ops::Tensor& t) {
  std::vector<ops::bf16> out(static_cast<std::size_t>(t.numel()));
  ops::to_bf16({t.data(), out.size()}, out);
  return out;
}

// One product C [m, n] = op(A) op(B), in a linear layer's layouts:
//   forward         y [t, out] = x [t, in] w [out, in]^T       (no, yes)
//   input gradient  dx [t, in] = dy [t, out] w [out, in]       (no, no)
//   weight gradient dw [out, in] += dy [t, out]^T x [t, in]    (yes, no), fp32 dw
struct Product {
  std::int64_t m, n, k;
  bool ta, tb;
  bool accumulate;  // beta = 1 (a weight gradient)
};

// The product in fp32 (gemm<float>) or bf16 (gemm_bf16: bf16 C, fp32 C for a weight gradient),
// on `threads` threads of one arena.
void run_product(benchmark::State& state, const Product& p, bool bf16, int threads) {
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);
  tbb::task_arena arena(threads, 0);
  const ops::Tensor a = random_tensor({p.ta ? p.k : p.m, p.ta ? p.m : p.k}, 1);
  const ops::Tensor b = random_tensor({p.tb ? p.n : p.k, p.tb ? p.k : p.n}, 2);
  ops::Tensor c = ops::Tensor::zeros({p.m, p.n});
  const std::vector<ops::bf16> ah = rounded(a), bh = rounded(b);
  std::vector<ops::bf16> ch(static_cast<std::size_t>(p.m * p.n));
  const auto ta = p.ta ? ops::Transpose::yes : ops::Transpose::no;
  const auto tb = p.tb ? ops::Transpose::yes : ops::Transpose::no;
  const float beta = p.accumulate ? 1.f : 0.f;
  auto once = [&] {
    arena.execute([&] {
      if (!bf16) {
        ops::gemm<float>(ta, tb, 1.f, {a.data(), a.dim(0), a.dim(1), a.dim(1)},
                         {b.data(), b.dim(0), b.dim(1), b.dim(1)}, beta, {c.data(), p.m, p.n, p.n});
      } else if (p.accumulate) {
        ops::gemm_bf16(ta, tb, 1.f, {ah.data(), a.dim(0), a.dim(1), a.dim(1)},
                       {bh.data(), b.dim(0), b.dim(1), b.dim(1)}, beta,
                       ops::MatrixView<float>{c.data(), p.m, p.n, p.n});
      } else {
        ops::gemm_bf16(ta, tb, 1.f, {ah.data(), a.dim(0), a.dim(1), a.dim(1)},
                       {bh.data(), b.dim(0), b.dim(1), b.dim(1)}, beta,
                       ops::MatrixView<ops::bf16>{ch.data(), p.m, p.n, p.n});
      }
    });
  };
  once();  // oneDNN compiles its kernel for the shape here
  // On the process's CPU time shared by the arena's threads, as the peak is measured: on a host
  // where other processes share the cores, the wall clock also counts the waits for a core.
  const double t0 = bench::process_cpu_seconds();
  for (auto _ : state)
    once();
  const double seconds = (bench::process_cpu_seconds() - t0) / threads;
  const double gflops = 2.0 * static_cast<double>(p.m) * static_cast<double>(p.n) *
                        static_cast<double>(p.k) * static_cast<double>(state.iterations()) * 1e-9 /
                        seconds;
  state.counters["GFLOP/s"] = gflops;
  const bool amx = ops::bf16_kernel() == ops::Bf16Kernel::amx;
  const PeakKind own = !bf16 ? PeakKind::fp32_fma : amx ? PeakKind::amx_bf16 : PeakKind::bf16_dot;
  state.counters["peak%"] = percent(gflops, peaks().of(own, threads));
  if (bf16) state.counters["dpbf16%"] = percent(gflops, peaks().of(PeakKind::bf16_dot, threads));
}

// range(0): n; range(1): 0 fp32, 1 bf16; range(2): threads. C[n, n] = A[n, n] B[n, n]^T.
void BM_GemmSquare(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  run_product(state, {n, n, n, false, true, false}, state.range(1) != 0,
              static_cast<int>(state.range(2)));
}

// The products of one transformer layer of issue 24's benchmark: 2048 tokens.
// range(0): which product (below); range(1): 0 fp32, 1 bf16; range(2): threads.
constexpr std::int64_t kTokens = 4 * 512, kHidden = 1024;
const std::vector<std::pair<std::string, Product>>& layer_products() {
  static const std::vector<std::pair<std::string, Product>> list = {
      {"qkv_forward", {kTokens, 3 * kHidden, kHidden, false, true, false}},
      {"qkv_input_grad", {kTokens, kHidden, 3 * kHidden, false, false, false}},
      {"qkv_weight_grad", {3 * kHidden, kHidden, kTokens, true, false, true}},
      {"fc1_forward", {kTokens, 4 * kHidden, kHidden, false, true, false}},
      {"fc1_input_grad", {kTokens, kHidden, 4 * kHidden, false, false, false}},
      {"fc1_weight_grad", {4 * kHidden, kHidden, kTokens, true, false, true}},
      {"fc2_forward", {kTokens, kHidden, 4 * kHidden, false, true, false}},
      {"fc2_input_grad", {kTokens, 4 * kHidden, kHidden, false, false, false}},
      {"fc2_weight_grad", {kHidden, 4 * kHidden, kTokens, true, false, true}},
  };
  return list;
}

void BM_GemmLayer(benchmark::State& state) {
  const auto& [name, product] = layer_products()[static_cast<std::size_t>(state.range(0))];
  state.SetLabel(name);
  run_product(state, product, state.range(1) != 0, static_cast<int>(state.range(2)));
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

// The same in bf16 (q, k, v, o, do, dq bf16; lse, dk, dv fp32): gemm_bf16 products on chunks of
// 128 queries against the keys they see.
void BM_AttentionBf16(benchmark::State& state) {
  const std::int64_t s = state.range(0), heads = 8, d = 64;
  const int threads = static_cast<int>(state.range(1));
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);
  tbb::task_arena arena(threads, 0);
  const ops::Shape shape{1, s, heads, d};
  auto bf16_tensor = [&](unsigned seed) {
    const ops::Tensor f = random_tensor(shape, seed);
    ops::Bf16Tensor t = ops::Bf16Tensor::empty(shape);
    ops::to_bf16({f.data(), static_cast<std::size_t>(f.numel())},
                 {t.data(), static_cast<std::size_t>(t.numel())});
    return t;
  };
  const ops::Bf16Tensor q = bf16_tensor(1), k = bf16_tensor(2), v = bf16_tensor(3),
                        d_o = bf16_tensor(4);
  const ops::Bf16Tensor o = ops::Bf16Tensor::empty(shape), dq = ops::Bf16Tensor::empty(shape);
  const ops::Tensor lse = ops::Tensor::empty({1, heads, s}), dk = ops::Tensor::zeros(shape),
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
  const double flops = 7.0 * static_cast<double>(s * s * d) * heads;
  state.counters["GFLOP/s"] = flops * 1e-9 * static_cast<double>(state.iterations()) / seconds;
}

}  // namespace

BENCHMARK(BM_GemmSquare)
    ->ArgsProduct({{128, 512, 1024, 2048}, {0, 1}, {1, 2}})
    ->ArgNames({"n", "bf16", "threads"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_GemmLayer)
    ->ArgsProduct({{0, 1, 2, 3, 4, 5, 6, 7, 8}, {0, 1}, {1, 2}})
    ->ArgNames({"product", "bf16", "threads"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Attention)
    ->ArgsProduct({{512, 2048}, {1, 2}})
    ->ArgNames({"seq", "threads"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_AttentionBf16)
    ->ArgsProduct({{512, 2048}, {1, 2}})
    ->ArgNames({"seq", "threads"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  peaks();  // measured and printed before any benchmark
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
