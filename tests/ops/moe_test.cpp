// MoE pieces: router gradients (with aux and z losses) against finite differences, statistics
// that add up over parts, dispatch with capacity and dropless, permutation and combine, and the
// batched expert MLPs.
#include <gtest/gtest.h>

#include <numeric>
#include <random>

#include "gradient_check.hpp"
#include "router_gradient.hpp"
#include "weave/ops/experts.hpp"
#include "weave/ops/moe_dispatch.hpp"
#include "weave/ops/router.hpp"

namespace weave::ops {
namespace {

using testing::dot;
using testing::expect_gradient;
using testing::expect_router_gradient;
using testing::random_tensor;
using testing::TensorD;

class RouterGradient : public ::testing::TestWithParam<bool> {};

TEST_P(RouterGradient, MatchesFiniteDifferences) {
  const bool renormalize = GetParam();
  std::mt19937 gen(1);
  const std::int64_t T = 6, E = 5;
  const RouterOptions opt{
      .top_k = 2, .renormalize = renormalize, .aux_loss_coeff = 0.3, .z_loss_coeff = 0.05};
  expect_router_gradient("dlogits", opt, T, E, gen);
}

INSTANTIATE_TEST_SUITE_P(Renormalize, RouterGradient, ::testing::Bool());

TEST(Router, ScaledWeightsGradientMatchesFiniteDifferences) {
  for (const bool renormalize : {true, false}) {
    std::mt19937 gen(5);
    const std::int64_t T = 5, E = 4;
    const RouterOptions opt{.top_k = 2,
                            .renormalize = renormalize,
                            .aux_loss_coeff = 0.2,
                            .z_loss_coeff = 0.03,
                            .topk_scaling_factor = 2.5};
    const TensorD logits = random_tensor({T, E}, gen, -2, 2), r = random_tensor({T, 2}, gen);
    const TensorD probs = TensorD::empty({T, E}), w = TensorD::empty({T, 2});
    std::vector<std::int32_t> index(T * 2);
    RouterStatistics stats;
    auto loss = [&] {
      stats = router_forward(opt, logits, probs, std::span(index), w);
      return dot(w, r) + aux_loss(opt, stats) + z_loss(opt, stats);
    };
    loss();
    // The weights are the unscaled ones times 2.5.
    RouterOptions unscaled = opt;
    unscaled.topk_scaling_factor = 1;
    const TensorD w1 = TensorD::empty({T, 2});
    router_forward(unscaled, logits, probs, std::span(index), w1);
    for (std::int64_t i = 0; i < T * 2; ++i)
      EXPECT_NEAR(w.data()[i], 2.5 * w1.data()[i], 1e-12);
    loss();
    const TensorD dlogits = TensorD::empty({T, E});
    router_backward(opt, logits, probs, std::span<const std::int32_t>(index), w, r, stats, 1.0,
                    dlogits);
    expect_gradient(renormalize ? "renormalised" : "not renormalised", logits, loss, dlogits);
  }
}

TEST(Router, PicksTheLargestProbabilitiesInOrder) {
  const TensorD logits = TensorD::from(std::vector<double>{0.1, 2.0, -1.0, 1.5}, {1, 4});
  const TensorD probs = TensorD::empty({1, 4}), w = TensorD::empty({1, 2});
  std::vector<std::int32_t> index(2);
  const RouterOptions opt{.top_k = 2, .renormalize = true};
  const RouterStatistics s = router_forward(opt, logits, probs, std::span(index), w);
  EXPECT_EQ(index, (std::vector<std::int32_t>{1, 3}));
  EXPECT_NEAR(w(0, 0) + w(0, 1), 1.0, 1e-15);
  EXPECT_NEAR(w(0, 0) / w(0, 1), std::exp(0.5), 1e-12);
  EXPECT_EQ(s.assignments, (std::vector<double>{0, 1, 0, 1}));
}

TEST(Router, StatisticsOfPartsAddUpToTheWhole) {
  std::mt19937 gen(2);
  const RouterOptions opt{.top_k = 2, .aux_loss_coeff = 0.01, .z_loss_coeff = 0.001};
  const TensorD logits = random_tensor({12, 4}, gen);
  const TensorD probs = TensorD::empty({12, 4}), w = TensorD::empty({12, 2});
  std::vector<std::int32_t> index(24);
  const RouterStatistics whole = router_forward(opt, logits, probs, std::span(index), w);
  RouterStatistics sum;
  for (int part = 0; part < 3; ++part) {
    std::vector<std::int32_t> idx(8);
    sum += router_forward(opt, logits.slice(0, 4 * part, 4), probs.slice(0, 4 * part, 4),
                          std::span(idx), w.slice(0, 4 * part, 4));
  }
  EXPECT_EQ(sum.tokens, whole.tokens);
  EXPECT_NEAR(aux_loss(opt, sum), aux_loss(opt, whole), 1e-15);
  EXPECT_NEAR(z_loss(opt, sum), z_loss(opt, whole), 1e-15);
  // Uniform routing gives the aux loss's minimum, coeff * 1.
  RouterStatistics uniform{8, {4, 4, 4, 4}, {2, 2, 2, 2}, 0};
  EXPECT_NEAR(aux_loss(opt, uniform), 0.01, 1e-15);
}

TEST(Router, TopKLargerThanExpertsIsRefused) {
  std::vector<std::int32_t> index(5);
  EXPECT_THROW(router_forward({.top_k = 5}, TensorD::zeros({1, 4}), TensorD::empty({1, 4}),
                              std::span(index), TensorD::empty({1, 5})),
               std::invalid_argument);
}

TEST(Dispatch, CapacityDropsLatePicksInTokenOrder) {
  // 4 tokens, top-1, 2 experts; capacity ceil(1.0 * 4 / 2) = 2; expert 0 is picked 3 times.
  const std::vector<std::int32_t> picks{0, 0, 1, 0};
  const DispatchPlan plan = plan_dispatch(picks, 4, 1, 2, {.capacity_factor = 1.0});
  EXPECT_EQ(plan.capacity, 2);
  EXPECT_EQ(plan.dropped, 1);
  EXPECT_EQ(plan.expert_begin, (std::vector<std::int64_t>{0, 2, 3}));
  EXPECT_EQ(plan.row_token, (std::vector<std::int32_t>{0, 1, 2}));
  EXPECT_EQ(plan.pick_row, (std::vector<std::int32_t>{0, 1, 2, -1}));
  const DispatchPlan dropless = plan_dispatch(picks, 4, 1, 2, {});
  EXPECT_EQ(dropless.dropped, 0);
  EXPECT_EQ(dropless.expert_begin, (std::vector<std::int64_t>{0, 3, 4}));
  EXPECT_EQ(dropless.rows_per_rank(2), (std::vector<std::int64_t>{3, 1}));
  EXPECT_THROW(dropless.rows_per_rank(3), std::invalid_argument);
}

TEST(Dispatch, ProbsPolicyKeepsEachExpertsLargestWeightsInTokenOrder) {
  // 4 tokens, top-1, 2 experts; capacity 2; expert 0 is picked by tokens 0, 1 and 3 with weights
  // 0.5, 0.9, 0.7: Megatron-Core's probs policy keeps tokens 1 and 3 (rows in token order).
  const std::vector<std::int32_t> picks{0, 0, 1, 0};
  const std::vector<float> weight{0.5f, 0.9f, 0.6f, 0.7f};
  const DispatchPlan plan =
      plan_dispatch(picks, 4, 1, 2, {.capacity_factor = 1.0, .pick_priority = weight});
  EXPECT_EQ(plan.dropped, 1);
  EXPECT_EQ(plan.expert_begin, (std::vector<std::int64_t>{0, 2, 3}));
  EXPECT_EQ(plan.row_token, (std::vector<std::int32_t>{1, 3, 2}));
  EXPECT_EQ(plan.pick_row, (std::vector<std::int32_t>{-1, 0, 2, 1}));
  // Equal weights: the earlier pick wins, as the position policy would keep it.
  const std::vector<float> equal(4, 0.5f);
  const DispatchPlan tied =
      plan_dispatch(picks, 4, 1, 2, {.capacity_factor = 1.0, .pick_priority = equal});
  EXPECT_EQ(tied.pick_row, (std::vector<std::int32_t>{0, 1, 2, -1}));
  const std::vector<float> short_priority(3, 0.5f);
  EXPECT_THROW(
      plan_dispatch(picks, 4, 1, 2, {.capacity_factor = 1.0, .pick_priority = short_priority}),
      std::invalid_argument);
}

TEST(Dispatch, BadExpertIndexNamesTheToken) {
  const std::vector<std::int32_t> picks{0, 1, 1, 7};
  try {
    plan_dispatch(picks, 2, 2, 4, {});
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("token 1 picks expert 7"), std::string::npos) << e.what();
  }
}

TEST(Dispatch, PermuteThenCombineWithUnitWeightsSumsEachTokensCopies) {
  std::mt19937 gen(3);
  const std::vector<std::int32_t> picks{2, 0, 1, 2, 0, 1, 2, 1};  // 4 tokens, top-2, 3 experts
  const DispatchPlan plan = plan_dispatch(picks, 4, 2, 3, {});
  const TensorD x = random_tensor({4, 5}, gen), grouped = TensorD::empty({8, 5});
  permute_tokens(plan, x, grouped);
  for (std::int64_t e = 0; e < 3; ++e)
    for (std::int64_t r = plan.expert_begin[e]; r < plan.expert_begin[e + 1]; ++r)
      for (int c = 0; c < 5; ++c)
        EXPECT_EQ(grouped(r, c), x(plan.row_token[r], c));
  const TensorD ones = TensorD::empty({4, 2}), y = TensorD::empty({4, 5});
  ones.fill(1.0);
  combine_tokens(plan, grouped, ones, y);
  for (int t = 0; t < 4; ++t)
    for (int c = 0; c < 5; ++c)
      EXPECT_NEAR(y(t, c), 2 * x(t, c), 1e-15);
}

TEST(Dispatch, GradientsMatchFiniteDifferences) {
  std::mt19937 gen(4);
  const std::vector<std::int32_t> picks{2, 0, 1, 2, 0, 1, 2, 1, 0, 0};  // expert 0 picked 4 times
  const DispatchPlan plan = plan_dispatch(picks, 5, 2, 3, {.capacity_factor = 0.9});
  ASSERT_GT(plan.dropped, 0);
  const TensorD x = random_tensor({5, 3}, gen), w = random_tensor({5, 2}, gen),
                scale = random_tensor({plan.rows(), 3}, gen), r = random_tensor({5, 3}, gen);
  const TensorD grouped = TensorD::empty({plan.rows(), 3}), y = TensorD::empty({5, 3});
  // L = sum(combine(permute(x) * scale, w) * r): both permutations and the weights.
  auto loss = [&] {
    permute_tokens(plan, x, grouped);
    for (std::int64_t i = 0; i < grouped.numel(); ++i)
      grouped.data()[i] *= scale.data()[i];
    combine_tokens(plan, grouped, w, y);
    return dot(y, r);
  };
  loss();
  const TensorD dgrouped = TensorD::empty(grouped.shape()), dw = TensorD::empty(w.shape()),
                dx = TensorD::empty(x.shape());
  combine_tokens_backward(plan, grouped, w, r, dgrouped, dw);
  for (std::int64_t i = 0; i < dgrouped.numel(); ++i)
    dgrouped.data()[i] *= scale.data()[i];
  permute_tokens_backward(plan, dgrouped, dx);
  expect_gradient("dx", x, loss, dx);
  expect_gradient("dweight", w, loss, dw);
}

class ExpertsGradient : public ::testing::TestWithParam<ExpertActivation> {};

TEST_P(ExpertsGradient, MatchesFiniteDifferences) {
  const ExpertActivation act = GetParam();
  std::mt19937 gen(5);
  const std::int64_t E = 3, h = 4, f = 3, f1 = act == ExpertActivation::swiglu ? 2 * f : f;
  const std::vector<std::int64_t> begin{0, 2, 2, 5};  // expert 1 gets no tokens
  const TensorD x = random_tensor({5, h}, gen), w1 = random_tensor({E, f1, h}, gen),
                w2 = random_tensor({E, h, f}, gen), r = random_tensor({5, h}, gen);
  const TensorD pre = TensorD::empty({5, f1}), hid = TensorD::empty({5, f}),
                y = TensorD::empty({5, h});
  auto loss = [&] {
    experts_forward(act, x, std::span<const std::int64_t>(begin), w1, w2, pre, hid, y);
    return dot(y, r);
  };
  loss();
  const TensorD dx = TensorD::empty(x.shape()), dw1 = TensorD::zeros(w1.shape()),
                dw2 = TensorD::zeros(w2.shape());
  experts_backward(act, x, std::span<const std::int64_t>(begin), w1, w2, pre, hid, r, dx, dw1, dw2);
  expect_gradient("dx", x, loss, dx);
  expect_gradient("dw1", w1, loss, dw1);
  expect_gradient("dw2", w2, loss, dw2);
}

// The zero-bubble split: the input half now, the weight half later, adds to the weight gradients
// exactly what the whole backward adds.
TEST_P(ExpertsGradient, InputAndWeightHalvesEqualTheWholeBackward) {
  const ExpertActivation act = GetParam();
  std::mt19937 gen(9);
  const std::int64_t E = 2, h = 4, f = 3, f1 = act == ExpertActivation::swiglu ? 2 * f : f;
  const std::vector<std::int64_t> begin{0, 3, 4};
  const std::span<const std::int64_t> groups(begin);
  const TensorD x = random_tensor({4, h}, gen), w1 = random_tensor({E, f1, h}, gen),
                w2 = random_tensor({E, h, f}, gen), dy = random_tensor({4, h}, gen);
  const TensorD pre = TensorD::empty({4, f1}), hid = TensorD::empty({4, f}),
                y = TensorD::empty({4, h});
  experts_forward(act, x, groups, w1, w2, pre, hid, y);
  const TensorD start1 = random_tensor(w1.shape(), gen), start2 = random_tensor(w2.shape(), gen);
  const TensorD dx = TensorD::empty(x.shape()), dw1 = TensorD::empty(w1.shape()),
                dw2 = TensorD::empty(w2.shape());
  dw1.copy_from(start1);
  dw2.copy_from(start2);
  experts_backward(act, x, groups, w1, w2, pre, hid, dy, dx, dw1, dw2);
  const TensorD dx_half = TensorD::empty(x.shape()), d_pre = TensorD::empty(pre.shape()),
                dw1_half = TensorD::empty(w1.shape()), dw2_half = TensorD::empty(w2.shape());
  dw1_half.copy_from(start1);
  dw2_half.copy_from(start2);
  experts_backward_input(act, x, groups, w1, w2, pre, hid, dy, dx_half, d_pre);
  experts_backward_weight(x, groups, hid, dy, d_pre, dw1_half, dw2_half);
  EXPECT_EQ(dx_half.to_vector(), dx.to_vector());
  EXPECT_EQ(dw1_half.to_vector(), dw1.to_vector());
  EXPECT_EQ(dw2_half.to_vector(), dw2.to_vector());
  const std::vector<std::int64_t> short_groups{0, 4};
  EXPECT_THROW(experts_backward_weight(x, std::span<const std::int64_t>(short_groups), hid, dy,
                                       d_pre, dw1_half, dw2_half),
               std::invalid_argument);
}

INSTANTIATE_TEST_SUITE_P(Activations, ExpertsGradient,
                         ::testing::Values(ExpertActivation::gelu_tanh, ExpertActivation::gelu_erf,
                                           ExpertActivation::swiglu));

}  // namespace
}  // namespace weave::ops
