// Sinkhorn balancing of routing logits (MindSpeed's gate with --moe-use-sinkhorn): the balance it
// reaches, a case solved by hand, and its gradient through the rounds against finite differences.
#include "weave/ops/sinkhorn.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "gradient_check.hpp"

namespace weave::ops {
namespace {

using testing::TensorD;

TEST(Sinkhorn, BalancesColumnsToOneOverExpertsAndRowsToOneOverTokens) {
  std::mt19937 gen(7);
  const TensorD logits = testing::random_tensor({6, 4}, gen, -2, 2);
  const TensorD out = TensorD::empty({6, 4});
  const int rounds = sinkhorn_forward(logits, out, 1e-7);
  EXPECT_GT(rounds, 1);
  for (std::int64_t e = 0; e < 4; ++e) {
    double column = 0;
    for (std::int64_t t = 0; t < 6; ++t)
      column += out.row(t)[e];
    EXPECT_NEAR(column, 1.0 / 4, 1e-7) << "expert " << e;
  }
  for (std::int64_t t = 0; t < 6; ++t) {
    double row = 0;
    for (std::int64_t e = 0; e < 4; ++e)
      row += out.row(t)[e];
    EXPECT_NEAR(row, 1.0 / 6, 1e-6) << "token " << t;
  }
  // Scaling a token's or an expert's logits by a constant factor of exp: the same balance.
  const TensorD shifted = TensorD::empty({6, 4}), again = TensorD::empty({6, 4});
  for (std::int64_t t = 0; t < 6; ++t)
    for (std::int64_t e = 0; e < 4; ++e)
      shifted.row(t)[e] = logits.row(t)[e] + (t == 2 ? 0.7 : 0.0) + (e == 1 ? -0.3 : 0.0);
  sinkhorn_forward(shifted, again, 1e-7);
  for (std::int64_t i = 0; i < out.numel(); ++i)
    EXPECT_NEAR(again.data()[i], out.data()[i], 1e-6) << i;
}

// One token: d0 = 1 / (sum_e C), then d1[e] = (1/E) / (d0 C[e]), so every output is 1 / E (up to
// eps) after the first round, and the second round changes nothing: two rounds.
TEST(Sinkhorn, OneTokenIsSpreadEvenlyInTwoRounds) {
  const TensorD logits = TensorD::empty({1, 3});
  logits.data()[0] = 0.5;
  logits.data()[1] = -1.0;
  logits.data()[2] = 2.0;
  const TensorD out = TensorD::empty({1, 3});
  EXPECT_EQ(sinkhorn_forward(logits, out), 2);
  for (int e = 0; e < 3; ++e)
    EXPECT_NEAR(out.data()[e], 1.0 / 3, 1e-7) << e;
}

TEST(Sinkhorn, GradientThroughTheRoundsMatchesFiniteDifferences) {
  std::mt19937 gen(11);
  const TensorD logits = testing::random_tensor({5, 3}, gen, -1.5, 1.5);
  const TensorD weights = testing::random_tensor({5, 3}, gen);
  const TensorD out = TensorD::empty({5, 3});
  const auto loss = [&] {
    sinkhorn_forward(logits, out);  // the steps below keep its round count
    return testing::dot(out, weights);
  };
  const TensorD d_logits = TensorD::empty({5, 3});
  sinkhorn_backward(logits, weights, d_logits);
  testing::expect_gradient("sinkhorn logits", logits, loss, d_logits, 1e-6);
  // The float kernel's gradient follows the same rounds.
  const Tensor logits32 = Tensor::empty({5, 3}), weights32 = Tensor::empty({5, 3});
  for (std::int64_t i = 0; i < 15; ++i) {
    logits32.data()[i] = static_cast<float>(logits.data()[i]);
    weights32.data()[i] = static_cast<float>(weights.data()[i]);
  }
  const Tensor d32 = Tensor::empty({5, 3});
  sinkhorn_backward(logits32, weights32, d32);
  for (std::int64_t i = 0; i < 15; ++i)
    EXPECT_NEAR(d32.data()[i], d_logits.data()[i],
                2e-3 * std::max(1.0, std::abs(d_logits.data()[i])))
        << i;
}

TEST(Sinkhorn, NonFiniteLogitsStopWithAnError) {
  const Tensor logits = Tensor::empty({2, 2}), out = Tensor::empty({2, 2});
  logits.fill(0.f);
  logits.data()[1] = std::numeric_limits<float>::quiet_NaN();
  try {
    sinkhorn_forward(logits, out);
    FAIL() << "a NaN logit converged";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("sinkhorn routing did not converge"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(sinkhorn_forward(logits, Tensor::empty({2, 3})), std::invalid_argument);
}

}  // namespace
}  // namespace weave::ops
