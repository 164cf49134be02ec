// --kv-channels (Megatron-LM's kv_channels): attention heads of their own width, the queries
// heads x kv_channels wide and the keys and values groups x kv_channels, wider or narrower than
// the hidden size (Qwen3-235B-A22B's 64 heads of 128 over a hidden size of 4096). With grouped-
// query attention, RoPE and QK-norm, such a model under tensor (+ sequence, + the tp overlap),
// context, pipeline and Ampipe parallelism equals one device (in bf16 within its roundings); its
// gradient matches a directional difference; decoding gives the training step's loss; the
// prediction equals the step built with tensors; a checkpoint records the width; the rules refuse
// what cannot run; and the width hidden / heads given is the run without the flag, bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <string>

#include <fmt/format.h>
#include <unistd.h>

#include "decoder.hpp"
#include "half_precision_equivalence.hpp"
#include "materialised_step.hpp"
#include "step_outcome.hpp"
#include "tiny_model.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/checkpoint.hpp"
#include "weave/graphs/prediction.hpp"
#include "weave/graphs/virtual_replay.hpp"

namespace weave::graphs {
namespace {

// hidden 32 and 4 heads (8 wide without the flag), 2 key/value groups, RoPE and QK-norm: 16 wide
// makes the queries 64 wide, twice the hidden size, as Qwen3's are; 6 wide makes them 24, less
// than it. The wide model is Qwen3's decoder (RMSNorm, SwiGLU, no biases); the narrow one keeps
// GPT's LayerNorm and biases, so the QKV and projection biases and the norms' biases are of the
// new widths too.
ModelConfig kv_model(int kv_channels, int experts = 0) {
  ModelConfig m = tiny(experts);
  m.kv_channels = kv_channels;
  m.position_embedding = PositionEmbedding::rope;
  m.qk_layernorm = true;
  m.num_query_groups = 2;
  if (kv_channels > 8) {
    m.normalization = Normalization::rms_norm;
    m.activation = Activation::swiglu;
    m.add_bias_linear = false;
  }
  return m;
}

constexpr int kWide = 16, kNarrow = 6;

struct Case {
  const char* name;
  int kv_channels;
  int experts;
  ParallelPlan plan;
};

class KvChannels : public ::testing::TestWithParam<Case> {};

TEST_P(KvChannels, EqualsOneDevice) {
  expect_equals_one_device(kv_model(GetParam().kv_channels, GetParam().experts), GetParam().plan);
}

const Case kCases[] = {
    {"tp2_sp_wide",
     kWide,
     0,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .micro_batch_size = 2,
      .global_batch_size = 4}},
    {"tp2_narrow",
     kNarrow,
     0,
     {.tensor_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}},
    // The projections in pieces of rows, each piece's product as wide as the heads make it.
    {"tp2_sp_overlap_wide",
     kWide,
     0,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .micro_batch_size = 2,
      .global_batch_size = 4,
      .tp_comm_overlap = true}},
    {"cp2_wide", kWide, 0, {.context_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}},
    {"cp2_narrow",
     kNarrow,
     0,
     {.context_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}},
    {"pp2_wide", kWide, 0, {.pipeline_parallel = 2, .micro_batch_size = 1, .global_batch_size = 4}},
    {"pp2_tp2_narrow",
     kNarrow,
     0,
     {.tensor_parallel = 2, .pipeline_parallel = 2, .micro_batch_size = 1, .global_batch_size = 4}},
    // Zero-bubble H1: the projection's and QKV's output gradients kept for the W actions.
    {"pp2_zb_h1_tp2_sp_narrow",
     kNarrow,
     0,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .pipeline_parallel = 2,
      .pipeline_scheduler = "zb-h1",
      .micro_batch_size = 1,
      .global_batch_size = 4}},
    {"ampipe2_tp2_sp_ep2_wide",
     kWide,
     4,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4,
      .ampipe_degree = 2}},
    {"ampipe2_cp2_ep2_narrow",
     kNarrow,
     4,
     {.context_parallel = 2,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4,
      .ampipe_degree = 2}},
};

INSTANTIATE_TEST_SUITE_P(Plans, KvChannels, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// In bf16 the heads' products, their rounded context and its gradients take the width too: tp2
// + sp and pp2 (zero-bubble H1, whose split backward keeps the projection's and QKV's output
// gradients for W) equal one device within the tensor- and pipeline-parallel bounds
// bf16_training_test derives and checks for its Llama model with QK-norms (hidden 64, 4 heads of
// 16; sqrt(9) u of the gradients, 1e-3 of the first loss, 1e-2 of the later ones): here that
// model's heads 32 wide (queries twice the hidden size) and 12 wide (48 of 64).
TEST(KvChannels, Bf16EqualsOneDevice) {
  const ParallelTolerance tolerance{1e-3, 3.0 / 256, 1e-2};
  for (const int kv : {32, 12}) {
    SCOPED_TRACE(kv);
    ModelConfig m = in(llama(), Precision::bf16);
    m.qk_layernorm = true;
    m.kv_channels = kv;
    expect_equals_one_device_of_its_batches(m,
                                            {.tensor_parallel = 2,
                                             .sequence_parallel = true,
                                             .micro_batch_size = 2,
                                             .global_batch_size = 4},
                                            tolerance);
    expect_equals_one_device_of_its_batches(m,
                                            {.pipeline_parallel = 2,
                                             .pipeline_scheduler = "zb-h1",
                                             .micro_batch_size = 1,
                                             .global_batch_size = 4},
                                            tolerance);
  }
}

// The QKV weight maps h to (heads + 2 groups) x kv_channels, the output projection heads x
// kv_channels back to h, the QK-norms are kv_channels wide: the widths Megatron-Core's
// linear_qkv and linear_proj take.
TEST(KvChannels, TheProjectionsTakeMegatronsWidths) {
  const ParallelPlan plan{.micro_batch_size = 1, .global_batch_size = 1};
  for (const int kv : {kWide, kNarrow}) {
    SCOPED_TRACE(kv);
    const ModelConfig m = kv_model(kv);
    const Outcome o = run(m, plan, 1, false);
    const std::size_t h = 32, heads = 4, groups = 2, d = static_cast<std::size_t>(kv);
    EXPECT_EQ(o.grads.at("layers.0.attention.qkv.weight").size(), (heads + 2 * groups) * d * h);
    EXPECT_EQ(o.grads.at("layers.1.attention.proj.weight").size(), h * heads * d);
    EXPECT_EQ(o.grads.at("layers.0.attention.q_norm.weight").size(), d);
    if (m.add_bias_linear) {
      EXPECT_EQ(o.grads.at("layers.0.attention.qkv.bias").size(), (heads + 2 * groups) * d);
      EXPECT_EQ(o.grads.at("layers.0.attention.proj.bias").size(), h);
    }
  }
}

// The whole model's gradient along a random direction against a central difference of the loss,
// on one device and split over tp (+ sp) and cp.
TEST(KvChannels, WholeModelGradientMatchesADirectionalDifference) {
  const ParallelPlan plans[] = {
      {.micro_batch_size = 2, .global_batch_size = 4},
      {.tensor_parallel = 2,
       .sequence_parallel = true,
       .micro_batch_size = 2,
       .global_batch_size = 4},
      {.context_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}};
  for (const int kv : {kWide, kNarrow})
    for (const ParallelPlan& plan : plans) {
      SCOPED_TRACE(fmt::format("kv_channels {}, tp {}, cp {}", kv, plan.tensor_parallel,
                               plan.context_parallel));
      ModelConfig m = kv_model(kv);
      m.hidden_dropout = 0;
      const auto [along, numeric] = directional_derivative(m, plan);
      EXPECT_NEAR(along, numeric, 2e-2 * std::abs(numeric))
          << "analytic " << along << ", numeric " << numeric;
    }
}

// Fed the training step's sequence token by token (its keys and values cached kv_channels wide),
// decoding gives the step's loss; split over tp and pipeline stages, the one device's logits.
TEST(KvChannels, DecodingGivesTheStepsLossAndTheOneDeviceLogits) {
  for (const int kv : {kWide, kNarrow}) {
    SCOPED_TRACE(kv);
    const ModelConfig m = without_dropout(kv_model(kv, 4));
    expect_decoding_gives_the_steps_loss(m);
    Decoder one(m, {.micro_batch_size = 1, .global_batch_size = 1});
    Decoder split(m, {.tensor_parallel = 2, .pipeline_parallel = 2, .global_batch_size = 2});
    for (int s = 0; s < 12; ++s) {
      const std::int32_t t = token(3, s, m.vocab_size);
      const std::vector<float> a = one.generator.feed(t), b = split.generator.feed(t);
      ASSERT_EQ(a.size(), b.size());
      for (std::size_t i = 0; i < a.size(); ++i)
        ASSERT_NEAR(b[i], a[i], 1e-4 * (1 + std::abs(a[i]))) << "position " << s << " token " << i;
    }
  }
}

// --kv-channels equal to hidden / heads is the model without it: the same losses and gradients,
// bit for bit, under tp + sp and cp.
TEST(KvChannels, HiddenOverHeadsIsBitwiseTheRunWithoutIt) {
  for (const ParallelPlan& plan :
       {ParallelPlan{.tensor_parallel = 2,
       .sequence_parallel = true,
       .micro_batch_size = 2,
       .global_batch_size = 4},
        ParallelPlan{.context_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}}) {
    const ModelConfig unset = kv_model(0);
    ModelConfig given = unset;
    given.kv_channels = unset.hidden_size / unset.num_attention_heads;
    const Outcome a = run(unset, plan, 3, true), b = run(given, plan, 3, true);
    EXPECT_EQ(a.losses, b.losses);
    EXPECT_EQ(a.grads, b.grads);
  }
}

// Device 0's compute tasks' costs by name, of a step built with tensors or without.
std::map<std::string, rt::CostHint> device0_costs(const ModelConfig& m, const ParallelPlan& plan,
                                                  bool materialize) {
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  const TrainingStep step(m, plan, {}, set, comm, {.materialize = materialize});
  std::map<std::string, rt::CostHint> costs;
  const rt::TaskTable& tasks = step.graph().tasks();
  for (rt::TaskId t = 0; t < tasks.size(); ++t)
    if (tasks[t].device == 0 && tasks[t].kind == rt::TaskKind::compute)
      costs[std::string(tasks.name(t))] = tasks[t].cost;
  return costs;
}

bool same_cost(const rt::CostHint& a, const rt::CostHint& b) {
  return a.flops == b.flops && a.bytes == b.bytes && a.messages == b.messages &&
         a.attention_flops == b.attention_flops && a.matmul_edges == b.matmul_edges;
}

// The step's tasks price the attention at the heads' width: the QKV product [S B, h] x [h,
// (Hl + 2 Gl) d], the projection [S B, Hl d] x [Hl d, h] and the causal core attention over d
// per head; the step built without tensors (what weave predict replays) carries the same costs.
TEST(KvChannels, TheStepsTasksPriceTheHeadsWidth) {
  ParallelPlan plan{.tensor_parallel = 2, .micro_batch_size = 2, .global_batch_size = 2};
  for (const int kv : {kWide, kNarrow}) {
    SCOPED_TRACE(kv);
    ModelConfig m = kv_model(kv);
    m.qk_layernorm = false;  // the QKV task's cost is then the product's alone
    validate(m, plan);
    const auto with = device0_costs(m, plan, true), without = device0_costs(m, plan, false);
    ASSERT_EQ(with.size(), without.size());
    for (const auto& [name, cost] : with)
      EXPECT_TRUE(same_cost(cost, without.at(name))) << name;
    const double rows = 16 * 2, h = 32, Hl = 2, Gl = 1, d = kv, S = 16, B = 2;
    EXPECT_DOUBLE_EQ(with.at("L0.qkv").flops, 2 * rows * h * (Hl + 2 * Gl) * d);
    // Causal: half of the S^2 pairs, QK^T and PV, 2 FLOPs a multiply-add.
    const double core = 2 * 2 * B * Hl * S * S * d * 0.5;
    EXPECT_DOUBLE_EQ(with.at("L0.attention").attention_flops, static_cast<float>(core));
    EXPECT_DOUBLE_EQ(with.at("L0.attention").flops, core + 2 * rows * Hl * d * h);
  }
}

// The prediction replays the step it predicts: the same time as the step built with tensors for
// both widths under tp + sp, pp and ep and under cp with the distributed optimizer, in fp32 and
// bf16, and in fp32 every device's memory by category too (a bf16 step built with tensors holds
// some values in fp32 buffers that the prediction counts at 2 bytes: bf16_shared_experts_test).
TEST(KvChannels, PredictionEqualsTheMaterialisedStep) {
  const ParallelPlan plans[] = {{.tensor_parallel = 2,
                                 .sequence_parallel = true,
                                 .expert_parallel = 2,
                                 .pipeline_parallel = 2,
                                 .micro_batch_size = 1,
                                 .global_batch_size = 4},
                                {.context_parallel = 2,
                                 .data_parallel = 2,
                                 .micro_batch_size = 1,
                                 .global_batch_size = 4,
                                 .distributed_optimizer = true}};
  for (const int kv : {kWide, kNarrow})
    for (const ParallelPlan& plan : plans)
      for (const Precision precision : {Precision::fp32, Precision::bf16}) {
        SCOPED_TRACE(fmt::format("kv_channels {}, cp {}, {}", kv, plan.context_parallel,
                                 precision_name(precision)));
        TrainerConfig c;
        c.model = kv_model(kv, 4);
        c.model.precision = precision;
        c.plan = plan;
        c.machine = {.device_flops = 1e12, .device_memory_bandwidth = 1e11, .link = "nvlink4"};
        const Prediction p = predict_step(c);
        const MaterialisedStep r = materialised_step(c);
        EXPECT_DOUBLE_EQ(p.step_ms, static_cast<double>(r.replay.makespan) * 1e-6);
        if (precision == Precision::fp32) EXPECT_EQ(p.memory, r.memory);
      }
}

// Wider heads hold more: the prediction's activations grow with kv_channels and its parameters
// (fp32, 4 bytes each) by the projections' and norms' extra width.
TEST(KvChannels, PredictedMemoryGrowsWithTheHeadsWidth) {
  TrainerConfig c;
  c.model = kv_model(0);
  c.plan = {.micro_batch_size = 1, .global_batch_size = 1};
  c.machine = {.device_flops = 1e12, .device_memory_bandwidth = 1e11, .link = "nvlink4"};
  const Prediction narrow = predict_step(c);
  c.model.kv_channels = kWide;
  const Prediction wide = predict_step(c);
  const auto parameters = static_cast<std::size_t>(rt::MemoryCategory::parameters);
  const auto activations = static_cast<std::size_t>(rt::MemoryCategory::activations);
  // Per layer, d from 8 to 16: the QKV weight's (heads + 2 groups) d h and its bias's 8 d, the
  // projection's heads d h, the QK-norms' weights and biases 2 x 2 d.
  const double h = 32, L = 2, extra_d = kWide - 8;
  const double extra = L * (8 * extra_d * h + 8 * extra_d + 4 * extra_d * h + 4 * extra_d);
  EXPECT_EQ(wide.memory[0][parameters] - narrow.memory[0][parameters],
            static_cast<std::int64_t>(4 * extra));
  EXPECT_GT(wide.memory[0][activations], narrow.memory[0][activations]);
}

// Megatron-LM's count of a layer's attention FLOPs takes the queries heads x kv_channels wide
// and the keys and values groups x kv_channels (num_floating_point_operations'
// query_projection_size and key/value_projection_size): per token forward 2 h (heads + 2 groups)
// d for QKV, 2 heads d h for the projection and 4 s heads d for the scores and their product.
TEST(KvChannels, ModelFlopsCountTheHeadsWidth) {
  const ParallelPlan plan{.micro_batch_size = 2, .global_batch_size = 8};
  const ModelConfig unset = kv_model(0);
  ModelConfig wide = unset;
  wide.kv_channels = kWide;
  const double h = 32, heads = 4, groups = 2, s = 16, L = 2, tokens = 8 * s, extra_d = kWide - 8;
  const double per_token_layer =
      2 * h * (heads + 2 * groups) * extra_d + 2 * heads * extra_d * h + 4 * s * heads * extra_d;
  const double flops = model_flops_per_step(unset, plan, false);
  EXPECT_NEAR(model_flops_per_step(wide, plan, false) - flops, tokens * 3 * L * per_token_layer,
              1e-9 * flops);
}

std::string temp_path(const char* name) {
  return (std::filesystem::temp_directory_path() / fmt::format("weave-{}-{}", ::getpid(), name))
      .string();
}

// A checkpoint records each head's width: it reads back as given (and hidden / heads as unset),
// and loading it into a model of another width is refused, naming kv_channels.
TEST(KvChannels, ACheckpointRefusesAnotherWidthByName) {
  ParallelPlan plan{.micro_batch_size = 1, .global_batch_size = 1};
  const std::string path = temp_path("kv-channels.ckpt");
  const ModelConfig wide = kv_model(kWide);
  devices::DeviceSet set(1, {.pin = false});
  devices::SharedMemoryCommunicator comm;
  validate(wide, plan);
  TrainingStep step(wide, plan, {}, set, comm);
  save_checkpoint(path, wide, plan, step, {.iteration = 1});
  EXPECT_EQ(read_checkpoint_config(path).model.kv_channels, kWide);
  EXPECT_NO_THROW(load_checkpoint(path, wide, plan, step));
  const std::pair<int, std::string> others[] = {
      {0, "kv_channels is 16 in the checkpoint but 8 now"},
      {kNarrow, "kv_channels is 16 in the checkpoint but 6 now"}};
  for (const auto& [kv, message] : others) {
    ModelConfig other = wide;
    other.kv_channels = kv;
    devices::DeviceSet other_set(1, {.pin = false});
    TrainingStep other_step(other, plan, {}, other_set, comm);
    try {
      load_checkpoint(path, other, plan, other_step);
      ADD_FAILURE() << "a checkpoint of " << kWide << "-wide heads loaded into " << kv;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
  // hidden / heads given reads back as unset: the model that leaves the flag out.
  ModelConfig eight = wide;
  eight.kv_channels = 8;
  devices::DeviceSet eight_set(1, {.pin = false});
  TrainingStep eight_step(eight, plan, {}, eight_set, comm);
  save_checkpoint(path, eight, plan, eight_step, {.iteration = 1});
  EXPECT_EQ(read_checkpoint_config(path).model.kv_channels, 0);
  std::filesystem::remove(path);
}

std::string refusal(const ModelConfig& m, ParallelPlan plan) {
  try {
    validate(m, plan);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "accepted";
}

// The rules: a width of at least 1; RoPE needs 2 dimensions to rotate; the heads split whole over
// tp; and with the flag the hidden size need not divide by the heads (Megatron-LM asks for that
// only when it derives the width), without it it must.
TEST(KvChannels, TheRulesRefuseNamingTheFlagAndTheFix) {
  const ParallelPlan one{.micro_batch_size = 1, .global_batch_size = 1};
  ModelConfig m = kv_model(kWide);
  m.kv_channels = -2;
  EXPECT_NE(refusal(m, one).find("--kv-channels must be >= 1"), std::string::npos)
      << refusal(m, one);
  m.kv_channels = 1;
  EXPECT_NE(refusal(m, one).find("rotates 0: RoPE needs at least 2 (raise --rotary-percent or "
                                 "--kv-channels)"),
            std::string::npos)
      << refusal(m, one);
  m.position_embedding = PositionEmbedding::learned_absolute;  // no rotation: 1 wide is a head
  EXPECT_EQ(refusal(m, one), "accepted");
  m = kv_model(kWide);
  m.num_attention_heads = 6;
  m.num_query_groups = 3;
  const ParallelPlan tp4{.tensor_parallel = 4, .micro_batch_size = 1, .global_batch_size = 1};
  EXPECT_NE(refusal(m, tp4).find(
                "--num-attention-heads (6) must be divisible by --tensor-model-parallel-size (4)"),
            std::string::npos)
      << refusal(m, tp4);
  // 32 / 6 does not divide: refused without the flag, naming it as the fix; accepted with it.
  EXPECT_EQ(refusal(m, one), "accepted");
  m.kv_channels = 0;
  EXPECT_NE(refusal(m, one).find("Give --kv-channels"), std::string::npos) << refusal(m, one);
}

// The odd-sized heads of 6 of a hidden size heads do not divide train like any other: 6 heads of
// 6 over 32 under tp2 equal one device.
TEST(KvChannels, HeadsThatDoNotDivideTheHiddenSizeEqualOneDevice) {
  ModelConfig m = kv_model(kNarrow);
  m.num_attention_heads = 6;
  m.num_query_groups = 2;
  expect_equals_one_device(m,
                           {.tensor_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4});
}

}  // namespace
}  // namespace weave::graphs
