// Megatron-Core's DeepSeek-V3 style routing in the router: sigmoid and sqrtsoftplus scores
// (normalised over the picks when top-k > 1), group-limited top-k and the aux-loss-free expert
// bias, checked against picks and weights worked out here from Megatron-Core's rules, and the
// router's gradient with those scores against finite differences.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <span>
#include <vector>

#include "gradient_check.hpp"
#include "router_gradient.hpp"
#include "weave/ops/router.hpp"

namespace weave::ops {
namespace {

using testing::expect_router_gradient;
using testing::TensorD;

double sigmoid(double x) {
  return 1 / (1 + std::exp(-x));
}

// Megatron-Core's sqrtsoftplus: sqrt of PyTorch's softplus, log(1 + e^x), x itself above 20.
double sqrtsoftplus(double x) {
  return std::sqrt(x > 20 ? x : std::log(1 + std::exp(x)));
}

struct Routed {
  std::vector<std::int32_t> index;
  TensorD weight;
  RouterStatistics stats;
};

Routed route(const RouterOptions& o, const std::vector<double>& logits) {
  const std::int64_t e = static_cast<std::int64_t>(logits.size());
  Routed r{std::vector<std::int32_t>(static_cast<std::size_t>(o.top_k)),
           TensorD::empty({1, o.top_k}),
           {}};
  r.stats = router_forward(o, TensorD::from(logits, {1, e}), TensorD::empty({1, e}),
                           std::span(r.index), r.weight);
  return r;
}

TEST(RouterRouting, SigmoidScoresAreNormalisedOverThePicksThenScaled) {
  const std::vector<double> x{0.0, 1.0, -1.0, 2.0};
  const RouterOptions two{
      .top_k = 2, .score = RouterScore::sigmoid, .renormalize = true, .topk_scaling_factor = 2.5};
  const Routed r = route(two, x);
  EXPECT_EQ(r.index, (std::vector<std::int32_t>{3, 1}));
  const double s3 = sigmoid(2.0), s1 = sigmoid(1.0);
  EXPECT_NEAR(r.weight(0, 0), 2.5 * s3 / (s3 + s1), 1e-12);
  EXPECT_NEAR(r.weight(0, 1), 2.5 * s1 / (s3 + s1), 1e-12);
  // The loss's scores are the sigmoids over their sum over every expert.
  double all = 0;
  for (double v : x)
    all += sigmoid(v);
  for (std::size_t j = 0; j < x.size(); ++j)
    EXPECT_NEAR(r.stats.probability[j], sigmoid(x[j]) / all, 1e-12);
  // Top-1 keeps the sigmoid itself (Megatron-Core normalises only when top-k > 1).
  const Routed one = route({.top_k = 1, .score = RouterScore::sigmoid, .renormalize = false}, x);
  EXPECT_EQ(one.index, (std::vector<std::int32_t>{3}));
  EXPECT_NEAR(one.weight(0, 0), s3, 1e-12);
}

TEST(RouterRouting, SqrtSoftplusScoresAreNormalisedOverThePicksThenScaled) {
  // 25 is past softplus's threshold: its score is sqrt(25) = 5 exactly.
  const std::vector<double> x{0.0, 1.0, -3.0, 25.0, 2.0};
  const RouterOptions two{.top_k = 2,
                          .score = RouterScore::sqrtsoftplus,
                          .renormalize = true,
                          .topk_scaling_factor = 2.5};
  const Routed r = route(two, x);
  EXPECT_EQ(r.index, (std::vector<std::int32_t>{3, 4}));
  const double s3 = sqrtsoftplus(25.0), s4 = sqrtsoftplus(2.0);
  EXPECT_EQ(s3, 5.0);
  EXPECT_NEAR(r.weight(0, 0), 2.5 * s3 / (s3 + s4), 1e-12);
  EXPECT_NEAR(r.weight(0, 1), 2.5 * s4 / (s3 + s4), 1e-12);
  // The loss's scores are the sqrtsoftplus scores over their sum over every expert.
  double all = 0;
  for (double v : x)
    all += sqrtsoftplus(v);
  for (std::size_t j = 0; j < x.size(); ++j)
    EXPECT_NEAR(r.stats.probability[j], sqrtsoftplus(x[j]) / all, 1e-12);
  // Top-1 keeps the score itself, which exceeds 1 here (no sigmoid's bound).
  const Routed one =
      route({.top_k = 1, .score = RouterScore::sqrtsoftplus, .renormalize = false}, x);
  EXPECT_EQ(one.index, (std::vector<std::int32_t>{3}));
  EXPECT_NEAR(one.weight(0, 0), 5.0, 1e-12);
  // The expert bias chooses with sqrtsoftplus scores too (Megatron-Core's rule), without
  // weighing: 0.5 lifts expert 1 (1.1460 + 0.5) over expert 4 (1.4584).
  const std::vector<float> bias{0.f, 0.5f, 0.f, 0.f, 0.f};
  const Routed biased = route(
      {.top_k = 2, .score = RouterScore::sqrtsoftplus, .renormalize = true, .expert_bias = bias},
      x);
  EXPECT_EQ(biased.index, (std::vector<std::int32_t>{3, 1}));
  const double s1 = sqrtsoftplus(1.0);
  EXPECT_NEAR(biased.weight(0, 1), s1 / (s3 + s1), 1e-12);
}

TEST(RouterRouting, GroupsAreScoredByTheSumOfTheirTopScores) {
  // 8 experts in 4 groups of 2; top-4 from 2 groups: each group scores its top 4 / 2 = 2.
  // Sigmoid sums: group 0 0.953 + 0.047 = 1.0, group 1 2 x 0.731, group 2 0.881 + 0.007,
  // group 3 2 x 0.622: groups 1 and 3, though experts 0 and 4 score highest.
  const std::vector<double> x{3, -3, 1, 1, 2, -5, 0.5, 0.5};
  const RouterOptions o{.top_k = 4,
                        .score = RouterScore::sigmoid,
                        .renormalize = true,
                        .num_groups = 4,
                        .group_topk = 2};
  const Routed r = route(o, x);
  EXPECT_EQ(r.index, (std::vector<std::int32_t>{2, 3, 6, 7}));
  const double sum = 2 * sigmoid(1) + 2 * sigmoid(0.5);
  EXPECT_NEAR(r.weight(0, 0), sigmoid(1) / sum, 1e-12);
  EXPECT_NEAR(r.weight(0, 3), sigmoid(0.5) / sum, 1e-12);
  // The load-balancing loss counts the plain top-4: experts 0, 4, 2 and 3.
  EXPECT_EQ(r.stats.assignments, (std::vector<double>{1, 0, 1, 1, 1, 0, 0, 0}));
}

TEST(RouterRouting, SoftmaxGroupsAreScoredByLogitsUnlessPreSoftmax) {
  // Group 0's logits sum to 4 > 3.5, its probabilities to 2 e^2 < e^3.5 + 1: Megatron-Core's
  // softmax routing picks by the logits (group 0), pre-softmax by the probabilities (group 1).
  const std::vector<double> x{2, 2, 3.5, 0};
  const RouterOptions by_logits{.top_k = 2, .renormalize = true, .num_groups = 2, .group_topk = 1};
  EXPECT_EQ(route(by_logits, x).index, (std::vector<std::int32_t>{0, 1}));
  RouterOptions by_probs = by_logits;
  by_probs.renormalize = false;
  const Routed r = route(by_probs, x);
  EXPECT_EQ(r.index, (std::vector<std::int32_t>{2, 3}));
  const double z = 2 * std::exp(2.0) + std::exp(3.5) + 1;
  EXPECT_NEAR(r.weight(0, 0), std::exp(3.5) / z, 1e-12);
  EXPECT_NEAR(r.weight(0, 1), 1 / z, 1e-12);
}

TEST(RouterRouting, ExpertBiasChoosesButDoesNotWeigh) {
  const std::vector<double> x{0.0, 0.1, 0.2, 0.3};
  const std::vector<float> bias{0.5f, 0.f, 0.f, -0.25f};
  const RouterOptions o{
      .top_k = 2, .score = RouterScore::sigmoid, .renormalize = true, .expert_bias = bias};
  // Routing scores: 1.0, 0.525, 0.550, 0.324: experts 0 and 2, weighed by their sigmoids alone.
  const Routed r = route(o, x);
  EXPECT_EQ(r.index, (std::vector<std::int32_t>{0, 2}));
  const double s0 = sigmoid(0.0), s2 = sigmoid(0.2);
  EXPECT_NEAR(r.weight(0, 0), s0 / (s0 + s2), 1e-12);
  EXPECT_NEAR(r.weight(0, 1), s2 / (s0 + s2), 1e-12);
  EXPECT_EQ(r.stats.assignments, (std::vector<double>{0, 0, 1, 1}));
}

TEST(RouterRouting, ExpertBiasMovesTowardsTheMeanLoad) {
  // Loads 10, 2, 6, 6: mean 6. Under the mean up, over it down, at it unchanged.
  const std::vector<float> loads{10, 2, 6, 6};
  std::vector<float> bias{0.f, 0.f, 0.5f, 0.f};
  update_expert_bias(loads, bias, 1e-3);
  EXPECT_EQ(bias, (std::vector<float>{-1e-3f, 1e-3f, 0.5f, 0.f}));
  std::vector<float> short_bias(3);
  EXPECT_THROW(update_expert_bias(loads, short_bias, 1e-3), std::invalid_argument);
}

TEST(RouterRouting, RulesAreRefusedWithTheirValues) {
  const std::vector<float> bias(4, 0.f);
  EXPECT_THROW(route({.top_k = 2, .expert_bias = bias}, {0, 1, 2, 3}), std::invalid_argument);
  EXPECT_THROW(route({.top_k = 2, .num_groups = 3, .group_topk = 1}, {0, 1, 2, 3}),
               std::invalid_argument);
  EXPECT_THROW(route({.top_k = 2, .num_groups = 2, .group_topk = 3}, {0, 1, 2, 3}),
               std::invalid_argument);
  // Top-3 from one group of 2 experts cannot be filled.
  EXPECT_THROW(route({.top_k = 3, .num_groups = 2, .group_topk = 1}, {0, 1, 2, 3}),
               std::invalid_argument);
}

TEST(RouterRouting, SigmoidGradientMatchesFiniteDifferences) {
  const std::vector<float> bias{0.05f, -0.1f, 0.f, 0.2f, -0.05f, 0.1f};
  for (const int k : {1, 2}) {
    std::mt19937 gen(7 + k);
    const std::int64_t T = 5, E = 6;
    const RouterOptions opt{.top_k = k,
                            .score = RouterScore::sigmoid,
                            .renormalize = k > 1,
                            .aux_loss_coeff = 0.2,
                            .z_loss_coeff = 0.03,
                            .topk_scaling_factor = 2.5,
                            .num_groups = 3,
                            .group_topk = 1,
                            .expert_bias = bias};
    expect_router_gradient(k == 1 ? "top-1" : "top-2", opt, T, E, gen);
  }
}

TEST(RouterRouting, SqrtSoftplusGradientMatchesFiniteDifferences) {
  const std::vector<float> bias{0.05f, -0.1f, 0.f, 0.2f, -0.05f, 0.1f};
  for (const int k : {1, 2}) {
    std::mt19937 gen(17 + k);
    const std::int64_t T = 5, E = 6;
    const RouterOptions opt{.top_k = k,
                            .score = RouterScore::sqrtsoftplus,
                            .renormalize = k > 1,
                            .aux_loss_coeff = 0.2,
                            .z_loss_coeff = 0.03,
                            .topk_scaling_factor = 2.5,
                            .num_groups = 3,
                            .group_topk = 1,
                            .expert_bias = bias};
    expect_router_gradient(k == 1 ? "top-1" : "top-2", opt, T, E, gen);
  }
  // Past softplus's threshold (logit > 20) the score is sqrt(x): d/dx = 1 / (2 sqrt(x)).
  const RouterOptions one{.top_k = 1, .score = RouterScore::sqrtsoftplus, .renormalize = false};
  const TensorD logits = TensorD::from(std::vector<double>{25.0, 0.0}, {1, 2}),
                probs = TensorD::empty({1, 2});
  const TensorD w = TensorD::empty({1, 1}), dlogits = TensorD::empty({1, 2});
  std::vector<std::int32_t> index(1);
  const RouterStatistics stats = router_forward(one, logits, probs, std::span(index), w);
  router_backward(one, logits, probs, std::span<const std::int32_t>(index), w,
                  TensorD::from(std::vector<double>{1.0}, {1, 1}), stats, 1.0, dlogits);
  EXPECT_NEAR(dlogits(0, 0), 1 / (2 * 5.0), 1e-12);
  EXPECT_EQ(dlogits(0, 1), 0.0);
}

}  // namespace
}  // namespace weave::ops
