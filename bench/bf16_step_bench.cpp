// bf16_step_bench: a training step in fp32 and in bf16 mixed precision, the same model and batch,
// alternated in one run so that both see the same host load. Prints tokens/s of each, their
// ratio, which kernels gemm_bf16 ran (oneDNN with AMX or AVX512_BF16, or the fp32 fallback on
// CPUs without bf16 instructions), and the speed of the step's matrix products against the
// host's peak measured in the same run (bench/measured_peak.hpp).
//
//   bf16_step_bench [--layers 4] [--hidden 1024] [--seq 512] [--micro-batch 4] [--steps 3]
//                   [--tp 1] [--sp] [--ep 1] [--experts 0]
//
// The model: GPT-2's decoder (LayerNorm, GELU, learned positions), 16 heads, ffn 4 x hidden, a
// byte-level vocabulary (256), one micro-batch a step on each data-parallel rank. --tp 2 --sp
// runs two devices with tensor and sequence parallelism; --ep 2 --experts 2 two devices with
// expert parallelism (data-parallel 2, every MLP a mixture of --experts experts of ffn 4 x hidden,
// top-2 routing), each device a micro-batch of its own. The devices split the host's cores.
//
// The products: one layer's linear products (QKV, fc1, fc2: forward, input gradient, weight
// gradient; with experts, fc1 and fc2 of each of the device's experts at the tokens balanced
// routing gives it) at the shapes one device runs (its tokens, its tensor-parallel share of the
// widths), timed alone on an arena of one device's cores on CPU time, in GFLOP/s and as a share
// of the measured peak of that many cores running together: the FMA loop for fp32; for bf16 both
// the vdpbf16ps loop (AVX512_BF16) and the AMX tile loop, whichever oneDNN runs.
#include <fmt/format.h>
#include <oneapi/tbb/task_arena.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "measured_peak.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/training_step.hpp"
#include "weave/ops/bfloat16.hpp"
#include "weave/ops/gemm.hpp"
#include "weave/ops/gemm_bf16.hpp"

namespace {

using weave::graphs::ModelConfig;
using weave::graphs::ParallelPlan;
using weave::graphs::Precision;
namespace ops = weave::ops;
using weave::bench::PeakKind;

// A training step of `m` under `plan`, timed on the wall clock.
class Run {
 public:
  Run(const ModelConfig& m, const ParallelPlan& plan)
      : set_(plan.devices(), {}), step_(m, plan, {}, set_, comm_) {
    for (int dp = 0; dp < plan.data_parallel; ++dp) {
      weave::graphs::MicroBatch& b = step_.micro_batch(dp, 0);
      for (std::size_t i = 0; i < b.tokens.size(); ++i) {
        const std::size_t k = i + static_cast<std::size_t>(dp) * 104729;
        b.tokens[i] = static_cast<std::int32_t>((k * 7919 + 13) % m.vocab_size);
        b.targets[i] = static_cast<std::int32_t>((k * 7919 + 14) % m.vocab_size);
      }
    }
  }
  // Seconds of one step.
  double step(int iteration) {
    step_.prepare(iteration, 1e-4);
    const auto t0 = std::chrono::steady_clock::now();
    set_.executor().run(step_.graph());
    const auto t1 = std::chrono::steady_clock::now();
    loss_ = step_.result().loss;
    return std::chrono::duration<double>(t1 - t0).count();
  }
  double loss() const { return loss_; }

 private:
  weave::devices::DeviceSet set_;
  weave::devices::SharedMemoryCommunicator comm_;
  weave::graphs::TrainingStep step_;
  double loss_ = 0;
};

// C [m, n] = op(A) op(B) in a linear layer's layouts: forward (no, yes), input gradient (no, no),
// weight gradient (yes, no) accumulated into fp32.
struct Product {
  const char* name;
  std::int64_t m, n, k;
  bool ta, tb, accumulate;
};

// `mlp_tokens`: the rows each MLP product takes (a dense MLP's: the device's tokens; an expert's:
// the tokens routed to it from every expert-parallel rank), `mlps` of them (the device's experts).
std::vector<Product> layer_products(std::int64_t tokens, std::int64_t mlp_tokens, int mlps,
                                    std::int64_t h, std::int64_t f, int tp) {
  const std::int64_t qkv = 3 * h / tp, ffn = f / tp;
  std::vector<Product> list = {{"qkv forward", tokens, qkv, h, false, true, false},
                               {"qkv input grad", tokens, h, qkv, false, false, false},
                               {"qkv weight grad", qkv, h, tokens, true, false, true}};
  for (int e = 0; e < mlps; ++e) {
    const std::int64_t t = mlp_tokens;
    list.insert(list.end(), {{"fc1 forward", t, ffn, h, false, true, false},
                             {"fc1 input grad", t, h, ffn, false, false, false},
                             {"fc1 weight grad", ffn, h, t, true, false, true},
                             {"fc2 forward", t, h, ffn, false, true, false},
                             {"fc2 input grad", t, ffn, h, false, false, false},
                             {"fc2 weight grad", h, ffn, t, true, false, true}});
  }
  return list;
}

// Each product's GFLOP/s, run `reps` times after one untimed run (which lets oneDNN compile its
// kernel for the shape), on `threads` threads of one arena. Timed on the process's CPU time and
// scaled to `threads` cores (threads waiting for work count; waiting for a core, which other
// processes on a shared host cause, does not), as the measured peak is.
std::vector<double> products_gflops(const std::vector<Product>& list, bool bf16, int threads,
                                    int reps) {
  tbb::task_arena arena(threads, 1);  // the calling thread and threads - 1 workers
  std::vector<double> rates;
  for (const Product& p : list) {
    const std::int64_t ar = p.ta ? p.k : p.m, ac = p.ta ? p.m : p.k;
    const std::int64_t br = p.tb ? p.n : p.k, bc = p.tb ? p.k : p.n;
    std::vector<float> a(static_cast<std::size_t>(ar * ac)), b(static_cast<std::size_t>(br * bc));
    for (std::size_t i = 0; i < a.size(); ++i)
      a[i] = static_cast<float>((i * 7919) % 201) / 100.f - 1.f;
    for (std::size_t i = 0; i < b.size(); ++i)
      b[i] = static_cast<float>((i * 104729) % 199) / 100.f - 1.f;
    std::vector<float> c(static_cast<std::size_t>(p.m * p.n), 0.f);
    std::vector<ops::bf16> ah(a.size()), bh(b.size()), ch(c.size());
    ops::to_bf16(a, ah);
    ops::to_bf16(b, bh);
    const auto ta = p.ta ? ops::Transpose::yes : ops::Transpose::no;
    const auto tb = p.tb ? ops::Transpose::yes : ops::Transpose::no;
    const float beta = p.accumulate ? 1.f : 0.f;
    auto once = [&] {
      arena.execute([&] {
        if (!bf16)
          ops::gemm<float>(ta, tb, 1.f, {a.data(), ar, ac, ac}, {b.data(), br, bc, bc}, beta,
                           {c.data(), p.m, p.n, p.n});
        else if (p.accumulate)
          ops::gemm_bf16(ta, tb, 1.f, {ah.data(), ar, ac, ac}, {bh.data(), br, bc, bc}, beta,
                         ops::MatrixView<float>{c.data(), p.m, p.n, p.n});
        else
          ops::gemm_bf16(ta, tb, 1.f, {ah.data(), ar, ac, ac}, {bh.data(), br, bc, bc}, beta,
                         ops::MatrixView<ops::bf16>{ch.data(), p.m, p.n, p.n});
      });
    };
    once();
    const double t0 = weave::bench::process_cpu_seconds();
    for (int r = 0; r < reps; ++r)
      once();
    const double cpu_seconds = weave::bench::process_cpu_seconds() - t0;
    const double flops =
        2.0 * static_cast<double>(p.m) * static_cast<double>(p.n) * static_cast<double>(p.k) * reps;
    rates.push_back(flops / (cpu_seconds / threads) * 1e-9);
  }
  return rates;
}

// GFLOP/s of the whole list from each product's: its FLOP over the sum of its times.
double overall_gflops(const std::vector<Product>& list, const std::vector<double>& rates) {
  double flops = 0, seconds = 0;
  for (std::size_t i = 0; i < list.size(); ++i) {
    const double f = 2.0 * static_cast<double>(list[i].m) * static_cast<double>(list[i].n) *
                     static_cast<double>(list[i].k);
    flops += f;
    seconds += f / rates[i];
  }
  return flops / seconds;
}

}  // namespace

int main(int argc, char** argv) {
  int layers = 4, hidden = 1024, seq = 512, micro_batch = 4, steps = 3, tp = 1, ep = 1, experts = 0;
  bool sp = false;
  CLI::App app{"fp32 and bf16 training steps alternated in one run: tokens/s of each"};
  app.add_option("--layers", layers, "Transformer layers")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--hidden", hidden, "Hidden size")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--seq", seq, "Sequence length")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--micro-batch", micro_batch, "Micro-batch size")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--steps", steps, "Timed steps a precision")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--tp", tp, "Tensor-parallel devices")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_flag("--sp", sp, "Sequence parallelism (with --tp above 1)");
  app.add_option("--ep", ep, "Expert-parallel devices (data-parallel as many)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--experts", experts, "Experts of every MLP (0: dense MLPs; --ep needs them)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (ep > 1 && experts < ep) {
    fmt::print(stderr, "--ep {} needs --experts {} or more (each device holds whole experts)\n", ep,
               ep);
    return 2;
  }
  ModelConfig m{.num_layers = layers,
                .hidden_size = hidden,
                .num_attention_heads = 16,
                .ffn_hidden_size = 4 * hidden,
                .seq_length = seq,
                .vocab_size = 256,
                .num_experts = experts,
                .moe_router_topk = std::min(2, std::max(experts, 1))};
  ParallelPlan plan{.tensor_parallel = tp,
                    .sequence_parallel = sp,
                    .expert_parallel = ep,
                    .data_parallel = ep,
                    .micro_batch_size = micro_batch,
                    .global_batch_size = micro_batch * ep};
  weave::graphs::validate(m, plan);
  Run fp32(m, plan);
  m.precision = Precision::bf16;
  Run bf16(m, plan);
  const int devices = plan.devices();
  fmt::print(
      "{} device{} (tp {}{}, ep {}, experts {}), {} layers, hidden {}, sequence {}, micro-batch "
      "{}; gemm_bf16 kernels: {}\n",
      devices, devices > 1 ? "s" : "", tp, sp ? " + sp" : "", ep, experts, layers, hidden, seq,
      micro_batch, ops::to_string(ops::bf16_kernel()));
  // A first step of each warms the caches and oneDNN's kernels; then alternated.
  fp32.step(1);
  bf16.step(1);
  double fp32_s = 0, bf16_s = 0;
  for (int it = 2; it < 2 + steps; ++it) {
    fp32_s += fp32.step(it);
    bf16_s += bf16.step(it);
  }
  const double tokens = static_cast<double>(seq) * micro_batch * ep * steps;
  fmt::print("fp32: {:9.0f} tokens/s ({:.3f} s a step, loss {:.4f})\n", tokens / fp32_s,
             fp32_s / steps, fp32.loss());
  fmt::print("bf16: {:9.0f} tokens/s ({:.3f} s a step, loss {:.4f})\n", tokens / bf16_s,
             bf16_s / steps, bf16.loss());
  fmt::print("bf16 / fp32: {:.2f}x\n", fp32_s / bf16_s);

  // One device's products on its share of the cores, against the peak of as many cores.
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = std::max(1, cores / devices);
  const std::int64_t local_tokens = static_cast<std::int64_t>(seq) * micro_batch;
  // Balanced routing: each expert takes top-k of the experts' share of every ep rank's tokens.
  const std::int64_t mlp_tokens =
      experts > 0 ? local_tokens * m.moe_router_topk * ep / experts : local_tokens;
  const int mlps = experts > 0 ? experts / ep : 1;
  const auto list = layer_products(local_tokens, mlp_tokens, mlps, hidden, 4 * hidden, tp);
  const double fp32_peak = weave::bench::measured_peak_gflops(PeakKind::fp32_fma, threads);
  const double dot_peak = weave::bench::measured_peak_gflops(PeakKind::bf16_dot, threads);
  const double amx_peak = weave::bench::measured_peak_gflops(PeakKind::amx_bf16, threads);
  const std::vector<double> fp32_rates = products_gflops(list, false, threads, 2);
  const std::vector<double> bf16_rates = products_gflops(list, true, threads, 4);
  auto share = [](double gflops, double peak) { return peak > 0 ? 100.0 * gflops / peak : 0.0; };
  fmt::print(
      "measured peaks of {} core{} (CPU time): fp32 FMA {:.1f}, bf16 vdpbf16ps {:.1f}, bf16 AMX "
      "{:.1f} GFLOP/s\n",
      threads, threads > 1 ? "s" : "", fp32_peak, dot_peak, amx_peak);
  fmt::print("one device's layer products on {} thread{} (CPU time), GFLOP/s and % of peak:\n",
             threads, threads > 1 ? "s" : "");
  fmt::print("  {:<16} {:>16} {:>8} {:>7} {:>8} {:>7} {:>7}\n", "product", "m x n x k", "fp32",
             "% FMA", "bf16", "% dot", "% AMX");
  for (std::size_t i = 0; i < list.size(); ++i) {
    const Product& p = list[i];
    fmt::print("  {:<16} {:>16} {:8.1f} {:7.1f} {:8.1f} {:7.1f} {:7.1f}\n", p.name,
               fmt::format("{}x{}x{}", p.m, p.n, p.k), fp32_rates[i],
               share(fp32_rates[i], fp32_peak), bf16_rates[i], share(bf16_rates[i], dot_peak),
               share(bf16_rates[i], amx_peak));
  }
  const double fp32_gflops = overall_gflops(list, fp32_rates);
  const double bf16_gflops = overall_gflops(list, bf16_rates);
  fmt::print("  {:<16} {:>16} {:8.1f} {:7.1f} {:8.1f} {:7.1f} {:7.1f}\n", "all", "", fp32_gflops,
             share(fp32_gflops, fp32_peak), bf16_gflops, share(bf16_gflops, dot_peak),
             share(bf16_gflops, amx_peak));
  return 0;
}
