#include "weave/ops/sinkhorn.hpp"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>
#include <vector>

namespace weave::ops {

namespace {

// The forward's rounds: C and every round's scales (round 0's d1 is the ones it starts from).
struct SinkhornRounds {
  std::int64_t tokens = 0, experts = 0;
  std::vector<double> cost;                 // C = exp(logits), row-major [t, e]
  std::vector<std::vector<double>> d0, d1;  // d0[i] for rounds 1..n at index i - 1; d1[0..n]
  double at(std::int64_t t, std::int64_t e) const {
    return cost[static_cast<std::size_t>(t * experts + e)];
  }
};

template <typename T>
SinkhornRounds run_rounds(const BasicTensor<T>& logits, double tolerance) {
  check_rows("sinkhorn logits", logits);
  SinkhornRounds r;
  r.experts = logits.dim(-1);
  r.tokens = logits.rows();
  r.cost.resize(static_cast<std::size_t>(r.tokens * r.experts));
  for (std::int64_t t = 0; t < r.tokens; ++t)
    for (std::int64_t e = 0; e < r.experts; ++e)
      r.cost[static_cast<std::size_t>(t * r.experts + e)] =
          std::exp(static_cast<double>(logits.row(t)[e]));
  r.d1.emplace_back(static_cast<std::size_t>(r.experts), 1.0);
  const double per_token = 1.0 / static_cast<double>(r.tokens);
  const double per_expert = 1.0 / static_cast<double>(r.experts);
  double change = 0;
  for (int round = 1; round <= kSinkhornMaxRounds; ++round) {
    const std::vector<double>& before = r.d1.back();
    std::vector<double> d0(static_cast<std::size_t>(r.tokens));
    for (std::int64_t t = 0; t < r.tokens; ++t) {
      double s = 0;
      for (std::int64_t e = 0; e < r.experts; ++e)
        s += before[static_cast<std::size_t>(e)] * r.at(t, e);
      d0[static_cast<std::size_t>(t)] = per_token / (s + kSinkhornEpsilon);
    }
    std::vector<double> d1(static_cast<std::size_t>(r.experts), 0.0);
    for (std::int64_t t = 0; t < r.tokens; ++t)
      for (std::int64_t e = 0; e < r.experts; ++e)
        d1[static_cast<std::size_t>(e)] += d0[static_cast<std::size_t>(t)] * r.at(t, e);
    change = 0;
    for (std::int64_t e = 0; e < r.experts; ++e) {
      double& v = d1[static_cast<std::size_t>(e)];
      v = per_expert / (v + kSinkhornEpsilon);
      change += std::abs(before[static_cast<std::size_t>(e)] - v);
    }
    change /= static_cast<double>(r.experts);
    r.d0.push_back(std::move(d0));
    r.d1.push_back(std::move(d1));
    if (!(change > tolerance)) {
      if (std::isnan(change)) break;
      return r;
    }
  }
  throw std::runtime_error(fmt::format(
      "sinkhorn routing did not converge: the expert scales still moved by {} a round after {} "
      "rounds (tolerance {}); the gate's logits must be finite and of moderate size",
      change, r.d0.size(), tolerance));
}

}  // namespace

template <typename T>
int sinkhorn_forward(const BasicTensor<T>& logits, const BasicTensor<T>& out, double tolerance) {
  check_rows("sinkhorn output", out);
  check_shape("sinkhorn output", out.shape(), logits.shape());
  const SinkhornRounds r = run_rounds(logits, tolerance);
  const std::vector<double>& d0 = r.d0.back();
  const std::vector<double>& d1 = r.d1.back();
  for (std::int64_t t = 0; t < r.tokens; ++t)
    for (std::int64_t e = 0; e < r.experts; ++e)
      out.row(t)[e] = static_cast<T>(d0[static_cast<std::size_t>(t)] * r.at(t, e) *
                                     d1[static_cast<std::size_t>(e)]);
  return static_cast<int>(r.d0.size());
}

template <typename T>
void sinkhorn_backward(const BasicTensor<T>& logits, const BasicTensor<T>& d_out,
                       const BasicTensor<T>& d_logits, double tolerance) {
  check_rows("sinkhorn output gradient", d_out);
  check_rows("sinkhorn logits gradient", d_logits);
  check_shape("sinkhorn output gradient", d_out.shape(), logits.shape());
  check_shape("sinkhorn logits gradient", d_logits.shape(), logits.shape());
  const SinkhornRounds r = run_rounds(logits, tolerance);
  const std::int64_t T_ = r.tokens, E = r.experts;
  const auto ut = [](std::int64_t i) { return static_cast<std::size_t>(i); };
  std::vector<double> d_cost(ut(T_ * E), 0.0), g0(ut(T_), 0.0), g1(ut(E), 0.0);
  // out = d0[t] C[t, e] d1[e] with the last round's scales.
  {
    const std::vector<double>& d0 = r.d0.back();
    const std::vector<double>& d1 = r.d1.back();
    for (std::int64_t t = 0; t < T_; ++t)
      for (std::int64_t e = 0; e < E; ++e) {
        const double g = static_cast<double>(d_out.row(t)[e]);
        d_cost[ut(t * E + e)] += g * d0[ut(t)] * d1[ut(e)];
        g0[ut(t)] += g * r.at(t, e) * d1[ut(e)];
        g1[ut(e)] += g * r.at(t, e) * d0[ut(t)];
      }
  }
  // Rounds backwards: d1_i = (1/E) / (s1 + eps) has d d1_i / d s1 = -E d1_i^2, and d0_i likewise
  // -T d0_i^2; the change that ends the loop carries no gradient.
  for (std::size_t i = r.d0.size(); i >= 1; --i) {
    const std::vector<double>& d0 = r.d0[i - 1];
    const std::vector<double>& d1 = r.d1[i];
    const std::vector<double>& d1_before = r.d1[i - 1];
    std::vector<double> s1_grad(ut(E));
    for (std::int64_t e = 0; e < E; ++e)
      s1_grad[ut(e)] = -g1[ut(e)] * static_cast<double>(E) * d1[ut(e)] * d1[ut(e)];
    for (std::int64_t t = 0; t < T_; ++t)
      for (std::int64_t e = 0; e < E; ++e) {
        g0[ut(t)] += s1_grad[ut(e)] * r.at(t, e);
        d_cost[ut(t * E + e)] += s1_grad[ut(e)] * d0[ut(t)];
      }
    std::fill(g1.begin(), g1.end(), 0.0);
    for (std::int64_t t = 0; t < T_; ++t) {
      const double s0_grad = -g0[ut(t)] * static_cast<double>(T_) * d0[ut(t)] * d0[ut(t)];
      for (std::int64_t e = 0; e < E; ++e) {
        g1[ut(e)] += s0_grad * r.at(t, e);
        d_cost[ut(t * E + e)] += s0_grad * d1_before[ut(e)];
      }
    }
    std::fill(g0.begin(), g0.end(), 0.0);
  }
  for (std::int64_t t = 0; t < T_; ++t)
    for (std::int64_t e = 0; e < E; ++e)
      d_logits.row(t)[e] = static_cast<T>(d_cost[ut(t * E + e)] * r.at(t, e));
}

template int sinkhorn_forward(const BasicTensor<float>&, const BasicTensor<float>&, double);
template int sinkhorn_forward(const BasicTensor<double>&, const BasicTensor<double>&, double);
template void sinkhorn_backward(const BasicTensor<float>&, const BasicTensor<float>&,
                                const BasicTensor<float>&, double);
template void sinkhorn_backward(const BasicTensor<double>&, const BasicTensor<double>&,
                                const BasicTensor<double>&, double);

}  // namespace weave::ops
