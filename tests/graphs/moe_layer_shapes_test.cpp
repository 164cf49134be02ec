// DeepSeek-V3-style MoE layer shapes, as Megatron-Core defines them: routed experts of their own
// width (--moe-ffn-hidden-size) beside dense layers of --ffn-hidden-size, and the MoE layers
// chosen by a --moe-layer-freq pattern (dense first layers). The step under tensor, sequence,
// expert and pipeline parallelism equals one device; its prediction counts the parameters and
// FLOPs the closed forms give; the pattern reader takes Megatron's forms and names them when it
// refuses one.
#include <gtest/gtest.h>

#include <string>

#include "materialised_step.hpp"
#include "step_outcome.hpp"
#include "tiny_model.hpp"
#include "weave/graphs/moe_layer_freq.hpp"
#include "weave/graphs/prediction.hpp"
#include "weave/graphs/virtual_replay.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::graphs {
namespace {

// Four layers, the first two dense (--ffn-hidden-size 64), the last two MoE with experts 32
// wide: with two pipeline stages the boundary falls between the dense and the MoE layers.
ModelConfig dense_first_layers() {
  ModelConfig m = tiny(4);
  m.num_layers = 4;
  m.moe_ffn_hidden_size = 32;
  set_moe_layer_freq(m, "([0]*2+[1]*2)");
  return m;
}

const ParallelPlan kParallel{.tensor_parallel = 2,
                             .sequence_parallel = true,
                             .expert_parallel = 2,
                             .pipeline_parallel = 2,
                             .micro_batch_size = 1,
                             .global_batch_size = 2};

TEST(MoeLayerShapes, DenseFirstLayersAndNarrowExpertsEqualOneDevice) {
  const ModelConfig m = dense_first_layers();
  ASSERT_FALSE(m.is_moe_layer(0));
  ASSERT_FALSE(m.is_moe_layer(1));
  ASSERT_TRUE(m.is_moe_layer(2));
  ASSERT_TRUE(m.is_moe_layer(3));
  const ParallelPlan serial{.micro_batch_size = 1, .global_batch_size = 2};
  const Outcome a = run(m, serial, 1, false), b = run(m, kParallel, 1, false);
  EXPECT_NEAR(b.losses[0], a.losses[0], 1e-5 * a.losses[0]);
  EXPECT_GT(a.aux[0], 0);  // the MoE layers route
  EXPECT_NEAR(b.aux[0], a.aux[0], 1e-5 * a.aux[0]);
  expect_same_gradients(a, b);
  // The experts are --moe-ffn-hidden-size wide, the dense MLPs --ffn-hidden-size.
  EXPECT_EQ(a.grads.at("layers.2.moe.experts.fc1.weight").size(), 4u * 32 * 32);
  EXPECT_EQ(a.grads.at("layers.0.mlp.fc1.weight").size(), 64u * 32);
  EXPECT_EQ(a.grads.count("layers.0.moe.router.weight"), 0u);
}

// Experts split over the tensor-parallel group (--expert-tensor-parallel-size) take their share
// of --moe-ffn-hidden-size, SwiGLU's gates and values each split.
TEST(MoeLayerShapes, SplitSwigluExpertsOfTheirOwnWidthEqualOneDevice) {
  ModelConfig m = dense_first_layers();
  m.activation = Activation::swiglu;
  const ParallelPlan split{.tensor_parallel = 2,
                           .sequence_parallel = true,
                           .expert_parallel = 2,
                           .expert_tensor_parallel = 2,
                           .data_parallel = 2,
                           .micro_batch_size = 1,
                           .global_batch_size = 2};
  const ParallelPlan serial{.micro_batch_size = 1, .global_batch_size = 2};
  const Outcome a = run(m, serial, 1, false), b = run(m, split, 1, false);
  EXPECT_NEAR(b.losses[0], a.losses[0], 1e-5 * a.losses[0]);
  EXPECT_NEAR(b.aux[0], a.aux[0], 1e-5 * a.aux[0]);
  expect_same_gradients(a, b);
  EXPECT_EQ(a.grads.at("layers.3.moe.experts.fc1.weight").size(), 4u * 2 * 32 * 32);
}

// Megatron-LM's count (6 N per token and parameter, the attention's scores besides): the dense
// layers' MLPs of --ffn-hidden-size, the MoE layers' router and top-k experts of
// --moe-ffn-hidden-size; and each device's parameters as the layers it holds sum them.
TEST(MoeLayerShapes, PredictionCountsTheLayersOfEachShape) {
  TrainerConfig c;
  c.model = dense_first_layers();
  c.plan = kParallel;
  c.machine = {.device_flops = 1e12, .device_memory_bandwidth = 1e11, .link = "nvlink4"};
  const Prediction p = predict_step(c);

  const double h = 32, s = 16, f = 64, fe = 32, E = 4, k = 2, V = 64, tp = 2, ep = 2;
  const double attention = 2 * h * 3 * h + 4 * s * h + 2 * h * h;
  const double dense = attention + 2 * 2 * h * f, moe = attention + 2 * h * E + k * 2 * 2 * h * fe;
  const double tokens = 2 * s;
  const double flops = tokens * (3 * (2 * dense + 2 * moe) + 3 * 2 * h * V);
  EXPECT_NEAR(p.model_flops, flops, 1e-9 * flops);

  // Per tensor-parallel rank: norms and biases the ranks repeat, the rest split.
  const double norms = 2 * 2 * h;
  const double attention_params = 3 * h / tp * h + 3 * h / tp + h * h / tp + h;
  const double dense_params = norms + attention_params + f / tp * h + f / tp + h * f / tp + h;
  const double moe_params = norms + attention_params + E * h + E / ep * 2 * fe * h;
  const double first = V / tp * h + s * h + 2 * dense_params;
  const double last = 2 * moe_params + 2 * h + V / tp * h;  // the tied word embedding's copy
  ASSERT_EQ(p.memory.size(), 4u);                           // tp 2 x pp 2 (ep 2 folds over tp)
  const auto parameters = static_cast<std::size_t>(rt::MemoryCategory::parameters);
  for (std::size_t d = 0; d < 4; ++d) {
    const bool last_stage = d >= 2;
    EXPECT_EQ(p.memory[d][parameters], static_cast<std::int64_t>(4 * (last_stage ? last : first)))
        << "device " << d;
  }
}

// The prediction replays the step it predicts: the same time and memory as the step built with
// tensors.
TEST(MoeLayerShapes, PredictionEqualsTheMaterialisedStep) {
  TrainerConfig c;
  c.model = dense_first_layers();
  c.plan = kParallel;
  c.machine = {.device_flops = 1e12, .device_memory_bandwidth = 1e11, .link = "nvlink4"};
  const Prediction p = predict_step(c);
  const MaterialisedStep r = materialised_step(c);
  EXPECT_DOUBLE_EQ(p.step_ms, static_cast<double>(r.replay.makespan) * 1e-6);
  EXPECT_EQ(p.memory, r.memory);
}

std::vector<int> pattern_of(const std::string& text) {
  ModelConfig m;
  set_moe_layer_freq(m, text);
  return m.moe_layer_pattern;
}

std::string refusal(const std::string& text) {
  try {
    ModelConfig m;
    set_moe_layer_freq(m, text);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "accepted";
}

TEST(MoeLayerShapes, PatternReaderTakesMegatronsForms) {
  EXPECT_EQ(pattern_of("([0]*3+[1]*5)"), (std::vector<int>{0, 0, 0, 1, 1, 1, 1, 1}));
  EXPECT_EQ(pattern_of("[0,1,1,0]"), (std::vector<int>{0, 1, 1, 0}));
  EXPECT_EQ(pattern_of(" [1, 0] * 2 + [0] "), (std::vector<int>{1, 0, 1, 0, 0}));
  EXPECT_EQ(pattern_of("[0]*0+[1]"), (std::vector<int>{1}));
  // Megatron-LM's own example of the flag: a group repeated.
  EXPECT_EQ(pattern_of("([1]*3+[0]*1)*3"), (std::vector<int>{1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 0}));
  EXPECT_EQ(pattern_of("[0]+([1]+([0,1])*2)*2"),
            (std::vector<int>{0, 1, 0, 1, 0, 1, 1, 0, 1, 0, 1}));
  ModelConfig m;
  set_moe_layer_freq(m, "3");
  EXPECT_EQ(m.moe_layer_freq, 3);
  EXPECT_TRUE(m.moe_layer_pattern.empty());
  set_moe_layer_freq(m, "[1,0]");
  EXPECT_EQ(moe_layer_freq_text(m), "[1,0]");
  set_moe_layer_freq(m, "2");  // a number again drops the pattern
  EXPECT_TRUE(m.moe_layer_pattern.empty());
}

TEST(MoeLayerShapes, PatternReaderRefusesOtherExpressionsNamingTheForms) {
  const std::string forms =
      "it takes a whole number N (a MoE layer every N layers), a list of 0s and 1s such as "
      "\"[0,1,1,0]\", or a sum of bracketed lists and parenthesised sums, each times a count, "
      "such as \"([0]*3+[1]*5)\" or \"([1]*3+[0]*1)*3\"";
  const std::pair<const char*, const char*> cases[] = {
      {"([1]*3+[0]*1)*n", "'n' where a count was expected at character 15"},
      {"3*[0]", "'3' where '[' opening a list or '(' a group was expected"},
      {"[0]*3-[1]", "'-' where '+' or the end was expected at character 6"},
      {"[0,2]", "an entry 2, not 0 or 1"},
      {"[0,1", "the end where ',' or ']' was expected"},
      {"[]", "']' where 0 or 1 was expected"},
      {"[0]*n", "'n' where a count was expected"},
      {"([0]*3", "the end where '+' or ')' was expected"},
      {"[0])", "')' where '+' or the end was expected at character 4"},
      {"[0]+[1]*2000000", "a number above 1048576"},
      {"[x for x in range(4)]", "'x' where 0 or 1 was expected"},
      {"two", "neither a whole number nor a pattern"},
  };
  for (const auto& [text, what] : cases) {
    const std::string message = refusal(text);
    EXPECT_NE(message.find(what), std::string::npos) << text << ": " << message;
    EXPECT_NE(message.find(forms), std::string::npos) << text << ": " << message;
    EXPECT_NE(message.find(std::string("--moe-layer-freq '") + text + "'"), std::string::npos)
        << message;
  }
}

TEST(MoeLayerShapes, PlanRulesCheckThePatternAndTheExpertWidth) {
  auto refused = [](const ModelConfig& m, ParallelPlan plan) -> std::string {
    try {
      validate(m, plan);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "accepted";
  };
  const ParallelPlan one{.micro_batch_size = 1, .global_batch_size = 1};
  ModelConfig m = dense_first_layers();
  EXPECT_EQ(refused(m, one), "accepted");
  set_moe_layer_freq(m, "[0]*3+[1]*2");
  EXPECT_NE(refused(m, one).find("--moe-layer-freq's pattern has 5 entries and --num-layers is 4"),
            std::string::npos);
  ModelConfig dense = tiny(0);
  dense.moe_ffn_hidden_size = 32;
  EXPECT_NE(refused(dense, one).find("--moe-ffn-hidden-size (32) sets the routed experts' width"),
            std::string::npos);
  ModelConfig odd = dense_first_layers();
  odd.moe_ffn_hidden_size = 33;
  EXPECT_NE(refused(odd, {.tensor_parallel = 2,
                          .expert_tensor_parallel = 2,
                          .micro_batch_size = 1,
                          .global_batch_size = 1})
                .find("must be divisible by --expert-tensor-parallel-size (2)"),
            std::string::npos);
}

}  // namespace
}  // namespace weave::graphs
