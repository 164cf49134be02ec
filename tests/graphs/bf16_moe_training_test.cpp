// bf16 mixed-precision training of MoE layers: the experts' products in bf16 with fp32 sums, the
// router in fp32 on the bf16 input (Megatron-Core's --moe-router-dtype fp32, MindSpeed's gate),
// the dispatch and combine all-to-alls carrying bf16 values, the aux and z losses in fp32. On one
// device its gradients and losses track the fp32 model's within bf16's rounding; expert, tensor
// (+ sequence) and context parallelism, split and pipe experts and Ampipe (with and without context
// parallelism) equal one device in
// bf16 within what their roundings allow; its memory is the prediction's plus named fp32 terms.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "half_precision_equivalence.hpp"
#include "step_outcome.hpp"
#include "tiny_model.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/training_step.hpp"

namespace weave::graphs {
namespace {

// 2 layers, the second a MoE layer of 4 experts, top-2, with the aux and z losses.
ModelConfig moe_model(Precision p) {
  ModelConfig m = tiny(4);
  m.hidden_size = 64;
  m.ffn_hidden_size = 128;
  m.precision = p;
  return m;
}

constexpr double kU = 1.0 / 256;  // bf16's unit roundoff, 2^-8
const ParallelPlan kOneDevice{.micro_batch_size = 2, .global_batch_size = 4};

// Roundings on the path of the fp32 model's values that bf16 adds. Forward: the embedding and the
// final norm's output and the logits (3), the dense layer's 8 (the attention's input, QKV, its
// output, the projection's, fc1's input and output, the activation, fc2's output), and the MoE
// layer's attention half (4) and MoE half: the norm's output the router and the experts read,
// fc1's output, the activation, fc2's output and the combined output (5), and the bf16 residual
// stream's two residual ends in each layer (4): k = 24. The router itself computes in fp32 on the
// rounded input. Backward adds, per gradient: the logits' (1), the dense layer's 6 (the
// projection's, the attention's, QKV's, fc2's, the activation's and fc1's output gradients), the
// MoE layer's attention half's 3 and its MoE half's: the output's, the experts' outputs', fc2's
// input, the activation's input, fc1's input and the summed input gradient's (6), and the
// stream's gradient after each layer's two norms' backward and the final norm's (5):
// k = 24 + 21 = 45. Independent roundings of either sign: a gradient differs by sqrt(45) u =
// 2.6 % of its norm.
constexpr double kForwardRoundings = 24, kGradientRoundings = 45;

TEST(Bf16MoeTraining, GradientsAndLossesTrackFp32) {
  const Outcome fp32 = run(moe_model(Precision::fp32), kOneDevice, 1, false);
  const Outcome bf16 = run(moe_model(Precision::bf16), kOneDevice, 1, false);
  ASSERT_EQ(fp32.grads.size(), bf16.grads.size());
  const double bound = std::sqrt(kGradientRoundings) * kU;
  for (const auto& [name, want] : fp32.grads) {
    const double diff = relative_difference(bf16.grads.at(name), want);
    EXPECT_LE(diff, bound) << name;
    EXPECT_GT(diff, 0) << name << ": not computed in bf16";
  }
  // The loss moves by at most sqrt(k) u of itself (bf16_training_test's argument); the aux loss,
  // fp32 statistics of the fp32 router's probabilities of the rounded input, by as much.
  EXPECT_NEAR(bf16.losses[0], fp32.losses[0], std::sqrt(kForwardRoundings) * kU * fp32.losses[0]);
  EXPECT_NE(bf16.losses[0], fp32.losses[0]);
  EXPECT_NEAR(bf16.aux[0], fp32.aux[0], std::sqrt(kForwardRoundings) * kU * fp32.aux[0]);
  // Training: each AdamW step adds at most the first step's bound (|update| <= lr per element).
  const Outcome fp32_5 = run(moe_model(Precision::fp32), kOneDevice, 5, true);
  const Outcome bf16_5 = run(moe_model(Precision::bf16), kOneDevice, 5, true);
  for (std::size_t i = 0; i < fp32_5.losses.size(); ++i)
    EXPECT_NEAR(bf16_5.losses[i], fp32_5.losses[i],
                static_cast<double>(i + 1) * std::sqrt(kForwardRoundings) * kU * fp32_5.losses[i])
        << "step " << i + 1;
  EXPECT_LT(bf16_5.losses.back(), 0.9 * bf16_5.losses.front());  // it learns
}

// Expert parallelism: kExpertParallel (half_precision_equivalence.hpp).

// Tensor parallelism with SP adds the dense layer's and the attention half's tp roundings
// (bf16_training_test: r = 4 L + 1 = 9 for the attention halves, the dense MLP and the output
// layer); the MoE half runs each rank's SP shard of the tokens whole (experts not split), and
// rounds as one device does. Gradients within sqrt(9) u; first loss 1e-3, later 1e-2 as there.
constexpr ParallelTolerance kTensorParallel{1e-3, 3.0 / 256, 1e-2};

TEST(Bf16MoeTraining, Ep2EqualsOneDevice) {
  expect_equals_one_device_of_its_batches(
      moe_model(Precision::bf16),
      {.expert_parallel = 2, .data_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4},
      kExpertParallel);
}

// Experts split over tp (MindSpeed's deepspeed_moe, its gate in fp32): fc2's partial sums are
// bf16 values before the reduce-scatter sums them and the sum is rounded again, and fc1's
// input-gradient partial sums likewise: 2 roundings more than one device's in the MoE layer, on
// top of the dense layer's, the attention halves' and the output layer's 7 (see kTensorParallel):
// r = 9 again.
ModelConfig deepspeed_moe(ParallelPlan& plan) {
  plan.moe_model_type = "deepspeed_moe";
  return moe_model(Precision::bf16);
}

TEST(Bf16MoeTraining, Tp2SpSplitExpertsEqualsOneDevice) {
  ParallelPlan plan{.tensor_parallel = 2,
                    .sequence_parallel = true,
                    .micro_batch_size = 2,
                    .global_batch_size = 4};
  const ModelConfig m = deepspeed_moe(plan);
  expect_equals_one_device_of_its_batches(m, plan, kTensorParallel);
}

// --use-pipe-experts with split experts: each item's rows gathered over tp, its products and
// partial sums as above, item by item.
TEST(Bf16MoeTraining, PipeExpertsSplitOverTpEqualsOneDevice) {
  ParallelPlan plan{.tensor_parallel = 2,
                    .sequence_parallel = true,
                    .expert_parallel = 2,
                    .data_parallel = 2,
                    .micro_batch_size = 1,
                    .global_batch_size = 4,
                    .pipe_experts = true,
                    .pipe_experts_multi_data = 2};
  const ModelConfig m = deepspeed_moe(plan);
  expect_equals_one_device_of_its_batches(m, plan, kTensorParallel);
}

// Ampipe (degree 2): each chunk's queries through the bf16 attention kernel and its projection,
// each chunk's tokens routed, dispatched and combined on their own. Every value meets the same
// roundings as on one device; what differs is the order of fp32 sums (the chunks' dk and dv
// accumulated chunk after chunk, the data-parallel reduction), which may flip the rounding of a
// rare bf16 value: as expert parallelism, kExpertParallel.
TEST(Bf16MoeTraining, Ep2Ampipe2EqualsOneDevice) {
  expect_equals_one_device_of_its_batches(moe_model(Precision::bf16), kEp2Ampipe2, kExpertParallel);
}

// Ampipe with MindSpeed's tp-sp overlap: split experts' items pipelined over both chunks, their
// partial sums bf16 values reduced over tp (kTensorParallel's r = 9).
TEST(Bf16MoeTraining, Ampipe2TpSpOverlapEqualsOneDevice) {
  ParallelPlan plan{.tensor_parallel = 2,
                    .sequence_parallel = true,
                    .expert_parallel = 2,
                    .data_parallel = 2,
                    .micro_batch_size = 1,
                    .global_batch_size = 4,
                    .ampipe_degree = 2,
                    .ampipe_tp_sp_comm_overlap = true};
  const ModelConfig m = deepspeed_moe(plan);
  expect_equals_one_device_of_its_batches(m, plan, kTensorParallel);
}

// The same without SP (Megatron-Core's router, the experts split by
// --expert-tensor-parallel-size): each chunk's projection all-reduced as a bf16 value, each tp
// rank routing its slice of the chunk, the items' partial sums reduced over tp as with SP.
TEST(Bf16MoeTraining, Ampipe2TpOverlapWithoutSpEqualsOneDevice) {
  const ParallelPlan plan{.tensor_parallel = 2,
                          .expert_parallel = 2,
                          .expert_tensor_parallel = 2,
                          .data_parallel = 2,
                          .micro_batch_size = 1,
                          .global_batch_size = 4,
                          .ampipe_degree = 2,
                          .ampipe_tp_sp_comm_overlap = true};
  expect_equals_one_device_of_its_batches(moe_model(Precision::bf16), plan, kTensorParallel);
}

// Context parallelism (cp2, ring attention): each key/value block's partial output comes out of
// the bf16 attention kernel rounded to bf16 before the fp32 merge with the fp32 softmax
// statistics, and each block's dq is rounded before the fp32 sum over blocks: per attention layer
// one rounding more forward and one backward than one device's whole-sequence kernel, r = 2 L =
// 4: gradients within sqrt(4) u = 0.8 %; the losses as kTensorParallel's.
constexpr ParallelTolerance kContextParallel{1e-3, 2.0 / 256, 1e-2};

TEST(Bf16MoeTraining, Cp2EqualsOneDevice) {
  expect_equals_one_device_of_its_batches(
      moe_model(Precision::bf16),
      {.context_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}, kContextParallel);
}

// Ampipe (degree 2) under cp2: each chunk takes its share of the (query half, key block) products
// through the bf16 attention kernel, every partial output rounded to bf16 before the fp32 merge,
// and each half's merged output rounded once when its chunk completes it; each block's dq rounded
// before the fp32 sum over blocks. The same roundings per attention layer as the cp ring's, in
// the other order of fp32 sums (the chunks' products and dk, dv accumulated chunk after chunk,
// the blocks' gradients summed at home), which Ampipe without cp shows to move nothing measurable
// beyond kExpertParallel's 1e-5: kContextParallel.
TEST(Bf16MoeTraining, Cp2Ampipe2EqualsOneDevice) {
  expect_equals_one_device_of_its_batches(
      moe_model(Precision::bf16),
      {.context_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4, .ampipe_degree = 2},
      kContextParallel);
}

TEST(Bf16MoeTraining, Tp2SpEp2EqualsOneDevice) {
  expect_equals_one_device_of_its_batches(moe_model(Precision::bf16),
                                          {.tensor_parallel = 2,
                                           .sequence_parallel = true,
                                           .expert_parallel = 2,
                                           .micro_batch_size = 2,
                                           .global_batch_size = 4},
                                          kTensorParallel);
}

// A MoE model under pipeline, expert and data parallelism, as pasted MoE scripts combine them:
// the stage boundary sends the bf16 stream's values and gradients, rounding nothing one device
// does not (bf16_training_test's pipeline tolerance, 3u in gradient norm, holds it); expert
// parallelism reorders fp32 sums only. With the distributed optimizer a replica's gradients are
// reduced in its shard only, so it is held to the losses of the same plan without it: the fp32
// gradients are reduce-scattered in the order they are all-reduced and the updated fp32 values
// gathered and rounded as each replica rounds its own; only the clipping norm is summed shard by
// shard, in another order (an fp32 ulp of the update, 1e-6 of the losses at most; the aux loss of
// step 3 moves by 1e-9).
constexpr ParallelTolerance kPipelineParallel{1e-3, 3.0 / 256, 1e-2};

TEST(Bf16MoeTraining, Pp2Ep2EqualsOneDeviceAndTheDistributedOptimizerChangesNoLoss) {
  ParallelPlan plan{.expert_parallel = 2,
                    .data_parallel = 2,
                    .pipeline_parallel = 2,
                    .micro_batch_size = 1,
                    .global_batch_size = 4};
  const ModelConfig m = moe_model(Precision::bf16);
  expect_equals_one_device_of_its_batches(m, plan, kPipelineParallel);
  const Outcome replicated = run(m, plan, 3, true);
  plan.distributed_optimizer = true;
  const Outcome sharded = run(m, plan, 3, true);
  for (std::size_t i = 0; i < replicated.losses.size(); ++i) {
    EXPECT_NEAR(sharded.losses[i], replicated.losses[i], 1e-6 * replicated.losses[i]) << i;
    EXPECT_NEAR(sharded.aux[i], replicated.aux[i], 1e-6 * replicated.aux[i]) << i;
  }
}

// Full recomputation of a MoE layer in bf16 runs its router, dispatch, experts and combine again
// from the kept fp32 group input, with the same dropout masks; selective recomputation of the
// experts' activation (moe_act) computes the bf16 hidden layer again from fc1's kept output, of
// the norms (layernorm) their bf16 outputs from the kept inputs, and of the MoE layer (moe) its
// whole forward from the kept norm output: losses, aux losses and every gradient are bitwise
// those of the run that keeps every activation, under ep2 and under pp2 with ep2 and Ampipe 2
// (without layernorm and moe, refused there); two steps, the second after an update.
TEST(Bf16MoeTraining, RecomputationIsBitwise) {
  ModelConfig m = moe_model(Precision::bf16);
  m.hidden_dropout = 0.1;
  m.attention_dropout = 0.1;
  const ParallelPlan plans[] = {
      {.expert_parallel = 2, .data_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4},
      {.expert_parallel = 2,
       .data_parallel = 2,
       .pipeline_parallel = 2,
       .micro_batch_size = 1,
       .global_batch_size = 4,
       .ampipe_degree = 2}};
  const Recompute methods[] = {
      {.granularity = RecomputeGranularity::full,
       .method = RecomputeMethod::uniform,
       .num_layers = 1},
      {.granularity = RecomputeGranularity::full,
       .method = RecomputeMethod::block,
       .num_layers = 1},
      {.granularity = RecomputeGranularity::selective, .modules = kRecomputeMoeActivation},
      {.granularity = RecomputeGranularity::selective,
       .modules = kRecomputeMoeActivation | kRecomputeLayerNorm},
      {.granularity = RecomputeGranularity::selective, .modules = kRecomputeMoe},
      {.granularity = RecomputeGranularity::selective,
       .modules = kRecomputeMoe | kRecomputeMoeActivation | kRecomputeLayerNorm}};
  for (const ParallelPlan& plan : plans) {
    m.recompute = {};
    const Outcome kept = run(m, plan, 2, true);
    for (const Recompute& r : methods) {
      SCOPED_TRACE(fmt::format(
          "pp {}, ampipe {}, {}, modules {}", plan.pipeline_parallel, plan.ampipe_degree,
          r.method == RecomputeMethod::block ? "block" : "uniform", r.modules));
      // Ampipe computes its norms and its MoE chunks inside its pipelined block: layernorm and
      // moe are refused there.
      if ((r.recomputes(kRecomputeLayerNorm) || r.recomputes(kRecomputeMoe)) &&
          plan.ampipe_degree > 1)
        continue;
      m.recompute = r;
      const Outcome again = run(m, plan, 2, true);
      EXPECT_EQ(again.losses, kept.losses);
      EXPECT_EQ(again.aux, kept.aux);
      for (const auto& [name, want] : kept.grads)
        EXPECT_TRUE(again.grads.at(name) == want) << name;
    }
  }
}

// A loss scaler with MoE layers (bf16's --loss-scale): the scale multiplies the loss's gradient
// and the aux and z losses' alike (Megatron-Core's MoEAuxLossAutoScaler), and the unscaling
// divides every main gradient by it. A power of two commutes with every bf16 rounding and fp32
// sum (bf16 has fp32's exponent range: nothing reaches the subnormals or overflows), so two steps
// scaled by 2^10 are bitwise the unscaled ones: losses, aux losses and every unscaled gradient,
// on one device and under ep2. Were the aux losses' gradients left unscaled, the router's would
// shrink by the scale.
TEST(Bf16MoeTraining, APowerOfTwoLossScaleChangesNoBit) {
  const ModelConfig m = moe_model(Precision::bf16);
  const auto steps = [&m](const ParallelPlan& plan, float scale) {
    OptimizerConfig opt{.adamw = {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1},
                        .clip_grad = 1.0,
                        .loss_scaling = scale != 1.f};
    return two_scaled_steps(m, plan, opt, 1e-2, scale).outcome;
  };
  const ParallelPlan ep2{
      .expert_parallel = 2, .data_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4};
  for (const ParallelPlan& plan : {kOneDevice, ep2}) {
    SCOPED_TRACE(plan.devices());
    const Outcome unscaled = steps(plan, 1.f), scaled = steps(plan, 1024.f);
    EXPECT_EQ(scaled.losses, unscaled.losses);
    EXPECT_EQ(scaled.aux, unscaled.aux);
    for (const auto& [name, want] : unscaled.grads)
      EXPECT_TRUE(scaled.grads.at(name) == want) << name;
  }
}

// The materialised bf16 MoE step holds what the prediction of the same step counts, plus named
// fp32 terms. Parameters at 2 bytes, fp32 gradients and the fp32 main parameters with the two
// moments as optimizer state equal exactly. Activations differ by bf16_training_test's terms
// (what stays fp32 on the dense path, each 2 bytes more, and the conversions' workspace), the
// dense layer's as there and the MoE layer's attention half's, and by the MoE layer's rows: a bf16
// run keeps them as bf16 values in fp32 buffers (its norm's output, the slot's input, output and
// their gradients, the router's logits, probabilities, top-k weights and their gradients, the
// grouped rows, the experts' outputs and their gradients, the experts' hidden layer before and
// after the activation), 2 bytes a value more than the prediction's count of them.
TEST(Bf16MoeTraining, MemoryIsThePredictionsPlusTheFp32Terms) {
  const ModelConfig m = moe_model(Precision::bf16);
  const OptimizerConfig opt{.adamw = {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8}};
  devices::SharedMemoryCommunicator comm;
  devices::DeviceSet with(1, {.pin = false}), without(1, {.pin = false});
  const TrainingStep real(m, kOneDevice, opt, with, comm);
  const TrainingStep shapes(m, kOneDevice, opt, without, comm, {.materialize = false});
  for (auto category : {rt::MemoryCategory::parameters, rt::MemoryCategory::gradients,
                        rt::MemoryCategory::optimizer_state})
    EXPECT_EQ(with.memory().current(0, category), without.memory().current(0, category))
        << to_string(category);
  const std::int64_t T = std::int64_t{m.seq_length} * kOneDevice.micro_batch_size;
  const std::int64_t h = m.hidden_size, f = m.ffn_hidden_size, E = m.num_experts;
  const std::int64_t k = m.moe_router_topk, qkv = 3 * h;
  // As bf16_training_test counts them: a dense layer's fp32 terms, the MoE layer's attention
  // half's (the same without fc2's output) and the backward's workspace.
  const std::int64_t attention_half = T * h + T * h + T * h;
  const std::int64_t dense_layer = attention_half + T * h;
  const std::int64_t workspace = 4 * T * h + T * h + T * qkv + T * h;
  // The MoE layer's rows, one device, one slot of T tokens, every pick kept (capacity T k).
  const std::int64_t moe_rows = T * h                     // the norm's output
                                + T * h + 3 * T * h       // the output; input, its gradients
                                + 3 * T * E + 2 * T * k   // router
                                + 4 * T * k * h           // grouped rows, outputs, gradients
                                + T * k * f + T * k * f;  // hidden layer (GeLU: f1 = f)
  const std::int64_t fp32_kept = T * h + dense_layer + attention_half + workspace;
  const std::int64_t conversions = 4 * T * qkv + 2 * (2 * T * h + T * qkv);
  EXPECT_EQ(with.memory().current(0, rt::MemoryCategory::activations),
            without.memory().current(0, rt::MemoryCategory::activations) + 2 * fp32_kept +
                conversions + 2 * moe_rows);
}

}  // namespace
}  // namespace weave::graphs
