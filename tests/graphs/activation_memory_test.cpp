// A prediction's activation memory against Korthikanti et al. 2022 ("Reducing Activation
// Recomputation in Large Transformer Models", section 4), for a dense GPT in bf16 on one pipeline
// stage. The paper counts, per layer and in bytes of 16-bit values:
//   no parallelism      sbh (34 + 5as/h)
//   tensor parallel t   sbh (10 + 24/t + 5as/(ht))
//   t with sequence par sbh/t (34 + 5as/h)
//   full recomputation  2sbh (the layer's input; sharded by t under sequence parallelism)
// weave's kernels are not Megatron-LM's, so each test states weave's figure as the paper's terms
// minus what weave does not keep and plus what it keeps besides, each term named for its tensor,
// and fails if either side moves. The embedding's, the loss's and the backward workspace's
// tensors, which the paper leaves out of its per-layer count, are added explicitly. What a 16-bit
// run keeps in fp32 as Megatron-LM does (the norms' statistics, the cross-entropy's logits and
// row figures) and weave's attention's log-sum-exp are counted at 4 bytes a value.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "weave/devices/device_set.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/prediction.hpp"
#include "weave/graphs/training_step.hpp"
#include "weave/ops/cross_entropy.hpp"

namespace weave::graphs {
namespace {

// s sequence, b micro-batch, h hidden, a heads, L layers; 4h-wide GELU MLPs, learned positions,
// a vocabulary of V (already a multiple of 128 t, so unpadded). Sizes make every tensor a whole
// number of 64-byte lines in bf16, so the tracker's alignment adds nothing but to the 1-element
// norm buffer.
constexpr std::int64_t s = 256, b = 2, h = 256, a = 8, L = 2, V = 512;
constexpr std::int64_t kBytes = 2;  // bf16
constexpr std::int64_t kFp32 = 4;   // what every run keeps in fp32

TrainerConfig gpt(int t, bool sp, const Recompute& recompute = {}) {
  TrainerConfig c;
  c.model.num_layers = static_cast<int>(L);
  c.model.hidden_size = static_cast<int>(h);
  c.model.num_attention_heads = static_cast<int>(a);
  c.model.ffn_hidden_size = static_cast<int>(4 * h);
  c.model.seq_length = static_cast<int>(s);
  c.model.vocab_size = static_cast<int>(V);
  c.model.precision = Precision::bf16;
  c.model.recompute = recompute;
  c.plan = {.tensor_parallel = t,
            .sequence_parallel = sp,
            .micro_batch_size = static_cast<int>(b),
            .global_batch_size = static_cast<int>(b)};
  return c;
}

std::int64_t predicted_activation_bytes(const TrainerConfig& c) {
  const Prediction p = predict_step(c);
  const std::int64_t first =
      p.memory.front()[static_cast<std::size_t>(rt::MemoryCategory::activations)];
  for (const auto& device : p.memory)  // every tp rank holds the same
    EXPECT_EQ(device[static_cast<std::size_t>(rt::MemoryCategory::activations)], first);
  return first;
}

// The paper's per-layer figure, in bytes (its formulas count 16-bit values: 2 bytes each, the
// dropout masks 1 byte).
std::int64_t paper_layer(std::int64_t t, bool sp) {
  const std::int64_t sbh = s * b * h, scores = 5 * a * s * s * b;  // 5as^2b = sbh 5as/h
  if (sp) return 34 * sbh / t + scores / t;
  return 10 * sbh + 24 * sbh / t + scores / t;
}

// weave's figure per layer, from the paper's: what it does not keep and what it keeps besides.
// r: the residual stream's rows on a rank (s, or s/t under sequence parallelism); e: the bytes of
// a value the paper counts at 2 (kBytes in a 16-bit run, 4 in an fp32 one).
std::int64_t weave_layer(std::int64_t t, bool sp, std::int64_t e = kBytes) {
  const std::int64_t r = sp ? s / t : s;
  std::int64_t bytes = paper_layer(t, sp);
  // Not kept: the two dropout masks (attention output and MLP output, 1 byte an element each):
  // weave draws them again from their Philox keys in backward.
  bytes -= 2 * r * b * h;
  // Not kept: the scores, softmax and attention-dropout output and mask (5as^2b/t): the
  // blockwise attention keeps no s x s tensor and recomputes its scores in backward...
  bytes -= 5 * a * s * s * b / t;
  // Kept besides: the attention projection's output before bias-dropout-add (proj_partial,
  // [s, b, h] partial sums), and under sequence parallelism its reduce-scattered rows (proj_out).
  bytes += kBytes * s * b * h;
  if (sp) bytes += kBytes * r * b * h;
  // Kept besides: the MLP's output before bias-dropout-add (fc2_partial [s, b, h]), and under
  // sequence parallelism its reduce-scattered rows (mlp_out).
  bytes += kBytes * s * b * h;
  if (sp) bytes += kBytes * r * b * h;
  // Under sequence parallelism weave keeps each norm's all-gathered output [s, b, h] (ln1_full,
  // ln2_full) that the QKV and fc1 products read, where Megatron-LM keeps the sharded one (counted
  // by the paper) and gathers it again in backward.
  if (sp) bytes += 2 * kBytes * s * b * h;
  bytes = bytes / kBytes * e;
  // Kept besides, in fp32 whatever the precision: the softmax's log-sum-exp per query row and
  // head [b, a/t, s] (the blockwise attention's), and the two norms' means and reciprocal
  // standard deviations, one per row (as Megatron-LM's norms return them).
  bytes += kFp32 * b * (a / t) * s;
  bytes += 4 * kFp32 * r * b;
  return bytes;
}

// What the rank holds besides its layers: the chunk's input and output, the loss's tensors and
// the backward's workspace. The paper's per-layer figure counts each layer's input; the last
// layer's output (the final norm's input) is one residual stream more. e as in weave_layer.
std::int64_t outside_layers(std::int64_t t, bool sp, std::int64_t e = kBytes) {
  const std::int64_t r = sp ? s / t : s;
  const std::int64_t stream = e * r * b * h;  // a residual stream [r, b, h]
  const std::int64_t whole = e * s * b * h;   // [s, b, h]
  const std::int64_t Vl = V / t;
  std::int64_t bytes = 0;
  bytes += stream;         // the last layer's output (x_out), the final norm's input
  if (sp) bytes += whole;  // the embedding's partial sums before their reduce-scatter
  // The loss (OutputSet): the final norm's output and its row statistics (fp32), its
  // all-gathered output under sequence parallelism, the vocabulary shard's logits, and the
  // cross-entropy's row maxima, partial sums and log-sum-exp, all fp32 as Megatron-LM's
  // cross-entropy keeps them; a 16-bit run's output product writes its logits in 16 bits first.
  bytes += stream + 2 * kFp32 * r * b;
  if (sp) bytes += whole;
  bytes += kFp32 * s * b * Vl;
  bytes += kFp32 * s * b * (2 + ops::kCrossEntropyPartials);
  if (e == kBytes) bytes += kBytes * s * b * Vl;
  // The backward's workspace (BackwardWorkspace), shared by every layer: the residual stream's
  // gradients d_x, d_x_mid, d_tmp, d_mlp and the norm's d_norm (sharded under sequence
  // parallelism, d_norm then beside the whole d_norm_full; without it d_norm is d_norm_full), the
  // whole d_mlp_full under sequence parallelism, the MLP's d_act and d_fc1 (4h/t wide each), the
  // attention's d_attn (h/t) and d_qkv (3h/t), the logits' gradient (in 16 bits in a 16-bit run,
  // its fp32 values written over the fp32 logits) and the final norm's.
  bytes += 4 * stream + whole;
  if (sp) bytes += stream + whole;
  bytes += e * s * b * (4 * h / t + 4 * h / t + h / t + 3 * h / t);
  bytes += e * s * b * Vl + whole;
  bytes += 64;  // the squared gradient norm: one element, one 64-byte line
  return bytes;
}

TEST(ActivationMemory, KorthikantiWithTensorParallelism) {
  for (const int t : {1, 2, 4}) {
    SCOPED_TRACE(t);
    // The paper's t = 1 figure is sbh (34 + 5as/h): its tp formula at t = 1.
    if (t == 1) {
      EXPECT_EQ(paper_layer(1, false), s * b * h * 34 + 5 * a * s * s * b);
    }
    const std::int64_t expected = L * weave_layer(t, false) + outside_layers(t, false);
    EXPECT_EQ(predicted_activation_bytes(gpt(t, false)), expected);
  }
}

TEST(ActivationMemory, KorthikantiWithTensorAndSequenceParallelism) {
  for (const int t : {2, 4}) {
    SCOPED_TRACE(t);
    const std::int64_t expected = L * weave_layer(t, true) + outside_layers(t, true);
    EXPECT_EQ(predicted_activation_bytes(gpt(t, true)), expected);
  }
}

// Megatron's materialised core attention (--attention-backend unfused or local) with attention
// dropout keeps what the paper's 5as^2b/t counts, term by term: the softmax's output (2as^2b/t),
// the dropout's mask (as^2b/t, one byte a score) and the dropout's output (2as^2b/t), which
// weave_layer takes off for the blockwise attention; weave keeps the log-sum-exp besides, as with
// the fused kernel. Selective recomputation of the core attention keeps none of them again.
TEST(ActivationMemory, KorthikantiWithMaterialisedScores) {
  for (const auto& [t, sp] : {std::pair{1, false}, std::pair{2, false}, std::pair{2, true}}) {
    SCOPED_TRACE(testing::Message() << "t " << t << (sp ? " sp" : ""));
    const std::int64_t softmax = kBytes * a * s * s * b / t;
    const std::int64_t mask = a * s * s * b / t;
    const std::int64_t dropped = kBytes * a * s * s * b / t;
    EXPECT_EQ(softmax + mask + dropped, 5 * a * s * s * b / t);  // the paper's term
    for (const AttentionBackend backend : {AttentionBackend::unfused, AttentionBackend::local}) {
      TrainerConfig c = gpt(t, sp);
      c.model.attention_backend = backend;
      c.model.attention_dropout = 0.1;
      const std::int64_t expected =
          L * (weave_layer(t, sp) + softmax + mask + dropped) + outside_layers(t, sp);
      EXPECT_EQ(predicted_activation_bytes(c), expected);
      c.model.recompute = {.granularity = RecomputeGranularity::selective};  // core_attn
      EXPECT_EQ(predicted_activation_bytes(c), L * weave_layer(t, sp) + outside_layers(t, sp));
    }
    // Without attention dropout only the softmax's output is kept.
    TrainerConfig c = gpt(t, sp);
    c.model.attention_backend = AttentionBackend::unfused;
    EXPECT_EQ(predicted_activation_bytes(c),
              L * (weave_layer(t, sp) + softmax) + outside_layers(t, sp));
  }
}

// Full recomputation of every layer (uniform, one layer a group): each layer keeps its input,
// 2sbh (2sbh/t under sequence parallelism) as the paper counts, and the rank holds one layer's
// working set besides while that layer is recomputed and its backward runs (the paper's
// "recompute one layer at a time"): a layer's tensors but for its input and output.
TEST(ActivationMemory, KorthikantiWithFullRecomputation) {
  const Recompute full{.granularity = RecomputeGranularity::full,
                       .method = RecomputeMethod::uniform,
                       .num_layers = 1};
  for (const auto& [t, sp] : {std::pair{1, false}, std::pair{2, false}, std::pair{2, true}}) {
    SCOPED_TRACE(testing::Message() << "t " << t << (sp ? " sp" : ""));
    const std::int64_t r = sp ? s / t : s;
    const std::int64_t paper_checkpoint = 2 * r * b * h;  // the paper's 2sbh per layer
    // weave_layer counts the paper's input term; the working set holds the rest of the layer.
    const std::int64_t working_set = weave_layer(t, sp) - kBytes * r * b * h;
    const std::int64_t expected = L * paper_checkpoint + working_set + outside_layers(t, sp);
    EXPECT_EQ(predicted_activation_bytes(gpt(t, sp, full)), expected);
  }
}

// The step weave train runs (fp32, with tensors) holds the paper's figure too, measured on its
// devices: every term above at 4 bytes where it counted 2 (the 1-element norm buffer still one
// 64-byte line, the fp32 terms the same, the 16-bit logits absent), with every activation kept
// and with full recomputation.
TEST(ActivationMemory, MeasuredStepWithTensorsHoldsThePapersFigureInFp32) {
  const Recompute full{.granularity = RecomputeGranularity::full,
                       .method = RecomputeMethod::uniform,
                       .num_layers = 1};
  auto measured = [](TrainerConfig c) {
    c.model.precision = Precision::fp32;
    validate(c.model, c.plan);
    devices::DeviceSet set(c.plan.devices(), {.pin = false});
    devices::SharedMemoryCommunicator comm;
    const TrainingStep step(c.model, c.plan, {}, set, comm);
    const std::int64_t first = set.memory().peak(0, rt::MemoryCategory::activations);
    for (int d = 1; d < c.plan.devices(); ++d)  // every tp rank holds the same
      EXPECT_EQ(set.memory().peak(static_cast<rt::DeviceId>(d), rt::MemoryCategory::activations),
                first);
    return first;
  };
  for (const auto& [t, sp] : {std::pair{1, false}, std::pair{2, true}}) {
    SCOPED_TRACE(testing::Message() << "t " << t << (sp ? " sp" : ""));
    const std::int64_t r = sp ? s / t : s;
    EXPECT_EQ(measured(gpt(t, sp)), L * weave_layer(t, sp, 4) + outside_layers(t, sp, 4));
    const std::int64_t working_set = weave_layer(t, sp, 4) - 4 * r * b * h;
    EXPECT_EQ(measured(gpt(t, sp, full)),
              L * 4 * r * b * h + working_set + outside_layers(t, sp, 4));
  }
}

// The step weave train --bf16 runs, measured on its devices: the paper's figure in 16-bit values
// (its own unit), the prediction's, plus 2 bytes for each value the step keeps in fp32 where the
// paper (and the prediction) count 2, plus the conversions' workspace, less what the prediction
// counts that the bf16 step does not hold. The values both keep in fp32 (the norms' statistics,
// the attention's log-sum-exp, the loss's logits and row figures) and the 16-bit logits and
// their gradient are counted alike by both. T = sb rows (the products'), R = rb rows (the
// residual stream's: R = T, or T/t under sequence parallelism):
//  - a layer's fp32 values: its middle (x_mid) and output (x_out) [R], the projection's and
//    fc2's outputs before their reduction [T] and under sequence parallelism after it [R];
//  - the chunk's input (the embedding's output [R]) and under sequence parallelism the
//    embedding's partial sums [T];
//  - the backward's fp32 workspace: d_x, d_x_mid, d_tmp, d_mlp [R], d_norm_full [T], under
//    sequence parallelism d_norm [R] and d_mlp_full [T]; d_qkv (3T h/t) and the final norm's
//    gradient [T] (the activation's, fc1's and the attention output's gradients are the bf16
//    ones the products read, d_act16, d_fc1_16 and d_attn16, which the prediction counts);
//  - the conversions (one workspace a device): under sequence parallelism a norm's fp32 output
//    [R] and its gather [T] (without it the norms write their bf16 outputs straight), QKV
//    (3T h/t), 4 bytes a value; the bf16 operands of the products' backward and their results
//    (out16, d_out16 [T], d_qkv16 (3T h/t)), 2 bytes a value;
//  - not held: under sequence parallelism each norm's sharded output [R] (2 a layer and the
//    final norm's), which the prediction counts beside the gathered one; the bf16 step keeps the
//    gathered bf16 output only.
// With full recomputation a layer keeps its input only (2 bytes in the paper, a bf16 value in
// weave's fp32 stream: 2 more; the first layer's is the chunk's input, counted above), and the
// recomputed layer's working set holds a layer's fp32 values once.
struct Bf16Terms {
  std::int64_t layer_fp32, outside_fp32, conversions, not_held_per_layer, not_held_outside, R;
};

Bf16Terms bf16_terms(std::int64_t t, bool sp) {
  const std::int64_t T = s * b, R = sp ? T / t : T;
  Bf16Terms x{};
  x.R = R;
  x.layer_fp32 = 2 * R * h + 2 * T * h + (sp ? 2 * R * h : 0);
  x.outside_fp32 = R * h + (sp ? T * h : 0);  // input
  x.outside_fp32 +=
      4 * R * h + T * h + (sp ? R * h + T * h : 0) + 3 * T * h / t + T * h;  // backward workspace
  x.conversions = 4 * ((sp ? R * h + T * h : 0) + 3 * T * h / t) + 2 * (2 * T * h + 3 * T * h / t);
  x.not_held_per_layer = sp ? 2 * kBytes * R * h : 0;
  x.not_held_outside = sp ? kBytes * R * h : 0;
  return x;
}

std::int64_t measured_bf16(const TrainerConfig& c) {
  devices::DeviceSet set(c.plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  const TrainingStep step(c.model, c.plan, {}, set, comm);
  const std::int64_t first = set.memory().peak(0, rt::MemoryCategory::activations);
  for (int d = 1; d < c.plan.devices(); ++d)  // every tp rank holds the same
    EXPECT_EQ(set.memory().peak(static_cast<rt::DeviceId>(d), rt::MemoryCategory::activations),
              first);
  return first;
}

void expect_papers_figure_in_bf16(std::int64_t t, bool sp) {
  const Recompute full{.granularity = RecomputeGranularity::full,
                       .method = RecomputeMethod::uniform,
                       .num_layers = 1};
  const Bf16Terms x = bf16_terms(t, sp);
  const std::int64_t kept = L * weave_layer(t, sp) + outside_layers(t, sp);
  EXPECT_EQ(predicted_activation_bytes(gpt(static_cast<int>(t), sp)), kept);
  EXPECT_EQ(measured_bf16(gpt(static_cast<int>(t), sp)),
            kept + 2 * (L * x.layer_fp32 + x.outside_fp32) + x.conversions -
                L * x.not_held_per_layer - x.not_held_outside);
  const std::int64_t working_set = weave_layer(t, sp) - kBytes * x.R * h;
  const std::int64_t recomputed = L * 2 * x.R * h + working_set + outside_layers(t, sp);
  EXPECT_EQ(predicted_activation_bytes(gpt(static_cast<int>(t), sp, full)), recomputed);
  EXPECT_EQ(measured_bf16(gpt(static_cast<int>(t), sp, full)),
            recomputed + 2 * ((L - 1) * x.R * h + x.layer_fp32 + x.outside_fp32) + x.conversions -
                x.not_held_per_layer - x.not_held_outside);
}

TEST(ActivationMemory, MeasuredStepWithTensorsHoldsThePapersFigureInBf16) {
  expect_papers_figure_in_bf16(1, false);
}

TEST(ActivationMemory, MeasuredStepWithTensorsHoldsThePapersFigureInBf16WithTp2Sp) {
  expect_papers_figure_in_bf16(2, true);
}

// Under a pipeline every micro-batch in flight keeps its checkpoints, and a rank holds one
// working set whatever the number in flight: with one layer a stage and 1F1B's p - r sets on
// stage r, full recomputation frees (sets - 1) layers' tensors beyond their inputs on each stage.
TEST(ActivationMemory, FullRecomputationUnderAPipelineKeepsOneWorkingSetPerRank) {
  auto by_device = [](const Recompute& r) {
    TrainerConfig c = gpt(1, false, r);
    c.plan.pipeline_parallel = 2;
    c.plan.global_batch_size = 4 * static_cast<int>(b);
    std::vector<std::int64_t> bytes;
    for (const auto& device : predict_step(c).memory)
      bytes.push_back(device[static_cast<std::size_t>(rt::MemoryCategory::activations)]);
    return bytes;
  };
  const std::vector<std::int64_t> kept = by_device({}),
                                  recomputed = by_device({.granularity = RecomputeGranularity::full,
                                                          .method = RecomputeMethod::uniform,
                                                          .num_layers = 1});
  ASSERT_EQ(kept.size(), 2u);
  const std::int64_t beyond_input = weave_layer(1, false) - kBytes * s * b * h;
  EXPECT_EQ(kept[0] - recomputed[0], (2 - 1) * beyond_input);  // stage 0: two sets in flight
  EXPECT_EQ(kept[1] - recomputed[1], (1 - 1) * beyond_input);  // stage 1: one
}

// Uniform groups of two keep one input per group (the group's), and the working set is the two
// layers' tensors with the first layer's output between them (its input to the second).
TEST(ActivationMemory, UniformGroupsKeepOneInputPerGroup) {
  const Recompute groups{.granularity = RecomputeGranularity::full,
                         .method = RecomputeMethod::uniform,
                         .num_layers = 2};
  const std::int64_t stream = kBytes * s * b * h;
  const std::int64_t group_input = stream;  // the paper's 2sbh, once for the group
  const std::int64_t working_set = 2 * weave_layer(2, false) - stream;
  const std::int64_t expected = group_input + working_set + outside_layers(2, false);
  EXPECT_EQ(predicted_activation_bytes(gpt(2, false, groups)), expected);
}

// Selective recomputation (the core attention) changes nothing here: weave's attention keeps no
// s x s tensor to drop and recomputes its scores in every backward already. The paper's selective
// figure with sequence parallelism, 34 sbh/t, is the one above without the scores' term.
TEST(ActivationMemory, SelectiveRecomputationIsWhatTheBlockwiseAttentionAlreadyDoes) {
  const Recompute selective{.granularity = RecomputeGranularity::selective};
  EXPECT_EQ(predicted_activation_bytes(gpt(2, true, selective)),
            predicted_activation_bytes(gpt(2, true)));
  EXPECT_EQ(paper_layer(2, true) - 5 * a * s * s * b / 2, 34 * s * b * h / 2);
}

// Recomputation runs each recomputed layer's forward again: the step takes longer, and the FLOPs
// it adds are a forward of those layers.
TEST(ActivationMemory, FullRecomputationRunsTheForwardAgain) {
  TrainerConfig plain = gpt(2, false);
  TrainerConfig full = gpt(2, false,
                           {.granularity = RecomputeGranularity::full,
                            .method = RecomputeMethod::uniform,
                            .num_layers = 2});
  const Prediction p = predict_step(plain), q = predict_step(full);
  EXPECT_GT(q.step_ms, p.step_ms);
  EXPECT_EQ(p.flops_recomputed, 0);
  EXPECT_DOUBLE_EQ(q.model_flops + q.flops_recomputed, q.model_flops_recompute);
  TrainerConfig block = gpt(2, false,
                            {.granularity = RecomputeGranularity::full,
                             .method = RecomputeMethod::block,
                             .num_layers = 1});
  EXPECT_DOUBLE_EQ(predict_step(block).flops_recomputed, q.flops_recomputed / 2);
}

// Megatron-LM's rules for the recomputation flags, each refused naming the rule.
TEST(ActivationMemory, RecomputationFlagsFollowMegatronsRules) {
  auto refusal = [](const Recompute& r) {
    TrainerConfig c = gpt(2, false, r);
    try {
      validate(c);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  using G = RecomputeGranularity;
  using M = RecomputeMethod;
  EXPECT_NE(refusal({.granularity = G::full, .num_layers = 1}).find("needs --recompute-method"),
            std::string::npos);
  EXPECT_NE(refusal({.granularity = G::full, .method = M::block}).find("between 1 and"),
            std::string::npos);
  EXPECT_NE(refusal({.granularity = G::full, .method = M::block, .num_layers = 3})
                .find("between 1 and the layers of a pipeline rank (2"),
            std::string::npos);
  EXPECT_NE(refusal({.granularity = G::selective, .num_layers = 1}).find("takes no"),
            std::string::npos);
  EXPECT_NE(refusal({.method = M::uniform}).find("apply with --recompute-granularity full"),
            std::string::npos);
  EXPECT_EQ(refusal({.granularity = G::full, .method = M::uniform, .num_layers = 2}), "accepted");
}

// Megatron-LM's bytes per parameter without the distributed optimizer: 18 (bf16, and fp16 with
// --accumulate-allreduce-grads-in-fp32, as weave trains it), 16 (fp32).
TEST(ActivationMemory, ParameterBytesAreMegatronsTable) {
  EXPECT_EQ(parameter_bytes(Precision::bf16).parameter + parameter_bytes(Precision::bf16).gradient +
                parameter_bytes(Precision::bf16).optimizer_state,
            18);
  EXPECT_EQ(parameter_bytes(Precision::fp16).parameter + parameter_bytes(Precision::fp16).gradient +
                parameter_bytes(Precision::fp16).optimizer_state,
            18);
  EXPECT_EQ(parameter_bytes(Precision::fp32).parameter + parameter_bytes(Precision::fp32).gradient +
                parameter_bytes(Precision::fp32).optimizer_state,
            16);
}

// A prediction counts each category in Megatron-LM's bytes: parameters 2 (bf16, fp16) or 4
// (fp32), gradients 4 (fp32 in every precision), and the optimizer state the distributed
// optimizer shards over the d replicas, 8 (fp32: two moments) or 12 (bf16, fp16: and fp32 master
// weights) per parameter of the shard; activations 2 bytes in 16 bits, but for what a 16-bit run
// keeps in fp32 (4 bytes in either precision) and the output layer's 16-bit logits beside them.
TEST(ActivationMemory, EachCategoryInItsPrecisionsBytes) {
  auto categories = [](Precision precision) {
    TrainerConfig c = gpt(2, true);
    c.model.precision = precision;
    c.plan.data_parallel = 2;
    c.plan.global_batch_size = 2 * static_cast<int>(b);
    c.plan.distributed_optimizer = true;
    return predict_step(c).memory.front();
  };
  const auto fp32 = categories(Precision::fp32), bf16 = categories(Precision::bf16),
             fp16 = categories(Precision::fp16);
  auto at = [](const auto& bytes, rt::MemoryCategory c) {
    return static_cast<double>(bytes[static_cast<std::size_t>(c)]);
  };
  using C = rt::MemoryCategory;
  // Each bucket's tensors are rounded up to a 64-byte line: a few lines apart at most.
  const double line = 64 * 64;
  EXPECT_NEAR(at(bf16, C::parameters), at(fp32, C::parameters) / 2, line);
  EXPECT_NEAR(at(fp16, C::parameters), at(fp32, C::parameters) / 2, line);
  EXPECT_EQ(at(bf16, C::gradients), at(fp32, C::gradients));
  EXPECT_EQ(at(fp16, C::gradients), at(fp32, C::gradients));
  EXPECT_NEAR(at(bf16, C::optimizer_state), at(fp32, C::optimizer_state) * 12 / 8, line);
  EXPECT_NEAR(at(fp16, C::optimizer_state), at(fp32, C::optimizer_state) * 12 / 8, line);
  // The sharded state per parameter: 8/d of the fp32 parameters' 4 bytes.
  EXPECT_NEAR(at(fp32, C::optimizer_state), at(fp32, C::parameters) * 8 / 4 / 2, line);
  // t = 2 with sequence parallelism: the norms' statistics [s/2 b] (two a layer and the final
  // norm's), the attention's log-sum-exp [b, a/2, s], the logits [s b, V/2] and the loss's row
  // figures [s b, 2 + partials].
  const std::int64_t r = s / 2, Vl = V / 2;
  const std::int64_t kept_fp32 = L * (4 * r * b + b * (a / 2) * s) + 2 * r * b + s * b * Vl +
                                 s * b * (2 + ops::kCrossEntropyPartials);
  const std::int64_t logits16 = s * b * Vl;
  for (const auto& half : {bf16, fp16})
    EXPECT_NEAR(at(half, C::activations),
                at(fp32, C::activations) / 2 + 2 * kept_fp32 + 2 * logits16, line);
}

}  // namespace
}  // namespace weave::graphs
