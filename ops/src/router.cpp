#include "weave/ops/router.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>

namespace weave::ops {

namespace {

template <typename T>
void check_router(const RouterOptions& o, const BasicTensor<T>& logits, const BasicTensor<T>& probs,
                  std::size_t index_size, const BasicTensor<T>& weight) {
  check_rows("router logits", logits);
  if (logits.rank() != 2)
    throw std::invalid_argument(
        fmt::format("router logits must be [tokens, experts], got {}", logits.shape().str()));
  const std::int64_t t = logits.dim(0), e = logits.dim(1);
  if (!(o.topk_scaling_factor > 0) || !std::isfinite(o.topk_scaling_factor))
    throw std::invalid_argument(fmt::format(
        "router top-k scaling factor must be a finite number > 0, got {}", o.topk_scaling_factor));
  if (o.top_k < 1 || o.top_k > e)
    throw std::invalid_argument(fmt::format(
        "router top-k must be between 1 and the number of experts ({}), got {}", e, o.top_k));
  check_rows("router probabilities", probs);
  check_shape("router probabilities", probs.shape(), logits.shape());
  check_rows("router top-k weights", weight);
  check_shape("router top-k weights", weight.shape(), Shape{t, o.top_k});
  if (index_size != static_cast<std::size_t>(t * o.top_k))
    throw std::invalid_argument(
        fmt::format("router: top-k index holds {} entries, need {} x {}", index_size, t, o.top_k));
}

void check_total(const RouterStatistics& total, std::int64_t experts) {
  if (total.tokens <= 0 || static_cast<std::int64_t>(total.assignments.size()) != experts ||
      static_cast<std::int64_t>(total.probability.size()) != experts)
    throw std::invalid_argument(fmt::format(
        "router statistics cover {} tokens and {} experts; need > 0 tokens and {} experts",
        total.tokens, total.assignments.size(), experts));
}

}  // namespace

RouterStatistics& RouterStatistics::operator+=(const RouterStatistics& other) {
  if (assignments.empty()) {
    assignments.assign(other.assignments.size(), 0.0);
    probability.assign(other.probability.size(), 0.0);
  }
  if (other.assignments.size() != assignments.size())
    throw std::invalid_argument(fmt::format("cannot add router statistics of {} and {} experts",
                                            assignments.size(), other.assignments.size()));
  tokens += other.tokens;
  for (std::size_t e = 0; e < assignments.size(); ++e) {
    assignments[e] += other.assignments[e];
    probability[e] += other.probability[e];
  }
  squared_lse += other.squared_lse;
  return *this;
}

template <typename T>
RouterStatistics router_forward(const RouterOptions& o, const BasicTensor<T>& logits,
                                const BasicTensor<T>& probs, std::span<std::int32_t> topk_index,
                                const BasicTensor<T>& topk_weight) {
  check_router(o, logits, probs, topk_index.size(), topk_weight);
  const std::int64_t t = logits.dim(0), e = logits.dim(1), k = o.top_k;
  RouterStatistics stats{t, std::vector<double>(e, 0.0), std::vector<double>(e, 0.0), 0.0};
  std::vector<std::int32_t> order(static_cast<std::size_t>(e));
  for (std::int64_t i = 0; i < t; ++i) {
    const T* x = logits.row(i);
    T* p = probs.row(i);
    const T m = *std::max_element(x, x + e);
    double sum = 0;
    for (std::int64_t j = 0; j < e; ++j)
      sum += (p[j] = std::exp(x[j] - m));
    const double lse = static_cast<double>(m) + std::log(sum);
    stats.squared_lse += lse * lse;
    for (std::int64_t j = 0; j < e; ++j) {
      p[j] = static_cast<T>(p[j] / sum);
      stats.probability[j] += p[j];
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(
        order.begin(), order.begin() + k, order.end(),
        [p](std::int32_t a, std::int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    T* w = topk_weight.row(i);
    T chosen = 0;
    for (std::int64_t s = 0; s < k; ++s) {
      topk_index[i * k + s] = order[s];
      stats.assignments[order[s]] += 1;
      chosen += (w[s] = p[order[s]]);
    }
    if (o.renormalize)
      for (std::int64_t s = 0; s < k; ++s)
        w[s] /= chosen;
    if (o.topk_scaling_factor != 1)
      for (std::int64_t s = 0; s < k; ++s)
        w[s] = static_cast<T>(w[s] * o.topk_scaling_factor);
  }
  return stats;
}

double aux_loss(const RouterOptions& o, const RouterStatistics& total) {
  const auto e = static_cast<std::int64_t>(total.assignments.size());
  check_total(total, e);
  double sum = 0;
  const double tokens = static_cast<double>(total.tokens);
  for (std::int64_t j = 0; j < e; ++j)
    sum += total.assignments[j] / (tokens * o.top_k) * (total.probability[j] / tokens);
  return o.aux_loss_coeff * static_cast<double>(e) * sum;
}

double z_loss(const RouterOptions& o, const RouterStatistics& total) {
  check_total(total, static_cast<std::int64_t>(total.assignments.size()));
  return o.z_loss_coeff * total.squared_lse / static_cast<double>(total.tokens);
}

template <typename T>
void router_backward(const RouterOptions& o, const BasicTensor<T>& logits,
                     const BasicTensor<T>& probs, std::span<const std::int32_t> topk_index,
                     const BasicTensor<T>& topk_weight, const BasicTensor<T>& d_topk_weight,
                     const RouterStatistics& total, double loss_scale,
                     const BasicTensor<T>& dlogits) {
  check_router(o, logits, probs, topk_index.size(), topk_weight);
  check_rows("router top-k weight gradient", d_topk_weight);
  check_shape("router top-k weight gradient", d_topk_weight.shape(), topk_weight.shape());
  check_rows("router logits gradient", dlogits);
  check_shape("router logits gradient", dlogits.shape(), logits.shape());
  const std::int64_t t = logits.dim(0), e = logits.dim(1), k = o.top_k;
  check_total(total, e);
  const double tokens = static_cast<double>(total.tokens);
  // d aux / d p[i, j] = coeff E f_j / tokens, the same for every token.
  std::vector<T> aux_grad(static_cast<std::size_t>(e));
  for (std::int64_t j = 0; j < e; ++j)
    aux_grad[j] = static_cast<T>(loss_scale * o.aux_loss_coeff * static_cast<double>(e) *
                                 (total.assignments[j] / (tokens * k)) / tokens);
  const T z_scale = static_cast<T>(loss_scale * o.z_loss_coeff * 2.0 / tokens);
  std::vector<T> dp(static_cast<std::size_t>(e));
  // The weights before the scaling factor and their gradient: w = f u, so du = f dw.
  const T f = static_cast<T>(o.topk_scaling_factor);
  std::vector<T> unscaled(static_cast<std::size_t>(k)), d_unscaled(static_cast<std::size_t>(k));
  for (std::int64_t i = 0; i < t; ++i) {
    const T* p = probs.row(i);
    for (std::int64_t s = 0; s < k; ++s) {
      unscaled[s] = topk_weight.row(i)[s] / f;
      d_unscaled[s] = d_topk_weight.row(i)[s] * f;
    }
    const T* w = unscaled.data();
    const T* dw = d_unscaled.data();
    std::copy(aux_grad.begin(), aux_grad.end(), dp.begin());
    if (o.renormalize) {
      // w_s = p_s / sum(p_chosen): dp_s = (dw_s - sum_r dw_r w_r) / sum(p_chosen).
      T chosen = 0, dot = 0;
      for (std::int64_t s = 0; s < k; ++s) {
        chosen += p[topk_index[i * k + s]];
        dot += dw[s] * w[s];
      }
      for (std::int64_t s = 0; s < k; ++s)
        dp[topk_index[i * k + s]] += (dw[s] - dot) / chosen;
    } else {
      for (std::int64_t s = 0; s < k; ++s)
        dp[topk_index[i * k + s]] += dw[s];
    }
    // Softmax backward, plus the z-loss: d lse^2 / d logit_j = 2 lse p_j.
    const T* x = logits.row(i);
    const T m = *std::max_element(x, x + e);
    double sum = 0;
    for (std::int64_t j = 0; j < e; ++j)
      sum += std::exp(static_cast<double>(x[j] - m));
    const T lse = static_cast<T>(static_cast<double>(m) + std::log(sum));
    T inner = 0;
    for (std::int64_t j = 0; j < e; ++j)
      inner += dp[j] * p[j];
    T* g = dlogits.row(i);
    for (std::int64_t j = 0; j < e; ++j)
      g[j] = p[j] * (dp[j] - inner) + z_scale * lse * p[j];
  }
}

template RouterStatistics router_forward(const RouterOptions&, const BasicTensor<float>&,
                                         const BasicTensor<float>&, std::span<std::int32_t>,
                                         const BasicTensor<float>&);
template RouterStatistics router_forward(const RouterOptions&, const BasicTensor<double>&,
                                         const BasicTensor<double>&, std::span<std::int32_t>,
                                         const BasicTensor<double>&);
template void router_backward(const RouterOptions&, const BasicTensor<float>&,
                              const BasicTensor<float>&, std::span<const std::int32_t>,
                              const BasicTensor<float>&, const BasicTensor<float>&,
                              const RouterStatistics&, double, const BasicTensor<float>&);
template void router_backward(const RouterOptions&, const BasicTensor<double>&,
                              const BasicTensor<double>&, std::span<const std::int32_t>,
                              const BasicTensor<double>&, const BasicTensor<double>&,
                              const RouterStatistics&, double, const BasicTensor<double>&);

}  // namespace weave::ops
