// The MoE model's gradient against central differences of the loss, biases off (Megatron-LM's
// --disable-bias-linear) and on. Top-k routing is a step function of the parameters: where a
// token's choice flips between the two points of a difference the loss jumps and the difference
// measures the jump, not the gradient. The step's routing digest sees the flip, and the check
// takes its difference over an interval where routing holds.
#include <gtest/gtest.h>

#include <cmath>
#include <string_view>

#include "step_outcome.hpp"
#include "tiny_model.hpp"

namespace weave::graphs {
namespace {

// tiny(4) without biases (the MoE layer first, top-2 of 4 experts), no dropout.
ModelConfig no_bias_moe() {
  ModelConfig m = tiny(4);
  m.add_bias_linear = false;
  m.hidden_dropout = 0;
  return m;
}

const ParallelPlan kPlan{
    .tensor_parallel = 2, .sequence_parallel = true, .micro_batch_size = 2, .global_batch_size = 4};

// The whole model, the embedding (which every router's input depends on), the MoE layer's router
// and experts and the layers around it, with biases off and on.
TEST(MoeGradient, MatchesADirectionalDifferenceWhereRoutingHolds) {
  for (const bool bias : {false, true}) {
    ModelConfig m = no_bias_moe();
    m.add_bias_linear = bias;
    for (const std::string_view only : {"", "embedding", "layers.0.moe.router",
                                        "layers.0.moe.experts", "layers.0.attention", "layers.1"}) {
      const auto [along, numeric] = directional_derivative(m, kPlan, only);
      EXPECT_NE(along, 0.0) << only;
      // 2e-4: the float loss's rounding over the difference's interval, for the router's small
      // derivatives.
      EXPECT_NEAR(along, numeric, 2e-2 * std::abs(numeric) + 2e-4)
          << (bias ? "biases, " : "no biases, ") << only << ": analytic " << along << ", numeric "
          << numeric;
    }
  }
}

// Along this direction through the embedding a token's top-k choice flips between 0 and 1e-4: the
// digest changes there, the loss jumps (a slope over the flip's interval far from the gradient),
// and the central difference over [-1e-4, 1e-4] misses the gradient; where the digest holds, the
// slopes are the gradient.
TEST(MoeGradient, RoutingDigestSeesATopKFlip) {
  LineProbe probe(no_bias_moe(), kPlan, "embedding");
  const double g = probe.analytic();
  const auto [f0, routing] = probe.at(0);
  EXPECT_NE(routing, 0u);
  EXPECT_EQ(probe.at(0).second, routing);  // the same point routes the same
  EXPECT_NE(probe.at(1e-4).second, routing);
  const double naive = (probe.at(1e-4).first - probe.at(-1e-4).first) / 2e-4;
  EXPECT_GT(std::abs(naive - g), 0.5 * std::abs(g)) << "analytic " << g << ", naive " << naive;
  // Ten intervals over [0, 1e-4]: those whose ends route alike have slope ~g, the others not.
  int flips = 0;
  auto [f, r] = probe.at(0);
  for (int i = 1; i <= 10; ++i) {
    const auto [next, next_routing] = probe.at(1e-5 * i);
    const double slope = (next - f) / 1e-5;
    if (next_routing == r) {
      EXPECT_NEAR(slope, g, 0.1 * std::abs(g)) << "interval " << i;
    } else {
      ++flips;
      EXPECT_GT(std::abs(slope - g), std::abs(g)) << "interval " << i;
    }
    f = next;
    r = next_routing;
  }
  EXPECT_GE(flips, 1);
  const std::optional<double> numeric = probe.numeric();
  ASSERT_TRUE(numeric.has_value());
  EXPECT_NEAR(g, *numeric, 2e-2 * std::abs(*numeric));
}

}  // namespace
}  // namespace weave::graphs
