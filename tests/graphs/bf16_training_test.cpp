// bf16 mixed-precision training: bf16 products and saved activations, fp32 main parameters,
// gradients, norms, softmax and loss. On one device its losses and gradients track the fp32
// model's within bf16's rounding and the losses fall; its main parameters take an fp32 AdamW
// step; tp2 (+ SP), dp2, pp2 under every schedule, the distributed optimizer and --qk-layernorm
// equal one device in bf16 within what their roundings allow; recomputation is bitwise the run
// that keeps every activation; a distributed optimizer's checkpoint resumes bitwise; its memory
// is the prediction's plus named fp32 terms; what is not built is refused by name.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "half_precision_equivalence.hpp"
#include "step_outcome.hpp"
#include "temp_dir.hpp"
#include "tiny_model.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/machine_model.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/checkpoint.hpp"
#include "weave/graphs/model_shard.hpp"
#include "weave/graphs/training_step.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::graphs {
namespace {

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
// product it meets and at each residual end of the bf16 residual stream: the embedding, per
// layer the attention's input, its queries/keys/values, its output, the projection's, the
// stream after the attention, fc1's input and output, the activation, fc2's output and the
// stream after the MLP (10), and the final norm and the logits (2): k = 2 + 10 L + 1 = 23 for
// L = 2. The roundings are
// independent and of either sign, so the logits' relative error grows as sqrt(k) u (~1.7 %),
// and the loss, a mean of log-softmaxes over 64 tokens whose logits are O(1) after a few
// steps, moves by at most that much of itself at the first step. Each AdamW step then adds
// at most the same again (its update lr * m / sqrt(v) is bounded by lr per element whatever the
// gradient's error), so step i is allowed i times the first step's bound.
double tolerance(const ModelConfig& m, int step) {
  const double u = std::ldexp(1.0, -8);
  const double k = 2 + 10 * m.num_layers + 1;
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
// the attention's, QKV's, fc2's, the activation's and fc1's: 6; and the logits'), and the bf16
// stream's gradient where its readers' gradients are summed (per layer after each of its two
// norms' backward: 2; and the final norm's), so a gradient has met at most
// k = 23 + 8 L + 2 = 41 roundings for L = 2, and differs by sqrt(k) u (2.5 %) of its norm.
void expect_gradients_near_fp32(const ModelConfig& m) {
  const auto fp32 = gradients(in(m, Precision::fp32));
  const auto bf16 = gradients(in(m, Precision::bf16));
  const double bound = std::sqrt(23.0 + 8 * m.num_layers + 2) * std::ldexp(1.0, -8);
  ASSERT_EQ(fp32.size(), bf16.size());
  expect_gradients_within(fp32, bf16, bound, "bf16");
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
// flip a bf16 copy's rounding for a rare element (probability ~2^-16 each): 1e-4 for the P
// parameters' copies. The values they move by as little flip the bf16 residual stream's roundings
// likewise, each flip moving a value by one bf16 step as a copy's does: the stream's values and
// their gradients, 4 h values a layer and token, S = 4 h T L for the T tokens of a step, against
// P ~ (4 h + 2 f) h L (the attention's and the MLP's products; f = 2 h). Flips of either sign add
// as the square root of their number: sqrt((P + S) / P) = sqrt(1 + T / (2 h)) = sqrt(1.5) for the
// T = 64 tokens (4 sequences of 16) and h = 64 here: 1.23e-4.
constexpr ParallelTolerance kDataParallel{0, 1e-6, 1.23e-4};

TEST(Bf16Training, LlamaTp2SpEqualsOneDevice) {
  expect_equals_one_device_of_its_batches(in(llama(), Precision::bf16),
                                          {.tensor_parallel = 2,
                                           .sequence_parallel = true,
                                           .micro_batch_size = 2,
                                           .global_batch_size = 4},
                                          kTensorParallel);
}

TEST(Bf16Training, GptTp2EqualsOneDevice) {
  expect_equals_one_device_of_its_batches(
      in(gpt(), Precision::bf16),
      {.tensor_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}, kTensorParallel);
}

TEST(Bf16Training, GptDp2EqualsOneDevice) {
  expect_equals_one_device_of_its_batches(
      in(gpt(), Precision::bf16),
      {.data_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}, kDataParallel);
}

// Four layers (two a stage under pp2, one a model chunk with two chunks a rank).
ModelConfig four_layers(ModelConfig m) {
  m.num_layers = 4;
  return m;
}

// Pipeline parallelism in bf16 sends the stage's output and its gradient as bf16 values, as
// Megatron-LM's bf16 pipeline does (its pipeline_dtype is the parameters' bf16). They are the
// bf16 residual stream's values and gradients, which one device holds as bf16 values too, so a
// boundary rounds nothing one device does not (residual_stream_test shows 1F1B and interleaved
// bitwise). Were the stream fp32 on one device, each boundary a micro-batch crosses would round
// it once forward and its gradient once backward: r = 2 (pp2) or 6 (two chunks a rank)
// roundings more, each of at most u of every token's value. The first loss would move with the
// logits' error, 2 max |dz| <= 2 sqrt(r) u |z| with |z| < 0.2 (the tensor-parallel argument):
// 9e-4 of the loss (~4.2) for r = 6, under 1e-3. A parameter's gradient sums its tokens' terms,
// each moved by at most u of itself per rounding; the sum's partial cancellation makes its
// relative error larger than its terms', as it does for the tensor-parallel gradients, which we
// bound the same: 3u (sqrt(9) u). The later steps as tensor parallelism's, 1e-2. These bounds
// hold the zero-bubble schedules, whose split backward may sum in another order.
constexpr ParallelTolerance kPipelineParallel = kTensorParallel;

struct Schedule {
  const char* scheduler;
  int virtual_pipeline;
};

// Each schedule's pp2 run against one device: two plans of the same micro-batches, one step's
// loss and gradients, then three steps' losses.
void expect_pp2_equals_one_device(std::initializer_list<Schedule> schedules) {
  const ModelConfig m = in(four_layers(gpt()), Precision::bf16);
  for (const Schedule& s : schedules) {
    SCOPED_TRACE(s.scheduler);
    expect_equals_one_device_of_its_batches(m,
                                            {.pipeline_parallel = 2,
                                             .virtual_pipeline = s.virtual_pipeline,
                                             .pipeline_scheduler = s.scheduler,
                                             .micro_batch_size = 1,
                                             .global_batch_size = 4},
                                            kPipelineParallel);
  }
}

TEST(Bf16Training, GptPp2EqualsOneDeviceWith1f1b) {
  expect_pp2_equals_one_device({{"1f1b", 1}});
}

TEST(Bf16Training, GptPp2EqualsOneDeviceWithGpipe) {
  expect_pp2_equals_one_device({{"gpipe", 1}});
}

TEST(Bf16Training, GptPp2EqualsOneDeviceInterleaved) {
  expect_pp2_equals_one_device({{"interleaved", 2}});
}

// The split backward keeps the products' output gradients in bf16 for W.
TEST(Bf16Training, GptPp2EqualsOneDeviceWithZbH1) {
  expect_pp2_equals_one_device({{"zb-h1", 1}});
}

TEST(Bf16Training, GptPp2EqualsOneDeviceWithZbV) {
  expect_pp2_equals_one_device({{"zb-v", 2}});
}

// The distributed optimizer in bf16: gradients reduce-scattered in fp32, each replica's AdamW
// step of its shard of the fp32 main parameters (the only fp32 values it keeps), the updated
// shards rounded to bf16 and gathered. The sums over the
// replicas are dp's (two fp32 addends, the same bits in either order), and the update is the
// element-wise one: the first loss is bitwise one device's and later steps differ only where
// the gradient norm's fp32 sum, taken shard by shard, flips a bf16 copy's rounding: dp's 1e-4.
TEST(Bf16Training, LlamaDistributedOptimizerDp2EqualsOneDevice) {
  const ModelConfig m = in(llama(), Precision::bf16);
  const ParallelPlan plan{.data_parallel = 2,
                          .micro_batch_size = 2,
                          .global_batch_size = 4,
                          .distributed_optimizer = true};
  expect_equals_one_device_of_its_batches(m, plan, kDataParallel);
  // With --overlap-param-gather each step opens with the gathers of the bf16 shards the last
  // update rounded, each layer's forward waiting for its own: the same losses, bit for bit.
  ParallelPlan overlapped = plan;
  overlapped.overlap_grad_reduce = overlapped.overlap_param_gather = true;
  EXPECT_EQ(run(m, overlapped, 3, true).losses, run(m, plan, 3, true).losses);
}

// ZeRO stages 2 and 3 in bf16: the fp32 gradients of every micro-batch reduce-scattered into the
// replica's fp32 shard (stage 2), and each layer's fp32 main values kept as the replicas' shards,
// rounded to bf16 after each update and gathered as such (2 bytes a value), the bf16 copies
// the products read rounded from them exactly (stage 3). Data parallelism's sums in another
// order and nothing else: dp's tolerances, four layers taking the two slots in turn, two
// micro-batches a replica.
TEST(Bf16Training, ZeroStagesTwoAndThreeDp2EqualOneDevice) {
  const ModelConfig m = in(four_layers(gpt()), Precision::bf16);
  for (const bool stage3 : {false, true}) {
    SCOPED_TRACE(stage3 ? "stage 3" : "stage 2");
    const ParallelPlan plan{.data_parallel = 2,
                            .micro_batch_size = 1,
                            .global_batch_size = 4,
                            .distributed_optimizer = true,
                            .shard_gradients = true,
                            .shard_parameters = stage3};
    expect_equals_one_device_of_its_batches(m, plan, kDataParallel);
  }
}

// A bf16 run with the distributed optimizer saved after 2 steps and loaded into a new step
// continues with bitwise the losses of the run that went on; the checkpoint holds the fp32 main
// values (most fall between bf16's), not their bf16 copies.
TEST(Bf16Training, DistributedOptimizerCheckpointResumesBitwise) {
  const ModelConfig m = in(gpt(), Precision::bf16);
  const ParallelPlan plan{.data_parallel = 2,
                          .micro_batch_size = 2,
                          .global_batch_size = 4,
                          .distributed_optimizer = true};
  const TempDir dir("bf16_checkpoint");
  const std::string path = dir.prefix("step.ckpt");
  struct Run {
    devices::DeviceSet set{2, {.pin = false}};
    devices::SharedMemoryCommunicator comm;
    TrainingStep step;
    Run(const ModelConfig& m, const ParallelPlan& plan) : step(m, plan, kOptimizer, set, comm) {}
    double train(const ModelConfig& m, const ParallelPlan& plan, int it) {
      fill_batches(step, m, plan, it * plan.global_batch_size);
      step.prepare(it, kLearningRate);
      set.executor().run(step.graph());
      return step.result().loss;
    }
  };
  Run a(m, plan);
  for (int it = 1; it <= 2; ++it)
    a.train(m, plan, it);
  save_checkpoint(path, m, plan, a.step, {.iteration = 2, .consumed_samples = 8});
  const double a3 = a.train(m, plan, 3), a4 = a.train(m, plan, 4);
  Run b(m, plan);
  load_checkpoint(path, m, plan, b.step);
  std::size_t off_grid = 0, total = 0;
  for (int r = 0; r < 2; ++r)
    for (const GradientBucket& bucket : b.step.shard(r).buckets())
      for (float v : bucket.shard_values().to_vector()) {
        off_grid += static_cast<float>(ops::bf16(v)) != v;
        ++total;
      }
  EXPECT_GT(off_grid, total * 9 / 10);
  EXPECT_EQ(b.train(m, plan, 3), a3);
  EXPECT_EQ(b.train(m, plan, 4), a4);
}

// --qk-layernorm in bf16: the norms of the heads' queries and keys compute in fp32 on the QKV
// product's widened bf16 output and round once with RoPE into the bf16 the attention reads,
// adding no rounding to those the one-device bounds count: its gradients and losses are within
// them of the fp32 model's, and tp2 + SP within tensor parallelism's of one device in bf16.
ModelConfig with_qk_layernorm(ModelConfig m) {
  m.qk_layernorm = true;
  return m;
}

TEST(Bf16Training, QkLayernormNearFp32AndTp2SpEqualsOneDevice) {
  expect_gradients_near_fp32(with_qk_layernorm(llama()));
  expect_tracks_fp32(with_qk_layernorm(llama()));
  expect_equals_one_device_of_its_batches(in(with_qk_layernorm(llama()), Precision::bf16),
                                          {.tensor_parallel = 2,
                                           .sequence_parallel = true,
                                           .micro_batch_size = 2,
                                           .global_batch_size = 4},
                                          kTensorParallel);
}

// Recomputation in bf16 runs the same forward again from the same kept values (the fp32 group
// input, the MLP's bf16 input), with the same dropout masks: its losses and gradients are
// bitwise the bf16 run's that keeps every activation, alone, under pp2 (1F1B and interleaved)
// and under tp2 + SP; two steps, the second after an update.
void expect_bitwise(const Outcome& kept, const Outcome& recomputed) {
  EXPECT_EQ(recomputed.losses, kept.losses);
  for (const auto& [name, want] : kept.grads) {
    const auto& got = recomputed.grads.at(name);
    for (std::size_t i = 0; i < want.size(); ++i)
      if (got[i] != want[i]) {  // the first differing element names the parameter
        ADD_FAILURE() << name << " element " << i << ": " << got[i] << ", want " << want[i];
        break;
      }
  }
}

const Recompute kFullUniform1{
    .granularity = RecomputeGranularity::full, .method = RecomputeMethod::uniform, .num_layers = 1};
const Recompute kFullUniform2{
    .granularity = RecomputeGranularity::full, .method = RecomputeMethod::uniform, .num_layers = 2};
const Recompute kFullBlock1{
    .granularity = RecomputeGranularity::full, .method = RecomputeMethod::block, .num_layers = 1};
const Recompute kSelectiveMlp{.granularity = RecomputeGranularity::selective,
                              .modules = kRecomputeMlp};
const Recompute kSelectiveBoth{.granularity = RecomputeGranularity::selective,
                               .modules = kRecomputeCoreAttention | kRecomputeMlp};
// The norms alone, and with the MLP, which then reads the recomputed norm's bf16 output.
const Recompute kSelectiveNorms{.granularity = RecomputeGranularity::selective,
                                .modules = kRecomputeLayerNorm};
const Recompute kSelectiveNormsAndMlp{.granularity = RecomputeGranularity::selective,
                                      .modules = kRecomputeLayerNorm | kRecomputeMlp};

// Both dropouts on, four layers: the recomputed forward draws the same masks.
void expect_recomputation_bitwise(ModelConfig m, const ParallelPlan& plan,
                                  std::initializer_list<Recompute> methods) {
  m = in(four_layers(m), Precision::bf16);
  m.hidden_dropout = 0.1;
  m.attention_dropout = 0.1;
  const Outcome kept = run(m, plan, 2, true);
  for (const Recompute& r : methods) {
    SCOPED_TRACE(fmt::format("{} {} layers, modules {}", r.full() ? "full" : "selective",
                             r.method == RecomputeMethod::block ? "block" : "uniform", r.num_layers,
                             r.modules));
    m.recompute = r;
    expect_bitwise(kept, run(m, plan, 2, true));
  }
}

TEST(Bf16Training, RecomputationIsBitwiseOnOneDevice) {
  const ParallelPlan plan{.micro_batch_size = 2, .global_batch_size = 4};
  expect_recomputation_bitwise(gpt(), plan,
                               {kFullUniform1, kFullBlock1, kSelectiveMlp, kSelectiveNorms});
  expect_recomputation_bitwise(llama(), plan,
                               {kFullUniform2, kSelectiveBoth, kSelectiveNormsAndMlp});
}

TEST(Bf16Training, RecomputationIsBitwiseUnder1f1b) {
  expect_recomputation_bitwise(
      llama(), {.pipeline_parallel = 2, .micro_batch_size = 1, .global_batch_size = 4},
      {kFullUniform1, kFullBlock1, kSelectiveMlp, kSelectiveNormsAndMlp});
}

TEST(Bf16Training, RecomputationIsBitwiseInterleaved) {
  expect_recomputation_bitwise(llama(),
                               {.pipeline_parallel = 2,
                                .virtual_pipeline = 2,
                                .micro_batch_size = 1,
                                .global_batch_size = 4},
                               {kFullUniform1, kFullBlock1, kSelectiveMlp});
}

// Under SP the recomputed layer gathers its norms' bf16 outputs again; a recomputed MLP alone
// reads the gathered input it kept; recomputed norms gather their bf16 outputs again and round
// them into the products' inputs.
TEST(Bf16Training, RecomputationIsBitwiseUnderTp2Sp) {
  expect_recomputation_bitwise(
      gpt(),
      {.tensor_parallel = 2,
       .sequence_parallel = true,
       .micro_batch_size = 2,
       .global_batch_size = 4},
      {kFullUniform2, kFullBlock1, kSelectiveMlp, kSelectiveNorms, kSelectiveNormsAndMlp});
}

// The materialised bf16 step replays as the prediction of the same bf16 step does and holds
// what it counts: the parameters at 2 bytes, the fp32 gradients, and the fp32 main parameters
// with the two moments as optimizer state (Megatron-LM's 2 + 4 + 12 bytes a parameter) exactly. Its
// activations differ by two named terms, computed here from the model's sizes:
//  - what stays fp32 in the step where the prediction counts 2 bytes: the residual stream (the
//    chunk's input, each layer's middle and output), the projection's and fc2's outputs, and the
//    backward's fp32 gradient workspace but the gradients the products read in bf16 (the
//    logits', the activation's, fc1's and the attention output's; the logits' fp32 values are
//    written over the fp32 logits): 2 more bytes each. The prediction counts in fp32 what
//    Megatron-LM keeps so (the norms' statistics, the loss's logits, maxima, partial sums and
//    log-sum-exp) and the attention's log-sum-exp, and the bf16 logits and their gradient at 2
//    bytes, as the step holds them;
//  - the conversions' workspace, one per device (HalfWorkspace): QKV widened for RoPE and the
//    qk norms, and the bf16 operands of the products' backward (the norms write their bf16
//    outputs and the activation reads and writes bf16 straight, a few rows at a time).
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
  const std::int64_t h = m.hidden_size, L = m.num_layers;
  const std::int64_t qkv = 3 * h;
  const std::int64_t per_layer = T * h + T * h + T * h + T * h;
  const std::int64_t workspace = 4 * T * h + T * h + T * qkv + T * h;
  const std::int64_t fp32_kept = T * h + L * per_layer + workspace;
  const std::int64_t conversions = 4 * T * qkv + 2 * (2 * T * h + T * qkv);
  EXPECT_EQ(
      with.memory().current(0, rt::MemoryCategory::activations),
      without.memory().current(0, rt::MemoryCategory::activations) + 2 * fp32_kept + conversions);
}

// The values a layer keeps in fp32 that the prediction counts at 2 bytes, as
// MemoryIsThePredictionsPlusTheFp32Terms names them: the projection's and fc2's outputs, its
// middle and its output.
std::int64_t layer_fp32(const ModelConfig& m, std::int64_t T) {
  const std::int64_t h = m.hidden_size;
  return T * h + T * h + T * h + T * h;
}

// What a bf16 step keeps in fp32 and the prediction counts at 2 bytes, and the conversions'
// workspace, for a rank whose activation sets (`sets` of them) each hold its layers' fp32 values
// `layers_fp32` beside their stage input and, with more than one chunk, the gradients sent and
// received, and, on the last stage, one output set and the output layer's workspace: the bytes
// its activations exceed the prediction's by.
std::int64_t fp32_excess(const ModelConfig& m, std::int64_t T, std::int64_t layers_fp32,
                         std::int64_t sets, bool chunks, bool output) {
  const std::int64_t h = m.hidden_size;
  const std::int64_t qkv = 3 * h;
  const std::int64_t per_set = T * h + (chunks ? 2 * T * h : 0) + layers_fp32;
  const std::int64_t workspace = 4 * T * h + T * h + T * qkv + (output ? T * h : 0);
  const std::int64_t conversions = 4 * T * qkv + 2 * (2 * T * h + T * qkv);
  return 2 * (sets * per_set + workspace) + conversions;
}

// pp2 (1F1B) and the distributed optimizer over dp2 in bf16 hold what their predictions count:
// the parameters at 2 bytes, the fp32 gradients and the optimizer state exactly (with the
// distributed optimizer the fp32 main values of the replica's shard alone, as Megatron-LM keeps
// them: no bucket holds fp32 values whole); the activations by the fp32 terms above, stage by
// stage. fp16, its gradients fp32 as bf16's, the same.
TEST(Bf16Training, PipelineAndDistributedOptimizerMemoryIsThePredictions) {
  for (const Precision precision : {Precision::bf16, Precision::fp16}) {
    SCOPED_TRACE(precision_name(precision));
    const ModelConfig m = in(four_layers(gpt()), precision);
    devices::SharedMemoryCommunicator comm;
    // Micro-batches of 2 sequences: a norm's statistics (T = 32 values) fill whole 64-byte lines
    // in either precision, so the fp32 terms are exact.
    const ParallelPlan plans[] = {
        {.pipeline_parallel = 2, .micro_batch_size = 2, .global_batch_size = 8},
        {.data_parallel = 2,
         .micro_batch_size = 2,
         .global_batch_size = 8,
         .distributed_optimizer = true}};
    for (const ParallelPlan& plan : plans) {
      SCOPED_TRACE(plan.pipeline_parallel > 1 ? "pp2" : "dp2 distributed optimizer");
      devices::DeviceSet with(2, {.pin = false}), without(2, {.pin = false});
      TrainingStep real(m, plan, kOptimizer, with, comm);
      const TrainingStep shapes(m, plan, kOptimizer, without, comm, {.materialize = false});
      for (int r = 0; r < 2; ++r) {
        const auto d = static_cast<rt::DeviceId>(r);
        auto bytes = [d](devices::DeviceSet& set, rt::MemoryCategory c) {
          return set.memory().current(d, c);
        };
        for (auto c : {rt::MemoryCategory::parameters, rt::MemoryCategory::gradients,
                       rt::MemoryCategory::optimizer_state})
          EXPECT_EQ(bytes(with, c), bytes(without, c)) << to_string(c) << " rank " << r;
        const bool pipeline = plan.pipeline_parallel > 1;
        for (const GradientBucket& b : real.shard(r).buckets()) {
          EXPECT_EQ(b.sharded, !pipeline) << b.name;
          EXPECT_EQ(b.values.has_storage(), pipeline) << b.name;
        }
        const std::int64_t T = std::int64_t{m.seq_length} * plan.micro_batch_size;
        const std::int64_t excess =
            fp32_excess(m, T, (pipeline ? 2 : 4) * layer_fp32(m, T), real.activation_sets(r),
                        pipeline, !pipeline || r == 1);
        EXPECT_EQ(bytes(with, rt::MemoryCategory::activations),
                  bytes(without, rt::MemoryCategory::activations) + excess)
            << "rank " << r;
      }
    }
  }
}

// Recomputation and --qk-layernorm in bf16 on one device: the parameters, gradients and
// optimizer state are the prediction's exactly, the activations its plus the fp32 terms, which
// recomputation shares as it shares the layers' state: full recomputation of one layer at a time
// keeps one working layer's values and each layer's own output, selective recomputation of the
// MLP one fc2 output for every layer; the qk norms keep their inputs and statistics in fp32.
TEST(Bf16Training, RecomputationAndQkLayernormMemoryIsThePredictions) {
  const ModelConfig base = in(four_layers(gpt()), Precision::bf16);
  const std::int64_t T = std::int64_t{base.seq_length} * kOneDevice.micro_batch_size;
  const std::int64_t L = base.num_layers, h = base.hidden_size, layer = layer_fp32(base, T);
  const std::int64_t heads = base.num_attention_heads, d = base.head_dim();
  // The queries' and keys' inputs [T, heads, 2, d] (a key a query head: no grouping) and a mean
  // and a deviation a head.
  const std::int64_t qk = T * heads * 2 * d + 2 * T * heads * 2;
  struct Case {
    const char* name;
    Recompute recompute;
    bool qk_layernorm;
    std::int64_t layers_fp32;
  };
  const Case cases[] = {{"full uniform 1", kFullUniform1, false, (layer - T * h) + L * T * h},
                        {"selective mlp", kSelectiveMlp, false, L * (layer - T * h) + T * h},
                        {"qk-layernorm", {}, true, L * (layer + qk)}};
  devices::SharedMemoryCommunicator comm;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    ModelConfig m = base;
    m.recompute = c.recompute;
    m.qk_layernorm = c.qk_layernorm;
    devices::DeviceSet with(1, {.pin = false}), without(1, {.pin = false});
    const TrainingStep real(m, kOneDevice, kOptimizer, with, comm);
    const TrainingStep shapes(m, kOneDevice, kOptimizer, without, comm, {.materialize = false});
    for (auto category : {rt::MemoryCategory::parameters, rt::MemoryCategory::gradients,
                          rt::MemoryCategory::optimizer_state})
      EXPECT_EQ(with.memory().current(0, category), without.memory().current(0, category))
          << to_string(category);
    EXPECT_EQ(with.memory().current(0, rt::MemoryCategory::activations),
              without.memory().current(0, rt::MemoryCategory::activations) +
                  fp32_excess(m, T, c.layers_fp32, 1, false, true));
  }
}

// fp16 under ZeRO stages 2 and 3 is built as bf16's is (fp16_training_test.cpp compares it with
// plain data parallelism): with tensors its graph is the prediction's, task for task and edge
// for edge, the loss scaler's unscaling among them; stage 3 gathers the 16-bit shard straight
// into the 16-bit slots, with no rounding task of its own (param_slot_to_bf16 was one, which
// only a step built with tensors had), and its gathers wait for nothing at the step's start in
// either (the optimizer rounded the shards).
TEST(Bf16Training, Fp16ZeroStagesTwoAndThreeBuildThePredictedGraph) {
  devices::SharedMemoryCommunicator comm;
  const ParallelPlan stage2{.data_parallel = 2,
                            .micro_batch_size = 2,
                            .global_batch_size = 4,
                            .distributed_optimizer = true,
                            .shard_gradients = true};
  ParallelPlan stage3 = stage2;
  stage3.shard_parameters = true;
  OptimizerConfig scaled = kOptimizer;
  scaled.loss_scaling = true;
  const std::pair<const char*, ParallelPlan> cases[] = {{"ZeRO stage 2", stage2},
                                                        {"ZeRO stage 3", stage3}};
  for (const auto& [what, plan] : cases) {
    SCOPED_TRACE(what);
    devices::DeviceSet with(2, {.pin = false}), without(2, {.pin = false});
    const TrainingStep real(in(gpt(), Precision::fp16), plan, scaled, with, comm);
    const TrainingStep shapes(in(gpt(), Precision::fp16), plan, scaled, without, comm,
                              {.materialize = false});
    const rt::TaskTable &a = real.graph().tasks(), &b = shapes.graph().tasks();
    using Task = std::tuple<std::string, rt::DeviceId, std::vector<rt::TaskId>>;
    std::vector<Task> built, predicted;
    const auto successors = [](const rt::Graph& g, rt::TaskId t) {
      const std::span<const rt::TaskId> next = g.successors(t);
      std::vector<rt::TaskId> out(next.begin(), next.end());
      std::sort(out.begin(), out.end());
      return out;
    };
    int unscales = 0, roundings = 0;
    for (rt::TaskId t = 0; t < a.size(); ++t) {
      roundings += a.name(t) == "param_slot_to_bf16";
      built.emplace_back(a.name(t), a[t].device, successors(real.graph(), t));
      unscales += a.name(t) == "unscale_and_check_inf";
    }
    for (rt::TaskId t = 0; t < b.size(); ++t)
      predicted.emplace_back(b.name(t), b[t].device, successors(shapes.graph(), t));
    EXPECT_EQ(built.size(), predicted.size());
    for (std::size_t t = 0; t < std::min(built.size(), predicted.size()); ++t)
      if (built[t] != predicted[t]) {
        ADD_FAILURE() << "task " << t << " (" << std::get<0>(built[t]) << ") differs from the "
                      << "prediction's (" << std::get<0>(predicted[t]) << ")";
        break;
      }
    EXPECT_EQ(unscales, 2);
    EXPECT_EQ(roundings, 0);
  }
}

}  // namespace
}  // namespace weave::graphs
