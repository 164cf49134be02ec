// Megatron-Core's shared experts in bf16 mixed precision: their products in bf16 with fp32 sums
// as the routed experts' (fp32 main weights, fp32 gradients), their output, its sum with the
// routed experts' and the input gradients bf16 values. On one device they track the fp32 model
// within bf16's rounding and read the weights' bf16 copies; under tp + sp + ep (with and without
// the overlap, with the gate), tp without sp and cp they equal one device in bf16 within the bf16
// MoE suite's tolerances; the prediction
// prices the same tasks and counts their values at 2 bytes where the step built with tensors
// holds them in fp32 buffers.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "half_precision_equivalence.hpp"
#include "materialised_step.hpp"
#include "step_outcome.hpp"
#include "tiny_model.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/prediction.hpp"
#include "weave/graphs/training_step.hpp"

namespace weave::graphs {
namespace {

constexpr int kShared = 96;

// bf16_moe_training_test's model (2 layers, the first MoE of 4 experts, top-2, GeLU) without
// biases, with shared experts kShared wide.
ModelConfig shared_model(Precision p, bool gate = false, bool overlap = false) {
  ModelConfig m = tiny(4);
  m.hidden_size = 64;
  m.ffn_hidden_size = 128;
  m.add_bias_linear = false;
  m.moe_shared_expert_intermediate_size = kShared;
  m.moe_shared_expert_gate = gate;
  m.moe_shared_expert_overlap = overlap;
  m.precision = p;
  return m;
}

constexpr double kU = 1.0 / 256;  // bf16's unit roundoff
const ParallelPlan kOneDevice{.micro_batch_size = 2, .global_batch_size = 4};

// bf16_moe_training_test's roundings (24 forward, 45 per gradient) plus the shared experts':
// forward their fc1's output, the activation, fc2's output and the sum with the routed output
// (4); backward their output's gradient, fc2's and the activation's input gradients, fc1's
// input gradient and its sum with the routed path's (5). Independent roundings of either sign:
// sqrt(k) u of a norm.
constexpr double kForwardRoundings = 28, kGradientRoundings = 50;

TEST(Bf16SharedExperts, TrackFp32OnOneDevice) {
  const Outcome fp32 = run(shared_model(Precision::fp32), kOneDevice, 1, false);
  const Outcome bf16 = run(shared_model(Precision::bf16), kOneDevice, 1, false);
  ASSERT_EQ(fp32.grads.size(), bf16.grads.size());
  ASSERT_EQ(fp32.grads.count("layers.0.moe.shared_experts.fc1.weight"), 1u);
  const double bound = std::sqrt(kGradientRoundings) * kU;
  for (const auto& [name, want] : fp32.grads) {
    const double diff = relative_difference(bf16.grads.at(name), want);
    EXPECT_LE(diff, bound) << name;
    EXPECT_GT(diff, 0) << name << ": not computed in bf16";
  }
  EXPECT_NEAR(bf16.losses[0], fp32.losses[0], std::sqrt(kForwardRoundings) * kU * fp32.losses[0]);
  EXPECT_NE(bf16.losses[0], fp32.losses[0]);
}

// One device's first step with the shared experts' fp32 main weights set to bf16 values with
// `low` in their 16 low bits (below half a bf16 ulp: their bf16 copies are the same): the loss
// and every gradient.
struct FirstStep {
  double loss;
  std::vector<std::vector<float>> grads;
};
FirstStep with_low_bits(const ModelConfig& m, std::uint32_t low) {
  devices::DeviceSet set(1, {.pin = false});
  devices::SharedMemoryCommunicator comm;
  TrainingStep step(m, kOneDevice, {}, set, comm);
  int changed = 0;
  for (Parameter& p : step.shard(0).parameters()) {
    if (p.name.find("shared_experts.fc") == std::string::npos) continue;
    float* v = p.value.data();
    for (std::int64_t i = 0; i < p.value.numel(); ++i) {
      auto bits = std::bit_cast<std::uint32_t>(v[i]);
      v[i] = std::bit_cast<float>((bits & 0xffff0000u) | low);
    }
    ++changed;
  }
  EXPECT_EQ(changed, 2);
  if (m.precision != Precision::fp32) step.shard(0).refresh_bf16_copies();
  fill_batches(step, m, kOneDevice);
  step.prepare(1, 1e-2);
  set.executor().run(step.graph());
  FirstStep out{step.result().loss, {}};
  for (const Parameter& p : step.shard(0).parameters())
    out.grads.push_back(p.grad.to_vector());
  return out;
}

// The products read the weights' bf16 copies: main values that differ below half a bf16 ulp give
// a bitwise identical step in bf16, where the fp32 model's loss moves.
TEST(Bf16SharedExperts, ProductsReadTheBf16Copies) {
  const FirstStep a = with_low_bits(shared_model(Precision::bf16), 0),
                  b = with_low_bits(shared_model(Precision::bf16), 0x1000);
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_TRUE(a.grads == b.grads);
  EXPECT_NE(with_low_bits(shared_model(Precision::fp32), 0).loss,
            with_low_bits(shared_model(Precision::fp32), 0x1000).loss);
}

// Tensor parallelism with SP and expert parallelism: the shared experts' fc2 partial sums and
// fc1's input-gradient partial sums are bf16 values reduced over tp in fp32 and rounded again,
// as the split experts' are (bf16_moe_training_test's kTensorParallel, r = 9, which its split
// experts meet with the same two roundings more: r = 11). With the bf16 residual stream a value
// tp has moved no longer takes the rounding one device's takes at each rounding of the stream
// it meets after: forward the two residual ends of each layer, backward the stream's gradient
// after each layer's two norms and the final norm's, 2 L + 2 L + 1 = 9 roundings the two runs do
// not share for L = 2. r = 11 + 9 = 20: a gradient differs by sqrt(20) u < 4.5 u of its norm.
// The losses' bounds are bf16_moe_training_test's.
constexpr ParallelTolerance kTensorParallel{1e-3, 4.5 / 256, 1e-2};

TEST(Bf16SharedExperts, Tp2SpEp2EqualsOneDeviceWithAndWithoutTheOverlap) {
  const ParallelPlan plan{.tensor_parallel = 2,
                          .sequence_parallel = true,
                          .expert_parallel = 2,
                          .micro_batch_size = 2,
                          .global_batch_size = 4};
  for (const bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "overlap, gate" : "before the router");
    expect_equals_one_device_of_its_batches(shared_model(Precision::bf16, overlap, overlap), plan,
                                            kTensorParallel);
  }
}

// Without SP their partial sums are all-reduced (the same roundings); under context parallelism
// each rank runs its share of the sequence through them as one device does, and the gate scores
// its own rows: bf16_moe_training_test's tolerances for each.
TEST(Bf16SharedExperts, Tp2WithoutSpAndCp2EqualOneDevice) {
  expect_equals_one_device_of_its_batches(
      shared_model(Precision::bf16, true),
      {.tensor_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}, kTensorParallel);
  expect_equals_one_device_of_its_batches(
      shared_model(Precision::bf16, true),
      {.context_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4},
      ParallelTolerance{1e-3, 2.0 / 256, 1e-2});
}

// The materialised bf16 step holds what the prediction counts plus named fp32 terms
// (bf16_moe_training_test); the shared experts add to those terms exactly their values, held as
// bf16 values in fp32 buffers (2 bytes a value more than the prediction's count). One device,
// one MoE layer, T tokens a micro-batch, with the gate: kept, fc1's output and the activation
// (T f each), fc2's output (T h; the reduced output is it without tp), the ungated output (T h)
// and the scores (T); the backward's workspace, the gated gradient (T h; the output gradient is
// it without sp), the logits' (T), the activation's and fc1's gradients (T f each) and the input
// gradient (T h). Parameters, gradients and optimizer state are counted as predicted.
TEST(Bf16SharedExperts, MemoryAndTaskCostsAreThePredictions) {
  const OptimizerConfig opt{.adamw = {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8}};
  devices::SharedMemoryCommunicator comm;
  const auto excess = [&](const ModelConfig& m) {
    devices::DeviceSet with(1, {.pin = false}), without(1, {.pin = false});
    const TrainingStep real(m, kOneDevice, opt, with, comm);
    const TrainingStep shapes(m, kOneDevice, opt, without, comm, {.materialize = false});
    for (auto category : {rt::MemoryCategory::parameters, rt::MemoryCategory::gradients,
                          rt::MemoryCategory::optimizer_state})
      EXPECT_EQ(with.memory().current(0, category), without.memory().current(0, category))
          << to_string(category);
    return with.memory().current(0, rt::MemoryCategory::activations) -
           without.memory().current(0, rt::MemoryCategory::activations);
  };
  ModelConfig none = shared_model(Precision::bf16, true);
  none.moe_shared_expert_intermediate_size = 0;
  none.moe_shared_expert_gate = false;
  const std::int64_t T = 16 * kOneDevice.micro_batch_size, h = 64, f = kShared;
  const std::int64_t kept = 2 * T * f + T * h + T * h + T;
  const std::int64_t workspace = T * h + T + 2 * T * f + T * h;
  EXPECT_EQ(excess(shared_model(Precision::bf16, true)), excess(none) + 2 * (kept + workspace));

  // Task costs: the step built with tensors replays on the virtual clock in the prediction's time
  // (the bf16 roundings run inside the fp32 run's tasks), under tp + sp + ep with the overlap.
  TrainerConfig c;
  c.model = shared_model(Precision::bf16, true, true);
  c.plan = {.tensor_parallel = 2,
            .sequence_parallel = true,
            .expert_parallel = 2,
            .micro_batch_size = 1,
            .global_batch_size = 2};
  c.machine = {.device_flops = 1e12, .device_memory_bandwidth = 1e11, .link = "nvlink4"};
  const Prediction p = predict_step(c);
  const MaterialisedStep r = materialised_step(c);
  EXPECT_DOUBLE_EQ(p.step_ms, static_cast<double>(r.replay.makespan) * 1e-6);
}

}  // namespace
}  // namespace weave::graphs
