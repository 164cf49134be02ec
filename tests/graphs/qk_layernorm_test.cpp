// --qk-layernorm (a norm on each head's queries and keys before attention, as Qwen3 uses) under
// every strategy that runs attention equals the one-device model: loss, every gradient (the
// norms' weights summed over the ranks that normalise other heads or tokens) and a 10-step loss
// curve; decoding with it gives the training step's loss and the same logits split any way; and
// its gradient matches a directional difference.
#include <gtest/gtest.h>

#include <cmath>

#include "decoder.hpp"
#include "step_outcome.hpp"
#include "tiny_model.hpp"
#include "weave/graphs/generator.hpp"

namespace weave::graphs {
namespace {

// A Qwen3-style model: RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases, every second
// layer MoE when `experts` > 0; or the GPT (LayerNorm with biases, learned positions).
ModelConfig qk_model(int experts, Normalization norm) {
  ModelConfig m = tiny(experts);
  m.num_layers = 4;
  m.qk_layernorm = true;
  m.normalization = norm;
  if (norm == Normalization::rms_norm) {
    m.activation = Activation::swiglu;
    m.position_embedding = PositionEmbedding::rope;
    m.num_query_groups = 2;
    m.add_bias_linear = false;
  }
  return m;
}

struct Case {
  const char* name;
  int experts;
  Normalization norm;
  ParallelPlan plan;
};

class QkLayerNorm : public ::testing::TestWithParam<Case> {};

TEST_P(QkLayerNorm, EqualsOneDevice) {
  expect_equals_one_device(qk_model(GetParam().experts, GetParam().norm), GetParam().plan);
}

const Case kCases[] = {
    {"tp2_sp_rms",
     0,
     Normalization::rms_norm,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .micro_batch_size = 2,
      .global_batch_size = 4}},
    // Without SP the norms' weights are the only replicated attention parameters summed over tp.
    {"tp2_layer_norm",
     0,
     Normalization::layer_norm,
     {.tensor_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}},
    {"cp2_rms",
     0,
     Normalization::rms_norm,
     {.context_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}},
    {"cp2_layer_norm",
     0,
     Normalization::layer_norm,
     {.context_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}},
    {"ampipe2_tp2_sp_ep2",
     4,
     Normalization::rms_norm,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4,
      .ampipe_degree = 2}},
    {"ampipe2_cp2_ep2",
     4,
     Normalization::rms_norm,
     {.context_parallel = 2,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4,
      .ampipe_degree = 2}},
    {"pp2_1f1b",
     0,
     Normalization::rms_norm,
     {.pipeline_parallel = 2, .micro_batch_size = 1, .global_batch_size = 4}},
    {"pp2_zb_h1_tp2_sp",
     0,
     Normalization::layer_norm,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .pipeline_parallel = 2,
      .pipeline_scheduler = "zb-h1",
      .micro_batch_size = 1,
      .global_batch_size = 4}},
};

INSTANTIATE_TEST_SUITE_P(Plans, QkLayerNorm, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// A weight of head_dim per layer for the queries and one for the keys, a bias each only with
// LayerNorm; without the flag none, and another loss.
TEST(QkLayerNorm, HoldsOneNormOfHeadDimensionForQueriesAndOneForKeys) {
  const ParallelPlan plan{.micro_batch_size = 1, .global_batch_size = 1};
  for (const Normalization norm : {Normalization::rms_norm, Normalization::layer_norm}) {
    ModelConfig m = qk_model(0, norm);
    const Outcome o = run(m, plan, 1, false);
    const std::size_t d = static_cast<std::size_t>(m.head_dim());
    for (const char* name :
         {"layers.0.attention.q_norm.weight", "layers.3.attention.k_norm.weight"})
      ASSERT_EQ(o.grads.at(name).size(), d) << name;
    EXPECT_EQ(o.grads.contains("layers.0.attention.k_norm.bias"),
              norm == Normalization::layer_norm);
    m.qk_layernorm = false;
    const Outcome without = run(m, plan, 1, false);
    EXPECT_FALSE(without.grads.contains("layers.0.attention.q_norm.weight"));
    EXPECT_NE(without.losses[0], o.losses[0]);  // the norms change what attention sees
  }
}

// The norms' backward against a central difference of the loss, alone on the GPT and with the
// Qwen3-style model, under tp2 + sp (so the weights' gradients are summed over tp).
TEST(QkLayerNorm, WholeModelGradientMatchesADirectionalDifference) {
  const ParallelPlan plan{.tensor_parallel = 2,
                          .sequence_parallel = true,
                          .micro_batch_size = 2,
                          .global_batch_size = 4};
  for (const Normalization norm : {Normalization::layer_norm, Normalization::rms_norm}) {
    ModelConfig m = qk_model(0, norm);
    m.hidden_dropout = 0;
    const auto [along, numeric] = directional_derivative(m, plan);
    EXPECT_NEAR(along, numeric, 2e-2 * std::abs(numeric))
        << "analytic " << along << ", numeric " << numeric;
  }
}

// Fed the training step's sequence token by token, decoding gives its loss.
TEST(QkLayerNorm, DecodingGivesTheTrainingStepsLoss) {
  for (const Normalization norm : {Normalization::layer_norm, Normalization::rms_norm}) {
    expect_decoding_gives_the_steps_loss(without_dropout(qk_model(4, norm)));
  }
}

// Decoding split over tp (each rank normalising its own heads) and pipeline stages gives the
// one-device logits.
TEST(QkLayerNorm, DecodingSplitAnyWayGivesTheOneDeviceLogits) {
  const ModelConfig m = without_dropout(qk_model(4, Normalization::rms_norm));
  Decoder one(m, {.micro_batch_size = 1, .global_batch_size = 1});
  for (const ParallelPlan& plan :
       {ParallelPlan{.tensor_parallel = 2, .sequence_parallel = true, .expert_parallel = 2},
        ParallelPlan{.tensor_parallel = 2, .pipeline_parallel = 2, .global_batch_size = 2}}) {
    Decoder split(m, plan);
    one.generator.reset();
    for (int s = 0; s < 12; ++s) {
      const std::int32_t t = token(3, s, m.vocab_size);
      const std::vector<float> a = one.generator.feed(t), b = split.generator.feed(t);
      ASSERT_EQ(a.size(), b.size());
      for (std::size_t i = 0; i < a.size(); ++i)
        ASSERT_NEAR(b[i], a[i], 1e-4 * (1 + std::abs(a[i]))) << "position " << s << " token " << i;
    }
  }
}

}  // namespace
}  // namespace weave::graphs
