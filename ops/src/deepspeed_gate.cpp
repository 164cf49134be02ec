#include "weave/ops/deepspeed_gate.hpp"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

namespace weave::ops {

std::int64_t gate_capacity(std::int64_t tokens, std::int64_t experts, int top_k,
                           double capacity_factor, std::int64_t min_capacity) {
  if (!(capacity_factor > 0) || top_k < 1 || experts < 1 || tokens < 0)
    throw std::invalid_argument(fmt::format(
        "gate capacity: needs a factor > 0, top-k >= 1 and experts >= 1, got factor {}, top-{}, "
        "{} experts",
        capacity_factor, top_k, experts));
  // The gate multiplies a double ratio by a single-precision factor (top_k * factor) and rounds
  // up in single precision.
  const float ratio =
      static_cast<float>(static_cast<double>(tokens) / static_cast<double>(experts));
  const float factor = static_cast<float>(top_k * capacity_factor);
  const auto capacity = static_cast<std::int64_t>(std::ceil(ratio * factor));
  if (capacity < min_capacity) return min_capacity;
  return capacity > tokens ? tokens : capacity;
}

namespace {

template <typename T>
void check_picks(const DispatchPlan& plan, const BasicTensor<T>& t, std::string_view what) {
  check_rows(what, t);
  check_shape(what, t.shape(), Shape{plan.tokens, plan.top_k});
  if (plan.top_k > 2)
    throw std::invalid_argument(
        fmt::format("the DeepSpeed-style gate routes top-1 or top-2, got top-{}", plan.top_k));
}

bool kept(const DispatchPlan& plan, std::int64_t token, std::int64_t s) {
  return plan.pick_row[static_cast<std::size_t>(token * plan.top_k + s)] >= 0;
}

}  // namespace

template <typename T>
void gate_weights_after_drops(const DispatchPlan& plan, const BasicTensor<T>& topk_weight) {
  check_picks(plan, topk_weight, "gate weights");
  const std::int64_t k = plan.top_k;
  for (std::int64_t t = 0; t < plan.tokens; ++t) {
    T* w = topk_weight.row(t);
    T sum = 0;
    for (std::int64_t s = 0; s < k; ++s) {
      if (!kept(plan, t, s)) w[s] = 0;
      sum += w[s];
    }
    if (k == 1) continue;
    const T denominator = std::max(sum, std::numeric_limits<T>::epsilon());
    for (std::int64_t s = 0; s < k; ++s)
      w[s] /= denominator;
  }
}

template <typename T>
double gate_balance_loss(const BasicTensor<T>& probs, std::span<const std::int32_t> topk_index,
                         int top_k, double coeff) {
  check_rows("gate probabilities", probs);
  const std::int64_t t = probs.dim(0), e = probs.dim(1);
  if (t == 0) return 0;
  std::vector<double> mean_probability(static_cast<std::size_t>(e), 0.0),
      first_share(static_cast<std::size_t>(e), 0.0);
  for (std::int64_t i = 0; i < t; ++i) {
    const T* p = probs.row(i);
    for (std::int64_t j = 0; j < e; ++j)
      mean_probability[j] += static_cast<double>(p[j]) / static_cast<double>(t);
    first_share[static_cast<std::size_t>(topk_index[i * top_k])] += 1.0 / static_cast<double>(t);
  }
  double sum = 0;
  for (std::int64_t j = 0; j < e; ++j)
    sum += mean_probability[j] * first_share[j];
  return coeff * static_cast<double>(e) * sum;
}

template <typename T>
void gate_backward(const DispatchPlan& plan, const BasicTensor<T>& probs,
                   std::span<const std::int32_t> topk_index, const BasicTensor<T>& d_topk_weight,
                   double balance_scale, const BasicTensor<T>& dlogits) {
  check_picks(plan, d_topk_weight, "gate weight gradient");
  check_rows("gate logits gradient", dlogits);
  check_shape("gate logits gradient", dlogits.shape(), probs.shape());
  const std::int64_t t = probs.dim(0), e = probs.dim(1), k = plan.top_k;
  // d loss / d p[i, j] = scale * E * (first choices of j) / t^2, the same for every token.
  std::vector<double> first(static_cast<std::size_t>(e), 0.0);
  for (std::int64_t i = 0; i < t; ++i)
    first[static_cast<std::size_t>(topk_index[i * k])] += 1;
  std::vector<T> dp(static_cast<std::size_t>(e));
  for (std::int64_t i = 0; i < t; ++i) {
    const T* p = probs.row(i);
    const T* dw = d_topk_weight.row(i);
    for (std::int64_t j = 0; j < e; ++j)
      dp[j] = static_cast<T>(balance_scale * static_cast<double>(e) * first[j] /
                             (static_cast<double>(t) * static_cast<double>(t)));
    if (k == 1) {
      if (kept(plan, i, 0)) dp[topk_index[i]] += dw[0];
    } else {
      // w_s = p_s / D over the kept picks, D = max(sum of kept p, eps).
      T sum = 0, dot = 0;
      for (std::int64_t s = 0; s < k; ++s)
        if (kept(plan, i, s)) sum += p[topk_index[i * k + s]];
      const T eps = std::numeric_limits<T>::epsilon();
      const T denominator = std::max(sum, eps);
      for (std::int64_t s = 0; s < k; ++s)
        if (kept(plan, i, s)) dot += dw[s] * p[topk_index[i * k + s]] / denominator;
      for (std::int64_t s = 0; s < k; ++s)
        if (kept(plan, i, s))
          dp[topk_index[i * k + s]] += (dw[s] - (sum > eps ? dot : T(0))) / denominator;
    }
    T inner = 0;
    for (std::int64_t j = 0; j < e; ++j)
      inner += dp[j] * p[j];
    T* g = dlogits.row(i);
    for (std::int64_t j = 0; j < e; ++j)
      g[j] = p[j] * (dp[j] - inner);
  }
}

template void gate_weights_after_drops(const DispatchPlan&, const BasicTensor<float>&);
template void gate_weights_after_drops(const DispatchPlan&, const BasicTensor<double>&);
template double gate_balance_loss(const BasicTensor<float>&, std::span<const std::int32_t>, int,
                                  double);
template double gate_balance_loss(const BasicTensor<double>&, std::span<const std::int32_t>, int,
                                  double);
template void gate_backward(const DispatchPlan&, const BasicTensor<float>&,
                            std::span<const std::int32_t>, const BasicTensor<float>&, double,
                            const BasicTensor<float>&);
template void gate_backward(const DispatchPlan&, const BasicTensor<double>&,
                            std::span<const std::int32_t>, const BasicTensor<double>&, double,
                            const BasicTensor<double>&);

}  // namespace weave::ops
