// The modern decoder (RoPE, RMSNorm, SwiGLU, grouped-query attention, no linear biases, an
// untied output layer, attention dropout) under every parallel strategy equals the one-device
// model: loss, aux loss, every gradient and a 10-step loss curve; and its whole-model gradient
// matches a directional difference.
#include <gtest/gtest.h>

#include "step_outcome.hpp"
#include "tiny_model.hpp"

namespace weave::graphs {
namespace {

// A Llama-style model: 4 layers (every second one MoE with experts), 4 query heads sharing 2
// key/value heads.
ModelConfig llama(int experts) {
  ModelConfig m = with_modern_decoder(tiny(experts));
  m.num_layers = 4;
  return m;
}

struct Case {
  const char* name;
  int experts;
  ParallelPlan plan;
};

class ModernDecoder : public ::testing::TestWithParam<Case> {};

TEST_P(ModernDecoder, EqualsOneDevice) {
  expect_equals_one_device(llama(GetParam().experts), GetParam().plan);
}

const Case kCases[] = {
    {"tp2", 0, {.tensor_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}},
    {"tp2_sp",
     0,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .micro_batch_size = 2,
      .global_batch_size = 4}},
    {"dp2", 0, {.data_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}},
    {"cp2", 0, {.context_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}},
    {"cp2_tp2_sp",
     0,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .context_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4}},
    {"moe_tp2_sp_ep2",
     4,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4}},
    {"moe_cp2_ep2_dp2",
     4,
     {.context_parallel = 2,
      .expert_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4}},
    {"moe_dp2_distributed_optimizer",
     4,
     {.data_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4,
      .distributed_optimizer = true}},
    {"pp2_1f1b", 0, {.pipeline_parallel = 2, .micro_batch_size = 1, .global_batch_size = 4}},
    {"pp2_v2_interleaved_moe",
     4,
     {.pipeline_parallel = 2,
      .virtual_pipeline = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4}},
    {"pp2_zb_h1_tp2_sp",
     0,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .pipeline_parallel = 2,
      .pipeline_scheduler = "zb-h1",
      .micro_batch_size = 1,
      .global_batch_size = 4}},
    {"ampipe2_tp2_sp_ep2",
     4,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4,
      .ampipe_degree = 2}},
    {"ampipe2_cp2_ep2",
     4,
     {.context_parallel = 2,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4,
      .ampipe_degree = 2}},
    {"ampipe2_split_experts_overlap",
     4,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .expert_tensor_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4,
      .ampipe_degree = 2,
      .ampipe_tp_sp_comm_overlap = true}},
};

INSTANTIATE_TEST_SUITE_P(Plans, ModernDecoder, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// Multi-query attention (one key/value head for every query head), partial rotary dimensions
// and learned positions off without RoPE: each alone against one device.
TEST(ModernDecoder, MultiQueryAttentionUnderContextParallelism) {
  ModelConfig m = llama(0);
  m.num_query_groups = 1;
  m.rotary_percent = 0.5;
  expect_equals_one_device(m,
                           {.context_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4});
}

TEST(ModernDecoder, NoPositionEmbeddingUnderTensorAndSequenceParallelism) {
  ModelConfig m = llama(0);
  m.position_embedding = PositionEmbedding::none;
  m.normalization = Normalization::layer_norm;
  m.add_bias_linear = true;
  expect_equals_one_device(m, {.tensor_parallel = 2,
                               .sequence_parallel = true,
                               .micro_batch_size = 2,
                               .global_batch_size = 4});
}

TEST(ModernDecoder, HoldsOnlyTheParametersItUses) {
  const ModelConfig m = llama(4);
  ParallelPlan plan{.micro_batch_size = 1, .global_batch_size = 1};
  const Outcome o = run(m, plan, 1, false);
  for (const auto& [name, grad] : o.grads) {
    EXPECT_EQ(name.find("bias"), std::string::npos) << name;  // RMSNorm, no linear biases
    EXPECT_NE(name, "embedding.position");                    // RoPE
  }
  ASSERT_TRUE(o.grads.contains("output.weight"));  // untied
  // QKV rows: 4 query heads and 2 key and 2 value heads of 8 dimensions.
  EXPECT_EQ(o.grads.at("layers.0.attention.qkv.weight").size(), std::size_t{(4 + 2 * 2) * 8 * 32});
}

// Each feature alone on the dense GPT, then all of them, dense and MoE: catches a backward wired
// wrongly in RoPE, grouped heads, RMSNorm, attention dropout or the untied output, which the
// one-device comparisons above would share.
TEST(ModernDecoder, WholeModelGradientMatchesADirectionalDifference) {
  const std::pair<const char*, void (*)(ModelConfig&)> features[] = {
      {"rope", [](ModelConfig& m) { m.position_embedding = PositionEmbedding::rope; }},
      {"rms_norm", [](ModelConfig& m) { m.normalization = Normalization::rms_norm; }},
      {"grouped_query_attention", [](ModelConfig& m) { m.num_query_groups = 2; }},
      {"untied_output", [](ModelConfig& m) { m.untie_embeddings_and_output_weights = true; }},
      {"no_bias", [](ModelConfig& m) { m.add_bias_linear = false; }},
      {"attention_dropout", [](ModelConfig& m) { m.attention_dropout = 0.1; }},
      {"all", [](ModelConfig& m) { m = llama(0); }},
      // Every token to every expert: no top-k choice flips along the difference.
      {"all_moe",
       [](ModelConfig& m) {
         m = llama(4);
         m.moe_router_topk = 4;
       }},
  };
  const ParallelPlan plan{.tensor_parallel = 2,
                          .sequence_parallel = true,
                          .micro_batch_size = 2,
                          .global_batch_size = 4};
  for (const auto& [name, apply] : features) {
    ModelConfig m = tiny(0);
    apply(m);
    m.hidden_dropout = 0;
    const auto [along, numeric] = directional_derivative(m, plan);
    EXPECT_NEAR(along, numeric, 2e-2 * std::abs(numeric))
        << name << ": analytic " << along << ", numeric " << numeric;
  }
}

}  // namespace
}  // namespace weave::graphs
