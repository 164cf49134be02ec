// The DeepSpeed-style gate (MindSpeed's deepspeed_moe gate) against a reference written here from
// that gate's definition in dense form: one-hot masks of each token's first and second choice,
// each expert's buffer locations as running counts (second choices after all first choices),
// picks at a location >= capacity dropped, the kept probabilities renormalised (top-2), and the
// load-balancing loss from the mean probabilities and the first choices' shares. Top-1 keeps each
// expert's earliest tokens. The backward is checked against finite differences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gradient_check.hpp"
#include "weave/ops/deepspeed_gate.hpp"
#include "weave/ops/router.hpp"

namespace weave::ops {
namespace {

using testing::dot;
using testing::expect_gradient;
using testing::random_tensor;
using testing::TensorD;

// The reference's outcome: per token and pick, the expert, whether it is kept, its buffer
// location and its combine weight; the capacity and the loss.
struct Reference {
  std::vector<int> expert, location;
  std::vector<bool> kept;
  std::vector<double> weight;
  std::int64_t capacity = 0;
  double loss = 0;
};

Reference reference_gate(const std::vector<std::vector<double>>& logits, int k, double factor,
                         double coeff) {
  const auto S = static_cast<std::int64_t>(logits.size());
  const auto E = static_cast<std::int64_t>(logits[0].size());
  std::vector<std::vector<double>> p(logits.size(), std::vector<double>(E));
  for (std::int64_t t = 0; t < S; ++t) {
    const double m = *std::max_element(logits[t].begin(), logits[t].end());
    double z = 0;
    for (std::int64_t e = 0; e < E; ++e)
      z += std::exp(logits[t][e] - m);
    for (std::int64_t e = 0; e < E; ++e)
      p[t][e] = std::exp(logits[t][e] - m) / z;
  }
  Reference r;
  // ceil(S / E * k * f) in single precision, at least 4, at most S when not raised.
  const float raw =
      std::ceil(static_cast<float>(double(S) / double(E)) * static_cast<float>(k * factor));
  r.capacity = raw < 4 ? 4 : std::min<std::int64_t>(static_cast<std::int64_t>(raw), S);
  // The first and second choice of each token (no ties in these inputs).
  std::vector<int> first(S), second(S, -1);
  for (std::int64_t t = 0; t < S; ++t) {
    first[t] = static_cast<int>(std::max_element(p[t].begin(), p[t].end()) - p[t].begin());
    if (k == 2) {
      std::vector<double> rest = p[t];
      rest[first[t]] = -1;
      second[t] = static_cast<int>(std::max_element(rest.begin(), rest.end()) - rest.begin());
    }
  }
  // Locations: running count of each expert's first choices, then its second choices after all
  // of its first choices.
  std::vector<int> firsts(E, 0), seconds(E, 0);
  std::vector<int> location1(S), location2(S, -1);
  for (std::int64_t t = 0; t < S; ++t)
    location1[t] = firsts[first[t]]++;
  for (std::int64_t t = 0; t < S; ++t)
    if (k == 2) location2[t] = firsts[second[t]] + seconds[second[t]]++;
  // The loss: coeff * E * E * mean_e(me * ce), me the mean probability, ce the first choices'
  // share.
  double mean = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    double me = 0;
    for (std::int64_t t = 0; t < S; ++t)
      me += p[t][e] / S;
    mean += me * (static_cast<double>(firsts[e]) / S) / E;
  }
  r.loss = k == 2 ? coeff * mean * E * E : 0;
  for (std::int64_t t = 0; t < S; ++t) {
    const bool keep1 = location1[t] < r.capacity;
    const bool keep2 = k == 2 && location2[t] < r.capacity;
    double w1 = keep1 ? p[t][first[t]] : 0, w2 = keep2 ? p[t][second[t]] : 0;
    if (k == 2) {
      const double denominator = std::max(w1 + w2, std::numeric_limits<double>::epsilon());
      w1 /= denominator;
      w2 /= denominator;
    }
    r.expert.push_back(first[t]);
    r.location.push_back(location1[t]);
    r.kept.push_back(keep1);
    r.weight.push_back(w1);
    if (k == 2) {
      r.expert.push_back(second[t]);
      r.location.push_back(location2[t]);
      r.kept.push_back(keep2);
      r.weight.push_back(w2);
    }
  }
  return r;
}

struct Case {
  const char* name;
  int top_k;
  double factor;
  std::int64_t tokens;
  double skew;  // added to expert 0's logits: crowds it so that it drops
  bool drops;
};

class GateAgainstReference : public ::testing::TestWithParam<Case> {};

TEST_P(GateAgainstReference, PicksDropsWeightsAndLoss) {
  const Case c = GetParam();
  const std::int64_t E = 4;
  std::mt19937 gen(7);
  TensorD logits = random_tensor({c.tokens, E}, gen, -2, 2);
  std::vector<std::vector<double>> rows(c.tokens, std::vector<double>(E));
  for (std::int64_t t = 0; t < c.tokens; ++t)
    for (std::int64_t e = 0; e < E; ++e)
      rows[t][e] = logits.row(t)[e] += (e == 0 ? c.skew : 0.0);
  const Reference want = reference_gate(rows, c.top_k, c.factor, 0.1);

  const TensorD probs = TensorD::empty({c.tokens, E}), w = TensorD::empty({c.tokens, c.top_k});
  std::vector<std::int32_t> index(static_cast<std::size_t>(c.tokens * c.top_k));
  router_forward(RouterOptions{.top_k = c.top_k, .renormalize = false}, logits, probs,
                 std::span(index), w);
  const std::int64_t capacity = gate_capacity(c.tokens, E, c.top_k, c.factor);
  EXPECT_EQ(capacity, want.capacity);
  const DispatchPlan plan = plan_dispatch(index, c.tokens, c.top_k, E,
                                          {.capacity = capacity, .first_choices_first = true});
  gate_weights_after_drops(plan, w);
  std::int64_t dropped = 0;
  for (std::size_t i = 0; i < index.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "token " << i / c.top_k << " pick " << i % c.top_k);
    EXPECT_EQ(index[i], want.expert[i]);
    EXPECT_EQ(plan.pick_row[i] >= 0, want.kept[i]);
    EXPECT_NEAR(w.data()[i], want.weight[i], 1e-12);
    if (!want.kept[i]) {
      ++dropped;
      continue;
    }
    // The pick sits at its buffer location within its expert's rows.
    EXPECT_EQ(plan.pick_row[i], plan.expert_begin[index[i]] + want.location[i]);
  }
  EXPECT_EQ(plan.dropped, dropped);
  EXPECT_EQ(dropped > 0, c.drops);
  EXPECT_NEAR(c.top_k == 2 ? gate_balance_loss(probs, index, c.top_k, 0.1) : 0.0, want.loss, 1e-12);
}

const Case kCases[] = {
    {"top1_drops", 1, 1.0, 24, 2.5, true},
    {"top1_no_drop", 1, 4.0, 24, 2.5, false},
    {"top2_drops", 2, 1.0, 24, 2.5, true},
    {"top2_no_drop", 2, 2.0, 24, 0.0, false},
    {"top2_capacity_raised_to_the_minimum", 2, 0.25, 8, 2.5, true},
};

INSTANTIATE_TEST_SUITE_P(Gate, GateAgainstReference, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(GateCapacity, MinimumThenMaximum) {
  EXPECT_EQ(gate_capacity(64, 8, 2, 1.0), 16);  // 64 / 8 * 2
  EXPECT_EQ(gate_capacity(64, 8, 1, 1.3), 11);  // ceil(8 * 1.3)
  EXPECT_EQ(gate_capacity(8, 8, 1, 1.0), 4);    // raised to the minimum
  EXPECT_EQ(gate_capacity(2, 8, 2, 1.0), 4);    // raised, and not lowered back to 2 tokens
  EXPECT_EQ(gate_capacity(16, 2, 2, 4.0), 16);  // at most the call's tokens
  EXPECT_THROW(gate_capacity(16, 2, 2, 0.0), std::invalid_argument);
}

class GateGradient : public ::testing::TestWithParam<int> {};

TEST_P(GateGradient, MatchesFiniteDifferences) {
  const int k = GetParam();
  const std::int64_t T = 12, E = 4;
  std::mt19937 gen(3);
  TensorD logits = random_tensor({T, E}, gen, -2, 2);
  for (std::int64_t t = 0; t < T; ++t)
    logits.row(t)[0] += 1.5;  // some picks dropped at capacity 4 (top-1) / 6 (top-2)
  const TensorD r = random_tensor({T, k}, gen);
  const TensorD probs = TensorD::empty({T, E}), w = TensorD::empty({T, k});
  std::vector<std::int32_t> index(static_cast<std::size_t>(T * k));
  const double balance = 0.7;
  DispatchPlan plan;
  // L = sum(w * r) + balance * loss, with the picks and drops held fixed under the small
  // perturbation.
  auto loss = [&] {
    router_forward(RouterOptions{.top_k = k, .renormalize = false}, logits, probs, std::span(index),
                   w);
    plan = plan_dispatch(index, T, k, E,
                         {.capacity = gate_capacity(T, E, k, 1.0), .first_choices_first = true});
    gate_weights_after_drops(plan, w);
    return dot(w, r) + balance * gate_balance_loss(probs, index, k, 1.0);
  };
  loss();
  ASSERT_GT(plan.dropped, 0);
  const TensorD dlogits = TensorD::empty({T, E});
  gate_backward(plan, probs, index, r, balance, dlogits);
  expect_gradient("gate logits", logits, loss, dlogits);
}

INSTANTIATE_TEST_SUITE_P(Gate, GateGradient, ::testing::Values(1, 2),
                         [](const auto& info) { return "top" + std::to_string(info.param); });

}  // namespace
}  // namespace weave::ops
