// zero_stages_bench: data parallelism over 4 devices at ZeRO stages 0 to 3 side by side, the
// same model and batches: each device's peak memory by category (parameters, gradients,
// optimizer state, activations) as the devices' trackers count it, and training tokens/s on the
// wall clock, the stages alternated step by step so that all see the same host load.
//
//   zero_stages_bench [--layers 4] [--hidden 256] [--seq 128] [--micro-batch 2]
//                     [--micro-batches 2] [--steps 3] [--bf16 | --fp16]
//                     [--zero-units-in-flight 2]
//
// --fp16 trains with a constant loss scale of 2^10 (each replica unscales its gradient shard,
// the overflow flag agreed over every rank); the last column counts the steps skipped.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <array>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <vector>

#include "weave/devices/device_set.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/training_step.hpp"

namespace {

using weave::graphs::ModelConfig;
using weave::graphs::ParallelPlan;
using weave::rt::MemoryCategory;

constexpr int kDevices = 4;

// The training step of one stage on its own devices, timed on the wall clock.
class Run {
 public:
  Run(const ModelConfig& m, const ParallelPlan& plan)
      : set_(plan.devices(), {}),
        scaled_(m.precision == weave::graphs::Precision::fp16),
        step_(m, plan, {.loss_scaling = scaled_}, set_, comm_) {
    for (int dp = 0; dp < plan.data_parallel; ++dp)
      for (int mb = 0; mb < plan.micro_batches(); ++mb) {
        weave::graphs::MicroBatch& b = step_.micro_batch(dp, mb);
        for (std::size_t i = 0; i < b.tokens.size(); ++i) {
          const std::size_t at = i + static_cast<std::size_t>((dp * 31 + mb) * 977);
          b.tokens[i] = static_cast<std::int32_t>((at * 7919 + 13) % m.vocab_size);
          b.targets[i] = static_cast<std::int32_t>((at * 7919 + 14) % m.vocab_size);
        }
      }
  }
  double step(int iteration) {
    step_.prepare(iteration, 1e-4);
    if (scaled_) step_.set_loss_scale(1024.f);
    const auto t0 = std::chrono::steady_clock::now();
    set_.executor().run(step_.graph());
    const auto t1 = std::chrono::steady_clock::now();
    loss_ = step_.result().loss;
    skipped_ += step_.result().found_inf;
    return std::chrono::duration<double>(t1 - t0).count();
  }
  double loss() const { return loss_; }
  int skipped() const { return skipped_; }
  // Device 0's peak bytes of `category` (every replica holds the same).
  double mib(MemoryCategory category) {
    return static_cast<double>(set_.memory().peak(0, category)) / (1024.0 * 1024.0);
  }

 private:
  weave::devices::DeviceSet set_;
  weave::devices::SharedMemoryCommunicator comm_;
  bool scaled_;
  weave::graphs::TrainingStep step_;
  double loss_ = 0;
  int skipped_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  int layers = 4, hidden = 256, seq = 128, micro_batch = 2, micro_batches = 2, steps = 3;
  CLI::App app{"Memory per device and tokens/s of dp 4 at ZeRO stages 0 to 3, side by side"};
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
  app.add_option("--micro-batches", micro_batches, "Micro-batches a replica, a step")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--steps", steps, "Timed steps a stage")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  bool bf16 = false, fp16 = false;
  int units_in_flight = 2;
  auto* bf16_flag =
      app.add_flag("--bf16", bf16, "bf16 mixed precision (stage 3 gathering bf16 values)");
  app.add_flag("--fp16", fp16, "fp16 mixed precision with a loss scale of 2^10")
      ->excludes(bf16_flag);
  app.add_option("--zero-units-in-flight", units_in_flight,
                 "Stage 3: the layers whose gathered parameters a device holds at once")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  ModelConfig m{.num_layers = layers,
                .hidden_size = hidden,
                .num_attention_heads = 8,
                .ffn_hidden_size = 4 * hidden,
                .seq_length = seq,
                .vocab_size = 256};
  if (bf16) m.precision = weave::graphs::Precision::bf16;
  if (fp16) m.precision = weave::graphs::Precision::fp16;
  const int global = micro_batch * micro_batches * kDevices;
  std::vector<std::unique_ptr<Run>> runs;
  for (int stage = 0; stage <= 3; ++stage) {
    ParallelPlan plan{.data_parallel = kDevices,
                      .micro_batch_size = micro_batch,
                      .global_batch_size = global,
                      .distributed_optimizer = stage >= 1,
                      .shard_gradients = stage >= 2,
                      .shard_parameters = stage == 3};
    plan.overlap_grad_reduce = true;
    if (stage == 3) plan.zero_units_in_flight = units_in_flight;
    weave::graphs::validate(m, plan);
    runs.push_back(std::make_unique<Run>(m, plan));
  }
  fmt::print(
      "dp {}, {} layers, hidden {}, sequence {}, micro-batch {} x {} per replica, {}, {} steps "
      "each after one to warm up, stage 3 with {} units in flight\n",
      kDevices, layers, hidden, seq, micro_batch, micro_batches,
      bf16   ? "bf16"
      : fp16 ? "fp16"
             : "fp32",
      steps, units_in_flight);
  std::vector<double> seconds(runs.size(), 0.0);
  for (auto& r : runs)
    r->step(1);
  for (int it = 2; it < 2 + steps; ++it)
    for (std::size_t s = 0; s < runs.size(); ++s)
      seconds[s] += runs[s]->step(it);
  const double tokens = static_cast<double>(seq) * global * steps;
  fmt::print("{:<6} {:>11} {:>11} {:>11} {:>11} {:>11} {:>12} {:>9} {:>8}\n", "stage", "params MiB",
             "grads MiB", "optim MiB", "activ. MiB", "total MiB", "tokens/s", "loss", "skipped");
  for (std::size_t s = 0; s < runs.size(); ++s) {
    Run& r = *runs[s];
    const std::array<double, 4> mib{
        r.mib(MemoryCategory::parameters), r.mib(MemoryCategory::gradients),
        r.mib(MemoryCategory::optimizer_state), r.mib(MemoryCategory::activations)};
    fmt::print("{:<6} {:>11.2f} {:>11.2f} {:>11.2f} {:>11.2f} {:>11.2f} {:>12.0f} {:>9.4f} {:>8}\n",
               s, mib[0], mib[1], mib[2], mib[3], mib[0] + mib[1] + mib[2] + mib[3],
               tokens / seconds[s], r.loss(), r.skipped());
  }
  return 0;
}
