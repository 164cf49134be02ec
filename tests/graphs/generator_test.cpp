// Decoding with a key/value cache: fed a sequence token by token it gives the training step's
// loss; under every parallel layout it gives the one-device logits; a checkpoint's saved
// configuration reads back; bad requests are refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <vector>

#include "decoder.hpp"
#include "tiny_model.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/checkpoint.hpp"
#include "weave/graphs/generator.hpp"
#include "weave/graphs/moe_layer_freq.hpp"

namespace weave::graphs {
namespace {

// A Llama-style model (RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases, untied).
ModelConfig llama(int experts) {
  ModelConfig m = tiny(experts);
  m.num_layers = 4;
  m.activation = Activation::swiglu;
  m.position_embedding = PositionEmbedding::rope;
  m.normalization = Normalization::rms_norm;
  m.num_query_groups = 2;
  m.untie_embeddings_and_output_weights = true;
  m.add_bias_linear = false;
  return without_dropout(m);
}

class KeyValueCache : public ::testing::TestWithParam<int> {};

// DeepSeek-V3's shapes on the Llama-style model: a dense first layer, experts of their own width.
ModelConfig dense_first_narrow_experts() {
  ModelConfig m = llama(4);
  m.moe_ffn_hidden_size = 32;
  set_moe_layer_freq(m, "([0]*1+[1]*3)");
  return m;
}

TEST_P(KeyValueCache, DecodingTokenByTokenGivesTheTrainingStepsLoss) {
  std::vector<ModelConfig> models{without_dropout(tiny(GetParam())), llama(GetParam())};
  if (GetParam() > 0) models.push_back(dense_first_narrow_experts());
  for (const ModelConfig& m : models)
    expect_decoding_gives_the_steps_loss(m);
}

INSTANTIATE_TEST_SUITE_P(DenseAndMoe, KeyValueCache, ::testing::Values(0, 4));

struct Layout {
  const char* name;
  int experts;
  ParallelPlan plan;
};

class GeneratorLayouts : public ::testing::TestWithParam<Layout> {};

// The same model split any way decodes the same logits, and samples the same tokens.
TEST_P(GeneratorLayouts, EqualOneDevice) {
  const Layout c = GetParam();
  const ModelConfig m = llama(c.experts);
  Decoder one(m, {.micro_batch_size = 1, .global_batch_size = 1});
  ParallelPlan plan = c.plan;
  plan.micro_batch_size = 1;
  plan.global_batch_size = plan.data_parallel * plan.pipeline_parallel;
  Decoder split(m, plan);
  for (int s = 0; s < 12; ++s) {
    const std::int32_t t = token(3, s, m.vocab_size);
    const std::vector<float> a = one.generator.feed(t), b = split.generator.feed(t);
    ASSERT_EQ(a.size(), b.size());
    for (std::size_t i = 0; i < a.size(); ++i)
      ASSERT_NEAR(b[i], a[i], 1e-4 * (1 + std::abs(a[i]))) << "position " << s << " token " << i;
  }
  const std::vector<std::int32_t> prompt{token(4, 0, m.vocab_size), token(4, 1, m.vocab_size)};
  const SamplingOptions sampling{.max_new_tokens = 10, .temperature = 0.8, .top_k = 20};
  EXPECT_EQ(split.generator.generate(prompt, sampling), one.generator.generate(prompt, sampling));
}

const Layout kLayouts[] = {
    {"tp2", 0, {.tensor_parallel = 2}},
    {"tp2_sp_ep2_moe", 4, {.tensor_parallel = 2, .sequence_parallel = true, .expert_parallel = 2}},
    {"ep2_dp2_moe", 4, {.expert_parallel = 2, .data_parallel = 2}},
    {"split_experts_tp2_ep2_dp2",
     4,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .expert_tensor_parallel = 2,
      .data_parallel = 2}},
    {"cp2_ep2_moe", 4, {.context_parallel = 2, .expert_parallel = 2}},
    {"pp2", 0, {.pipeline_parallel = 2}},
    {"pp2_v2_tp2_moe", 4, {.tensor_parallel = 2, .pipeline_parallel = 2, .virtual_pipeline = 2}},
    {"pp2_zb_v", 0, {.pipeline_parallel = 2, .pipeline_scheduler = "zb-v"}},
};

INSTANTIATE_TEST_SUITE_P(Plans, GeneratorLayouts, ::testing::ValuesIn(kLayouts),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(Generator, ACheckpointNamesTheModelAndLayoutItWasSavedWith) {
  const ModelConfig m = llama(4);
  ParallelPlan plan{.tensor_parallel = 2,
                    .expert_parallel = 2,
                    .data_parallel = 1,
                    .pipeline_parallel = 2,
                    .virtual_pipeline = 2,
                    .pipeline_scheduler = "interleaved",
                    .micro_batch_size = 1,
                    .global_batch_size = 2};
  Decoder d(m, plan);
  const std::string path =
      (std::filesystem::temp_directory_path() / "weave_generator_test.ckpt").string();
  save_checkpoint(path, m, d.plan, d.step, {.iteration = 7, .consumed_samples = 14});
  const SavedConfiguration saved = read_checkpoint_config(path);
  std::filesystem::remove(path);
  EXPECT_EQ(saved.state.iteration, 7);
  EXPECT_EQ(saved.processes, 1);
  EXPECT_EQ(saved.model.num_layers, m.num_layers);
  EXPECT_EQ(saved.model.position_embedding, PositionEmbedding::rope);
  EXPECT_EQ(saved.model.normalization, Normalization::rms_norm);
  EXPECT_EQ(saved.model.num_query_groups, 2);
  EXPECT_TRUE(saved.model.untie_embeddings_and_output_weights);
  EXPECT_FALSE(saved.model.add_bias_linear);
  EXPECT_EQ(saved.model.activation, Activation::swiglu);
  EXPECT_EQ(saved.model.num_experts, 4);
  EXPECT_EQ(saved.model.moe_router_topk, m.moe_router_topk);
  EXPECT_EQ(saved.plan.tensor_parallel, 2);
  EXPECT_EQ(saved.plan.expert_parallel, 2);
  EXPECT_EQ(saved.plan.pipeline_parallel, 2);
  EXPECT_EQ(saved.plan.virtual_pipeline, 2);
  EXPECT_EQ(saved.plan.pipeline_scheduler, "interleaved");
}

// Megatron-Core's sinkhorn router balances the picks in training only: decoding, it takes the
// top-k of the softmax scores and weighs them unrenormalised. A checkpoint keeps the
// load-balancing type (an older one reads as aux_loss), so the model read back from a sinkhorn
// run's checkpoint decodes what the run's model does, not with the renormalised softmax.
TEST(Generator, ACheckpointKeepsTheLoadBalancingTypeItsRouterDecodesBy) {
  ModelConfig m = without_dropout(tiny(4));
  m.moe_aux_loss_coeff = 0;  // Megatron-Core's sinkhorn takes no balancing loss
  m.moe_load_balancing = MoeLoadBalancing::sinkhorn;
  const ParallelPlan plan{.micro_batch_size = 1, .global_batch_size = 1};
  Decoder trained(m, plan);
  const std::string path =
      (std::filesystem::temp_directory_path() / "weave_generator_sinkhorn_test.ckpt").string();
  save_checkpoint(path, m, trained.plan, trained.step, {.iteration = 1, .consumed_samples = 1});
  const SavedConfiguration saved = read_checkpoint_config(path);
  ASSERT_EQ(saved.model.moe_load_balancing, MoeLoadBalancing::sinkhorn);
  Decoder loaded(saved.model, plan);
  load_checkpoint(path, saved.model, loaded.plan, loaded.step);
  std::filesystem::remove(path);
  // The same parameters (the same seed) under the default router: other logits.
  ModelConfig renormalised = m;
  renormalised.moe_load_balancing = MoeLoadBalancing::aux_loss;
  Decoder other(renormalised, plan);
  double differs = 0;
  for (int s = 0; s < 12; ++s) {
    const std::int32_t t = token(5, s, m.vocab_size);
    const std::vector<float> a = trained.generator.feed(t), b = loaded.generator.feed(t),
                             c = other.generator.feed(t);
    ASSERT_EQ(a.size(), b.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      ASSERT_NEAR(b[i], a[i], 1e-6 * (1 + std::abs(a[i]))) << "position " << s << " token " << i;
      differs = std::max(differs, static_cast<double>(std::abs(c[i] - a[i])));
    }
  }
  EXPECT_GT(differs, 1e-4) << "the renormalised weights must change the logits for the test to "
                              "mean anything";
}

TEST(Generator, RefusesWhatItCannotDecode) {
  const ModelConfig m = llama(0);
  Decoder d(m, {.micro_batch_size = 1, .global_batch_size = 1});
  EXPECT_THROW(d.generator.generate({}, {}), std::invalid_argument);
  const std::vector<std::int32_t> prompt{1, 2, 3};
  try {
    d.generator.generate(prompt, {.max_new_tokens = m.seq_length});
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("need 19 positions; the model has 16"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(d.generator.feed(m.vocab_size), std::invalid_argument);
  EXPECT_THROW(d.generator.generate(prompt, {.temperature = -1}), std::invalid_argument);
}

TEST(Generator, SamplingFollowsTemperatureAndTopK) {
  const std::vector<float> logits{0.f, 3.f, 1.f, 3.f};
  // Greedy: the most likely, ties to the lower id.
  EXPECT_EQ(sample_token(logits, {.temperature = 0}, 5), 1);
  // Top-1 at any temperature is greedy; top-2 never draws ids 0 or 2.
  for (std::int64_t position = 0; position < 200; ++position) {
    EXPECT_EQ(sample_token(logits, {.temperature = 2, .top_k = 1}, position), 1);
    const std::int32_t t = sample_token(logits, {.temperature = 1, .top_k = 2}, position);
    EXPECT_TRUE(t == 1 || t == 3) << t;
  }
  // The draws follow the softmax: ids 1 and 3 each about e^3 / (1 + 2 e^3 + e) of the time.
  int counts[4] = {};
  const int n = 20000;
  for (std::int64_t position = 0; position < n; ++position)
    ++counts[sample_token(logits, {.temperature = 1}, position)];
  const double z = 1 + 2 * std::exp(3.0) + std::exp(1.0);
  EXPECT_NEAR(counts[1] / double(n), std::exp(3.0) / z, 0.02);
  EXPECT_NEAR(counts[2] / double(n), std::exp(1.0) / z, 0.02);
  EXPECT_NEAR(counts[0] / double(n), 1 / z, 0.01);
}

}  // namespace
}  // namespace weave::graphs
