// Megatron-Core's shared-expert gate (--moe-shared-expert-gate): the shared experts' output times
// each token's sigmoid(w . x). Its backward against a central difference of the loss; the step
// under tensor (with and without sequence), expert, context parallelism and the dispatch overlap
// equal to one device; decoding through it giving the training step's loss.
#include <gtest/gtest.h>

#include <cmath>

#include "decoder.hpp"
#include "step_outcome.hpp"
#include "tiny_model.hpp"

namespace weave::graphs {
namespace {

ModelConfig gated_model() {
  ModelConfig m = tiny(4);
  m.activation = Activation::swiglu;
  m.add_bias_linear = false;
  m.moe_shared_expert_intermediate_size = 48;
  m.moe_shared_expert_gate = true;
  return m;
}

TEST(SharedExpertGate, GradientMatchesADirectionalDifference) {
  ModelConfig m = gated_model();
  m.hidden_dropout = 0;
  for (const bool sp : {true, false}) {
    const ParallelPlan plan{.tensor_parallel = 2,
                            .sequence_parallel = sp,
                            .micro_batch_size = 2,
                            .global_batch_size = 2};
    // The shared experts' weights with the gate's, the gate's alone, then the attention its input
    // gradient reaches through the norm. The loss moves by ~1e-3 per unit along the gate's weight
    // alone, so the fp32 losses' rounding over the difference's +-1e-4 leaves a few percent: a
    // missing g (1 - g) factor (<= 1/4) or a wrong sign still fails.
    const std::pair<std::string_view, double> checks[] = {{"shared_experts", 2e-2},
                                                          {"shared_experts.gate_weight", 1e-1},
                                                          {"layers.0.attention", 2e-2}};
    for (const auto& [only, tolerance] : checks) {
      const auto [along, numeric] = directional_derivative(m, plan, only);
      EXPECT_NE(along, 0.0) << only;
      EXPECT_NEAR(along, numeric, tolerance * std::abs(numeric))
          << only << (sp ? " sp" : " no sp") << ": analytic " << along << ", numeric " << numeric;
    }
  }
}

TEST(SharedExpertGate, EqualsOneDeviceUnderEachParallelism) {
  const ModelConfig m = gated_model();
  const ParallelPlan serial{.micro_batch_size = 1, .global_batch_size = 2};
  const Outcome a = run(m, serial, 1, false);
  EXPECT_EQ(a.grads.at("layers.0.moe.shared_experts.gate_weight").size(), 32u);
  ModelConfig ungated = m;
  ungated.moe_shared_expert_gate = false;
  EXPECT_NE(run(ungated, serial, 1, false).losses[0], a.losses[0]);
  ModelConfig overlapped = m;
  overlapped.moe_shared_expert_overlap = true;
  const std::pair<const char*, ParallelPlan> plans[] = {
      {"tp2", {.tensor_parallel = 2, .micro_batch_size = 1, .global_batch_size = 2}},
      {"tp2+sp ep2",
       {.tensor_parallel = 2,
        .sequence_parallel = true,
        .expert_parallel = 2,
        .micro_batch_size = 1,
        .global_batch_size = 2}},
      {"cp2 dp2",
       {.context_parallel = 2, .data_parallel = 2, .micro_batch_size = 1, .global_batch_size = 2}},
  };
  for (const auto& [name, plan] : plans) {
    SCOPED_TRACE(name);
    for (const ModelConfig& c : {m, overlapped}) {
      const Outcome b = run(c, plan, 1, false);
      EXPECT_NEAR(b.losses[0], a.losses[0], 1e-5 * a.losses[0]);
      expect_same_gradients(a, b);
    }
  }
}

TEST(SharedExpertGate, DecodingGivesTheTrainingStepsLoss) {
  ASSERT_NO_FATAL_FAILURE(expect_decoding_gives_the_steps_loss(
      without_dropout(gated_model()),
      ParallelPlan{.tensor_parallel = 2, .sequence_parallel = true, .expert_parallel = 2}));
  // A gate without shared experts is refused.
  ModelConfig none = gated_model();
  none.moe_shared_expert_intermediate_size = 0;
  ParallelPlan none_plan{.micro_batch_size = 1, .global_batch_size = 1};
  EXPECT_THROW(validate(none, none_plan), ConfigError);
}

}  // namespace
}  // namespace weave::graphs
