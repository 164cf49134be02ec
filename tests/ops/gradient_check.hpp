// Central finite differences in double precision against a kernel's backward.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <string>

#include "weave/ops/tensor.hpp"

namespace weave::ops::testing {

using TensorD = BasicTensor<double>;

inline TensorD random_tensor(const Shape& shape, std::mt19937& gen, double lo = -1, double hi = 1) {
  TensorD t = TensorD::empty(shape);
  std::uniform_real_distribution<double> dist(lo, hi);
  for (std::int64_t i = 0; i < t.numel(); ++i)
    t.data()[i] = dist(gen);
  return t;
}

inline double dot(const TensorD& a, const TensorD& b) {
  const auto x = a.to_vector(), y = b.to_vector();
  double s = 0;
  for (std::size_t i = 0; i < x.size(); ++i)
    s += x[i] * y[i];
  return s;
}

// For every element of `input` (a contiguous tensor the loss reads), compares `analytic` with
// (loss(x + h) - loss(x - h)) / 2h. `loss` recomputes the forward from the current values.
inline void expect_gradient(const std::string& what, const TensorD& input,
                            const std::function<double()>& loss, const TensorD& analytic,
                            double tolerance = 1e-6, double h = 1e-5) {
  ASSERT_EQ(input.numel(), analytic.numel()) << what;
  const auto grad = analytic.to_vector();
  for (std::int64_t i = 0; i < input.numel(); ++i) {
    double& x = input.data()[i];
    const double saved = x;
    x = saved + h;
    const double up = loss();
    x = saved - h;
    const double down = loss();
    x = saved;
    const double numeric = (up - down) / (2 * h);
    EXPECT_NEAR(grad[static_cast<std::size_t>(i)], numeric,
                tolerance * std::max(1.0, std::abs(numeric)))
        << what << " element " << i;
  }
}

}  // namespace weave::ops::testing
