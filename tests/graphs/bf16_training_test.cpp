// bf16 mixed-precision training: bf16 products and saved activations, fp32 main parameters,
// gradients, norms, softmax and loss. On one device its losses and gradients track the fp32
// model's within bf16's rounding and the losses fall; its main parameters take an fp32 AdamW
// step; tp2 (+ SP) and dp2 equal one device in bf16 within what their roundings allow; its
// memory is the prediction's plus named fp32 terms; what is not built is refused by name.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "step_outcome.hpp"
#include "tiny_model.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/machine_model.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/model_shard.hpp"
#include "weave/graphs/training_step.hpp"
#include "weave/ops/cross_entropy.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::graphs {
namespace {

// GPT-2's decoder (LayerNorm, GELU, learned positions, biases, tied output) and Llama's (RMSNorm,
// SwiGLU, RoPE, grouped-query attention, no biases, an untied output layer), 2 dense layers.
ModelConfig gpt() {
  ModelConfig m = tiny(0);
  m.hidden_size = 64;
  m.ffn_hidden_size = 128;
  return m;
}

ModelConfig llama() {
  return with_modern_decoder(gpt());
}

ModelConfig in(ModelConfig m, Precision p) {
  m.precision = p;
  return m;
}

const ParallelPlan kOneDevice{.micro_batch_size = 2, .global_batch_size = 4};
const OptimizerConfig kOptimizer{
    .adamw = {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1}, .clip_grad = 1.0};
constexpr double kLearningRate = 1e-2;

std::vector<double> losses(const ModelConfig& m, int steps) {
  devices::DeviceSet set(1, {.pin = false});
  devices::SharedMemoryCommunicator comm;
  TrainingStep step(m, kOneDevice, kOptimizer, set, comm);
  std::vector<double> out;
  for (int it = 1; it <= steps; ++it) {
    fill_batches(step, m, kOneDevice);  // the same batch every step: the model must learn it
    step.prepare(it, kLearningRate);
    set.executor().run(step.graph());
    out.push_back(step.result().loss);
  }
  return out;
}

// bf16 keeps 8 significant bits: a rounded value is off by at most u = 2^-8 of itself. On the
// way from the embedding to the loss a value is rounded k times, once into the input of each
// product it meets: the embedding, per layer the attention's input, its queries/keys/values,
// its output, the projection's, fc1's input and output, the activation and fc2's output (8),
// and the final norm and the logits (2): k = 2 + 8 L + 1 = 19 for L = 2. The roundings are
// independent and of either sign, so the logits' relative error grows as sqrt(k) u (~1.7 %),
// and the loss, a mean of log-softmaxes over 64 tokens whose logits are O(1) after a few
// steps, moves by at most that much of itself at the first step. Each AdamW step then adds
// at most the same again (its update lr * m / sqrt(v) is bounded by lr per element whatever the
// gradient's error), so step i is allowed i times the first step's bound.
double tolerance(const ModelConfig& m, int step) {
  const double u = std::ldexp(1.0, -8);
  const double k = 2 + 8 * m.num_layers + 1;
  return step * std::sqrt(k) * u;
}

void expect_tracks_fp32(const ModelConfig& m) {
  constexpr int kSteps = 5;
  const std::vector<double> fp32 = losses(in(m, Precision::fp32), kSteps);
  const std::vector<double> bf16 = losses(in(m, Precision::bf16), kSteps);
  for (int i = 0; i < kSteps; ++i) {
    EXPECT_NEAR(bf16[i], fp32[i], tolerance(m, i + 1) * fp32[i]) << "step " << i + 1;
    // Not fp32 by accident: bf16's roundings move the loss.
    EXPECT_NE(bf16[i], fp32[i]) << "step " << i + 1;
  }
  EXPECT_LT(bf16.back(), 0.9 * bf16.front());  // it learns
}

// The gradients of one step (no update) by parameter, flat.
std::map<std::string, std::vector<float>> gradients(const ModelConfig& m) {
  devices::DeviceSet set(1, {.pin = false});
  devices::SharedMemoryCommunicator comm;
  TrainingStep step(m, kOneDevice, kOptimizer, set, comm);
  step.set_update_parameters(false);
  fill_batches(step, m, kOneDevice);
  step.prepare(1, kLearningRate);
  set.executor().run(step.graph());
  std::map<std::string, std::vector<float>> out;
  for (const Parameter& p : step.shard(0).parameters())
    out[p.name] = p.grad.to_vector();
  return out;
}

// Every parameter's fp32 main gradient against the fp32 model's, in norm: the backward rounds
// into bf16 the output gradient of each product it meets as well (per layer the projection's,
// the attention's, QKV's, fc2's, the activation's and fc1's: 6; and the logits'), so a
// gradient has met at most k = 19 + 6 L + 1 = 32 roundings for L = 2, and differs by
// sqrt(k) u (2.2 %) of its norm.
void expect_gradients_near_fp32(const ModelConfig& m) {
  const auto fp32 = gradients(in(m, Precision::fp32));
  const auto bf16 = gradients(in(m, Precision::bf16));
  const double bound = std::sqrt(19.0 + 6 * m.num_layers + 1) * std::ldexp(1.0, -8);
  ASSERT_EQ(fp32.size(), bf16.size());
  for (const auto& [name, want] : fp32) {
    const std::vector<float>& got = bf16.at(name);
    double diff = 0, norm = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      diff += (double{got[i]} - want[i]) * (double{got[i]} - want[i]);
      norm += double{want[i]} * want[i];
    }
    EXPECT_LE(std::sqrt(diff), bound * std::sqrt(norm)) << name;
    EXPECT_GT(diff, 0) << name << ": not computed in bf16";
  }
}

TEST(Bf16Training, GptGradientsNearFp32) {
  expect_gradients_near_fp32(gpt());
}

TEST(Bf16Training, LlamaGradientsNearFp32) {
  expect_gradients_near_fp32(llama());
}

TEST(Bf16Training, GptLossesTrackFp32AndFall) {
  expect_tracks_fp32(gpt());
}

TEST(Bf16Training, LlamaLossesTrackFp32AndFall) {
  expect_tracks_fp32(llama());
}

// After one step the fp32 main parameters are an fp32 AdamW step of the fp32 gradients (as
// clipped): for step 1, p (1 - lr wd) - lr g / (|g| + eps), computed here in double. A main
// parameter kept in bf16 would be off by up to 2^-8 of itself (~1e-4 for the 0.02-scale
// weights), a thousand times the bound; the bf16 copies the products read are the main values
// rounded to nearest even.
TEST(Bf16Training, MainParametersTakeAnFp32AdamWStep) {
  const ModelConfig m = in(llama(), Precision::bf16);
  devices::DeviceSet set(1, {.pin = false});
  devices::SharedMemoryCommunicator comm;
  TrainingStep step(m, kOneDevice, kOptimizer, set, comm);
  std::vector<std::vector<float>> before;
  for (const Parameter& p : step.shard(0).parameters()) {
    ASSERT_EQ(p.value16.numel(), p.value.numel()) << p.name;
    const std::vector<float> v = p.value.to_vector();
    const std::vector<ops::bf16> v16 = p.value16.to_vector();
    for (std::size_t i = 0; i < v.size(); ++i)
      ASSERT_EQ(v16[i], ops::bf16(v[i])) << p.name << " element " << i;
    before.push_back(v);
  }
  fill_batches(step, m, kOneDevice);
  step.prepare(1, kLearningRate);
  set.executor().run(step.graph());
  const double lr = kLearningRate, wd = kOptimizer.adamw.weight_decay, eps = kOptimizer.adamw.eps;
  std::size_t i = 0, off_bf16_grid = 0, total = 0;
  for (const Parameter& p : step.shard(0).parameters()) {
    const std::vector<float> got = p.value.to_vector(), g = p.grad.to_vector();
    const std::vector<float>& p0 = before[i++];
    for (std::size_t e = 0; e < got.size(); ++e) {
      const double want = p0[e] * (1 - lr * wd) - lr * g[e] / (std::abs(double{g[e]}) + eps);
      ASSERT_NEAR(got[e], want, 1e-7 + 1e-6 * std::abs(want)) << p.name << " element " << e;
      off_bf16_grid += static_cast<float>(ops::bf16(got[e])) != got[e];
      ++total;
    }
  }
  // The main values are fp32: nearly all of them fall between bf16's values.
  EXPECT_GT(off_bf16_grid, total * 9 / 10);
}

// Relative difference of two gradients in norm.
double relative_difference(const std::vector<double>& got, const std::vector<double>& want) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return std::sqrt(diff / norm);
}

struct ParallelTolerance {
  double first_loss;  // relative, the first step's loss (no update yet)
  double gradient;    // relative in norm, every parameter's gradient of the first step
  double later_loss;  // relative, the losses of steps 2 and 3 (with updates)
};

// Tensor parallelism in bf16 rounds where Megatron-LM's does: each rank's partial sums of a
// row-parallel product (the projection and fc2 forward, QKV's and fc1's input gradients
// backward) and of the output layer's input gradient are bf16 values before they are summed
// over tp, and the sum is rounded again. So a value meets up to r = 4 L + 1 = 9 roundings
// that one device does not: the gradients differ by at most sqrt(r) u = 1.2 % of their norm.
// The loss at the first step moves with the logits' error: at most 2 max |dz| with |dz| <=
// sqrt(r) u |z| and |z| < 0.2 for weights drawn at std 0.02 (hidden 64): below 1e-3 of the
// loss (~4.2); the later steps are allowed 1e-2, what AdamW's normalised updates amplify the
// first step's gradient differences to in two steps at most (|update| <= lr per element).
constexpr ParallelTolerance kTensorParallel{1e-3, 3.0 / 256, 1e-2};  // sqrt(9) u
// Data parallelism changes nothing but the order of the fp32 sums of the replicas' gradients
// (relative 2^-24 per addition, a few additions): the first loss is bitwise the one device's,
// the gradients agree to 1e-6, and the later steps' parameters differ by fp32 ulps, which
// flip a bf16 copy's rounding for a rare element (probability ~2^-16 each): 1e-4.
constexpr ParallelTolerance kDataParallel{0, 1e-6, 1e-4};

void expect_parallel_equals_one_device(const ModelConfig& m, const ParallelPlan& plan,
                                       const ParallelTolerance& tolerance) {
  const Outcome a = run(m, kOneDevice, 1, false), b = run(m, plan, 1, false);
  EXPECT_LE(std::abs(b.losses[0] - a.losses[0]), tolerance.first_loss * a.losses[0]);
  for (const auto& [name, want] : a.grads)
    EXPECT_LE(relative_difference(b.grads.at(name), want), tolerance.gradient) << name;
  const Outcome a3 = run(m, kOneDevice, 3, true), b3 = run(m, plan, 3, true);
  for (std::size_t i = 1; i < a3.losses.size(); ++i)
    EXPECT_NEAR(b3.losses[i], a3.losses[i], tolerance.later_loss * a3.losses[i])
        << "step " << i + 1;
  EXPECT_LT(b3.losses.back(), b3.losses.front());
}

TEST(Bf16Training, LlamaTp2SpEqualsOneDevice) {
  expect_parallel_equals_one_device(in(llama(), Precision::bf16),
                                    {.tensor_parallel = 2,
                                     .sequence_parallel = true,
                                     .micro_batch_size = 2,
                                     .global_batch_size = 4},
                                    kTensorParallel);
}

TEST(Bf16Training, GptTp2EqualsOneDevice) {
  expect_parallel_equals_one_device(
      in(gpt(), Precision::bf16),
      {.tensor_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}, kTensorParallel);
}

TEST(Bf16Training, GptDp2EqualsOneDevice) {
  expect_parallel_equals_one_device(
      in(gpt(), Precision::bf16),
      {.data_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}, kDataParallel);
}

// The materialised bf16 step replays as the prediction of the same bf16 step does and holds
// what it counts: the parameters at 2 bytes, the fp32 gradients, and the fp32 main parameters
// with the two moments as optimizer state (Megatron-LM's 2 + 4 + 12 bytes a parameter) exactly. Its
// activations differ by two named terms, computed here from the model's sizes:
//  - what stays fp32 in the step (the prediction counts every activation at 2 bytes): the
//    residual stream (the chunk's input, each layer's middle and output), the norms' statistics,
//    the attention's log-sum-exp, the projection's and fc2's outputs, the loss's logits, maxima,
//    partial sums and log-sum-exp, and the backward's fp32 gradient workspace: 2 more bytes each;
//  - the conversions' workspace, one per device (HalfWorkspace): a norm's fp32 output, QKV,
//    fc1's output and the activation widened for RoPE and the activation's fp32 kernels, and
//    the bf16 operands of the products' backward and the bf16 logits and their gradient.
// (The squared gradient norm, one value, fills its 64-byte line in either precision.)
TEST(Bf16Training, MemoryIsThePredictionsPlusTheFp32Terms) {
  const ModelConfig m = in(gpt(), Precision::bf16);
  devices::SharedMemoryCommunicator comm;
  devices::DeviceSet with(1, {.pin = false}), without(1, {.pin = false});
  const TrainingStep real(m, kOneDevice, kOptimizer, with, comm);
  const TrainingStep shapes(m, kOneDevice, kOptimizer, without, comm, {.materialize = false});
  for (auto category : {rt::MemoryCategory::parameters, rt::MemoryCategory::gradients,
                        rt::MemoryCategory::optimizer_state})
    EXPECT_EQ(with.memory().current(0, category), without.memory().current(0, category))
        << to_string(category);
  const std::int64_t T = std::int64_t{m.seq_length} * kOneDevice.micro_batch_size;
  const std::int64_t h = m.hidden_size, f = m.ffn_hidden_size, L = m.num_layers;
  const std::int64_t heads = m.num_attention_heads, qkv = 3 * h, V = m.padded_vocab_size(1);
  const std::int64_t per_layer = 2 * T + T * heads + T * h + T * h + 2 * T + T * h + T * h;
  const std::int64_t outputs = 2 * T + T * V + T + T * ops::kCrossEntropyPartials + T;
  const std::int64_t workspace =
      4 * T * h + T * f + T * f + T * h + T * h + T * qkv + T * V + T * h;
  const std::int64_t fp32_kept = T * h + L * per_layer + outputs + workspace;
  const std::int64_t conversions = 4 * (T * h + T * qkv + T * f + T * f) +
                                   2 * (2 * T * h + T * f + T * f + T * h + T * qkv + 2 * T * V);
  EXPECT_EQ(
      with.memory().current(0, rt::MemoryCategory::activations),
      without.memory().current(0, rt::MemoryCategory::activations) + 2 * fp32_kept + conversions);
}

// Combinations not built yet are refused by name, with what works.
TEST(Bf16Training, RefusesWhatIsNotBuilt) {
  const ModelConfig m = in(gpt(), Precision::bf16);
  devices::SharedMemoryCommunicator comm;
  const ParallelPlan cp2{.context_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4};
  devices::DeviceSet two(2, {.pin = false});
  try {
    TrainingStep step(m, cp2, kOptimizer, two, comm);
    FAIL() << "cp2 bf16 was built";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("context parallelism"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("tensor (and sequence) and data parallelism"),
              std::string::npos)
        << e.what();
  }
  devices::DeviceSet one(1, {.pin = false});
  // fp16 takes the same code path and is refused the same combinations.
  ModelConfig fp16_moe = in(tiny(4), Precision::fp16);
  EXPECT_THROW(TrainingStep(fp16_moe, kOneDevice, kOptimizer, one, comm), ConfigError);
  ModelConfig moe = in(tiny(4), Precision::bf16);
  EXPECT_THROW(TrainingStep(moe, kOneDevice, kOptimizer, one, comm), ConfigError);
  // Predicted (no tensors), every combination is modelled.
  EXPECT_NO_THROW(TrainingStep(m, cp2, kOptimizer, two, comm, {.materialize = false}));
}

}  // namespace
}  // namespace weave::graphs
