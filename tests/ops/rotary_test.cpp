// Rotary position embeddings: values worked out by hand, the rotation as a complex product,
// finite differences, the inverse, and positions per row.
#include <gtest/gtest.h>

#include <cmath>
#include <complex>
#include <random>
#include <vector>

#include "gradient_check.hpp"
#include "weave/ops/rotary.hpp"

namespace weave::ops {
namespace {

using testing::dot;
using testing::expect_gradient;
using testing::random_tensor;
using testing::TensorD;

TEST(Rotary, RotatesPairsByPositionTimesFrequency) {
  // One head of 4 dimensions at position 1, base 10000: pairs (0, 2) turn by 1 radian and
  // (1, 3) by 10000^(-1/2) = 0.01.
  TensorD x = TensorD::empty({1, 1, 1, 4});
  for (int c = 0; c < 4; ++c)
    x.data()[c] = c + 1;
  const std::vector<std::int64_t> position{1};
  rotary_forward<double>({.head_dim = 4, .rotary_dims = 4, .base = 10000}, x, position);
  EXPECT_NEAR(x.data()[0], 1 * std::cos(1.0) - 3 * std::sin(1.0), 1e-15);
  EXPECT_NEAR(x.data()[2], 3 * std::cos(1.0) + 1 * std::sin(1.0), 1e-15);
  EXPECT_NEAR(x.data()[1], 2 * std::cos(0.01) - 4 * std::sin(0.01), 1e-15);
  EXPECT_NEAR(x.data()[3], 4 * std::cos(0.01) + 2 * std::sin(0.01), 1e-15);
}

// Each pair (i, i + r/2) is the complex number x_i + i x_{i+r/2} times e^{i p theta_i}; the
// dimensions past rotary_dims stay as they were. Two query heads side by side, per row position.
TEST(Rotary, EqualsAComplexProductOnTheRotatedDimensionsOnly) {
  std::mt19937 gen(1);
  const std::int64_t S = 5, B = 2, N = 3, d = 8, heads = 2, r = 4;
  const double base = 500;
  const TensorD x = random_tensor({S, B, N, heads * d}, gen), y = x.clone();
  const std::vector<std::int64_t> positions{7, 0, 3, 100, 41};
  rotary_forward<double>({.head_dim = d, .rotary_dims = r, .base = base}, y, positions);
  for (std::int64_t s = 0; s < S; ++s)
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t n = 0; n < N; ++n)
        for (std::int64_t head = 0; head < heads; ++head) {
          const std::int64_t at = head * d;
          for (std::int64_t i = 0; i < r / 2; ++i) {
            const double theta = positions[s] * std::pow(base, -2.0 * i / r);
            const std::complex<double> z(x(s, b, n, at + i), x(s, b, n, at + i + r / 2));
            const std::complex<double> w = z * std::polar(1.0, theta);
            EXPECT_NEAR(y(s, b, n, at + i), w.real(), 1e-12);
            EXPECT_NEAR(y(s, b, n, at + i + r / 2), w.imag(), 1e-12);
          }
          for (std::int64_t i = r; i < d; ++i)
            EXPECT_EQ(y(s, b, n, at + i), x(s, b, n, at + i));
        }
}

TEST(Rotary, BackwardIsTheGradientAndUndoesTheForward) {
  std::mt19937 gen(2);
  const RotarySpec spec{.head_dim = 6, .rotary_dims = 4, .base = 10000};
  const std::vector<std::int64_t> positions{3, 9, 1000};
  const TensorD x = random_tensor({3, 2, 2, 6}, gen), r = random_tensor({3, 2, 2, 6}, gen);
  auto loss = [&] {
    const TensorD y = x.clone();
    rotary_forward<double>(spec, y, positions);
    return dot(y, r);
  };
  const TensorD grad = r.clone();
  rotary_backward<double>(spec, grad, positions);
  expect_gradient("dx", x, loss, grad, 1e-8);
  const TensorD y = x.clone();
  rotary_forward<double>(spec, y, positions);
  rotary_backward<double>(spec, y, positions);
  const auto a = y.to_vector(), b = x.to_vector();
  for (std::size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(a[i], b[i], 1e-12);
}

TEST(Rotary, BadArgumentsAreNamed) {
  const TensorD x = TensorD::zeros({2, 1, 1, 6});
  const std::vector<std::int64_t> two{0, 1}, one{0};
  EXPECT_THROW(rotary_forward<double>({.head_dim = 4, .rotary_dims = 4}, x, two),
               std::invalid_argument);  // 6 is no whole number of 4-dimensional heads
  EXPECT_THROW(rotary_forward<double>({.head_dim = 6, .rotary_dims = 3}, x, two),
               std::invalid_argument);  // odd
  EXPECT_THROW(rotary_forward<double>({.head_dim = 6, .rotary_dims = 8}, x, two),
               std::invalid_argument);  // more than the head
  try {
    rotary_forward<double>({.head_dim = 6, .rotary_dims = 6}, x, one);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("1 positions for 2 sequence rows"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace weave::ops
