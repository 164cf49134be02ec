// bf16_step_bench: one device's training step in fp32 and in bf16 mixed precision, the same
// model and batch, alternated in one run so that both see the same host load. Prints tokens/s
// of each, their ratio, and which kernels gemm_bf16 ran (oneDNN with AMX or AVX512_BF16, or the
// fp32 fallback on CPUs without bf16 instructions).
//
//   bf16_step_bench [--layers 4] [--hidden 1024] [--seq 512] [--micro-batch 4] [--steps 3]
//
// The model: GPT-2's decoder (LayerNorm, GELU, learned positions), 16 heads, ffn 4 x hidden, a
// byte-level vocabulary (256), one micro-batch a step.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdlib>
#include <vector>

#include "weave/devices/device_set.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/training_step.hpp"
#include "weave/ops/gemm_bf16.hpp"

namespace {

using weave::graphs::ModelConfig;
using weave::graphs::ParallelPlan;
using weave::graphs::Precision;

// A training step of `m` on one device, timed on the wall clock.
class Run {
 public:
  Run(const ModelConfig& m, const ParallelPlan& plan)
      : set_(1, {}), step_(m, plan, {}, set_, comm_) {
    weave::graphs::MicroBatch& b = step_.micro_batch(0, 0);
    for (std::size_t i = 0; i < b.tokens.size(); ++i) {
      b.tokens[i] = static_cast<std::int32_t>((i * 7919 + 13) % m.vocab_size);
      b.targets[i] = static_cast<std::int32_t>((i * 7919 + 14) % m.vocab_size);
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

}  // namespace

int main(int argc, char** argv) {
  int layers = 4, hidden = 1024, seq = 512, micro_batch = 4, steps = 3;
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
  CLI11_PARSE(app, argc, argv);
  ModelConfig m{.num_layers = layers,
                .hidden_size = hidden,
                .num_attention_heads = 16,
                .ffn_hidden_size = 4 * hidden,
                .seq_length = seq,
                .vocab_size = 256};
  const ParallelPlan plan{.micro_batch_size = micro_batch, .global_batch_size = micro_batch};
  Run fp32(m, plan);
  m.precision = Precision::bf16;
  Run bf16(m, plan);
  fmt::print(
      "one device, {} layers, hidden {}, sequence {}, micro-batch {}; gemm_bf16 kernels: {}\n",
      layers, hidden, seq, micro_batch, weave::ops::to_string(weave::ops::bf16_kernel()));
  // A first step of each warms the caches and oneDNN's kernels; then alternated.
  fp32.step(1);
  bf16.step(1);
  double fp32_s = 0, bf16_s = 0;
  for (int it = 2; it < 2 + steps; ++it) {
    fp32_s += fp32.step(it);
    bf16_s += bf16.step(it);
  }
  const double tokens = static_cast<double>(seq) * micro_batch * steps;
  fmt::print("fp32: {:9.0f} tokens/s ({:.3f} s a step, loss {:.4f})\n", tokens / fp32_s,
             fp32_s / steps, fp32.loss());
  fmt::print("bf16: {:9.0f} tokens/s ({:.3f} s a step, loss {:.4f})\n", tokens / bf16_s,
             bf16_s / steps, bf16.loss());
  fmt::print("bf16 / fp32: {:.2f}x\n", fp32_s / bf16_s);
  return 0;
}
