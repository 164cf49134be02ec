#include "weave/ops/router.hpp"

#include "weave/ops/sinkhorn.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
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
  if (!o.expert_bias.empty() && o.score == RouterScore::softmax)
    throw std::invalid_argument(
        "router expert bias needs sigmoid or sqrtsoftplus scores, as Megatron-Core's: route with "
        "one of them or without the bias");
  if (!o.expert_bias.empty() && static_cast<std::int64_t>(o.expert_bias.size()) != e)
    throw std::invalid_argument(fmt::format(
        "router expert bias holds {} values, need one per expert ({})", o.expert_bias.size(), e));
  if (o.group_topk != 0) {
    const std::int64_t g = o.num_groups;
    if (g < 1 || e % g != 0 || o.group_topk < 1 || o.group_topk > g)
      throw std::invalid_argument(fmt::format(
          "router groups: {} experts in {} groups choosing {}; the groups must divide the "
          "experts and the chosen groups be between 1 and the groups",
          e, g, o.group_topk));
    if (o.group_topk > o.top_k || o.top_k > o.group_topk * (e / g))
      throw std::invalid_argument(fmt::format(
          "router groups: top-{} from {} groups of {} experts needs a group top-k between 1 and "
          "top-k whose groups hold at least top-k experts",
          o.top_k, o.group_topk, e / g));
  }
  if (o.sequences < 0 || (o.sequences > 0 && t % o.sequences != 0))
    throw std::invalid_argument(fmt::format(
        "router: {} tokens cannot be those of {} sequences; need a multiple of the sequences", t,
        o.sequences));
  if (o.sinkhorn && (o.group_topk != 0 || !o.expert_bias.empty() || o.topk_scaling_factor != 1))
    throw std::invalid_argument(
        "router: sinkhorn routing picks by the balanced logits alone, as Megatron-Core's: route "
        "without groups, expert bias and top-k scaling factor");
  check_rows("router probabilities", probs);
  check_shape("router probabilities", probs.shape(), logits.shape());
  check_rows("router top-k weights", weight);
  check_shape("router top-k weights", weight.shape(), Shape{t, o.top_k});
  if (index_size != static_cast<std::size_t>(t * o.top_k))
    throw std::invalid_argument(
        fmt::format("router: top-k index holds {} entries, need {} x {}", index_size, t, o.top_k));
}

// The columns of the statistics: the experts, of each sequence under seq_aux_loss.
std::int64_t statistics_columns(const RouterOptions& o, std::int64_t experts) {
  return o.sequences > 0 ? experts * o.sequences : experts;
}

void check_total(const RouterOptions& o, const RouterStatistics& total, std::int64_t experts) {
  const std::int64_t columns = statistics_columns(o, experts);
  if (total.tokens <= 0 || static_cast<std::int64_t>(total.assignments.size()) != columns ||
      static_cast<std::int64_t>(total.probability.size()) != columns ||
      (o.sequences > 0 && total.tokens % o.sequences != 0))
    throw std::invalid_argument(fmt::format(
        "router statistics cover {} tokens and {} columns; need > 0 tokens (a multiple of the {} "
        "sequences) and {} columns",
        total.tokens, total.assignments.size(), o.sequences, columns));
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

namespace {

// Megatron-Core adds this to the sum of the chosen sigmoid (sqrtsoftplus) scores before dividing
// by it.
constexpr double kSigmoidSumEpsilon = 1e-20;

// PyTorch's softplus (beta 1, threshold 20), which Megatron-Core's sqrtsoftplus takes: log(1 +
// e^x), and x itself above the threshold.
constexpr double kSoftplusThreshold = 20;

// An expert's own score of its logit: sigmoid(x) or sqrt(softplus(x)), in double.
double expert_score(RouterScore score, double x) {
  if (score == RouterScore::sigmoid) return 1 / (1 + std::exp(-x));
  return std::sqrt(x > kSoftplusThreshold ? x : std::log1p(std::exp(x)));
}

// The derivative of sqrt(softplus(x)) from x and the score p: sigmoid(x) / (2 p) (1 / (2 p)
// above the threshold), 0 where softplus underflowed to p = 0, the limit as x falls (p ~ e^(x/2)
// there).
double sqrtsoftplus_derivative(double x, double p) {
  if (p == 0) return 0;
  const double softplus_slope = x > kSoftplusThreshold ? 1.0 : 1 / (1 + std::exp(-x));
  return softplus_slope / (2 * p);
}

// The k experts of the largest keys among those with eligible[j] (all when empty), largest
// first, ties to the lower index, into order[0, k).
template <typename T>
void top_experts(const std::vector<T>& key, const std::vector<char>& eligible, std::int64_t k,
                 std::vector<std::int32_t>& order) {
  order.clear();
  for (std::int32_t j = 0; j < static_cast<std::int32_t>(key.size()); ++j)
    if (eligible.empty() || eligible[j]) order.push_back(j);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&key](std::int32_t a, std::int32_t b) {
                      return key[a] > key[b] || (key[a] == key[b] && a < b);
                    });
}

// Megatron-Core's group-limited choice: eligible[j] set for the experts of the group_topk groups
// whose top (top_k / group_topk) keys sum highest (ties to the lower group).
template <typename T>
void eligible_groups(const RouterOptions& o, const std::vector<T>& key, std::vector<char>& eligible,
                     std::vector<T>& group_score, std::vector<T>& scratch) {
  const std::int64_t e = static_cast<std::int64_t>(key.size()), g = o.num_groups, size = e / g;
  const std::int64_t best = o.top_k / o.group_topk;
  for (std::int64_t q = 0; q < g; ++q) {
    scratch.assign(key.begin() + q * size, key.begin() + (q + 1) * size);
    std::partial_sort(scratch.begin(), scratch.begin() + best, scratch.end(), std::greater<T>());
    group_score[q] = std::accumulate(scratch.begin(), scratch.begin() + best, T{0});
  }
  std::vector<std::int32_t> groups;
  top_experts(group_score, {}, o.group_topk, groups);
  eligible.assign(static_cast<std::size_t>(e), 0);
  for (std::int64_t r = 0; r < o.group_topk; ++r)
    std::fill_n(eligible.begin() + groups[r] * size, size, char{1});
}

}  // namespace

template <typename T>
RouterStatistics router_forward(const RouterOptions& o, const BasicTensor<T>& logits,
                                const BasicTensor<T>& probs, std::span<std::int32_t> topk_index,
                                const BasicTensor<T>& topk_weight) {
  check_router(o, logits, probs, topk_index.size(), topk_weight);
  const std::int64_t t = logits.dim(0), e = logits.dim(1), k = o.top_k;
  // Per-expert scores (sigmoid, sqrtsoftplus) rather than the softmax over the experts.
  const bool per_expert = o.score != RouterScore::softmax;
  const bool grouped = o.group_topk != 0, biased = !o.expert_bias.empty();
  const auto columns = static_cast<std::size_t>(statistics_columns(o, e));
  RouterStatistics stats{t, std::vector<double>(columns, 0.0), std::vector<double>(columns, 0.0),
                         0.0};
  // Sinkhorn routing picks by the balanced logits of all the call's tokens at once.
  BasicTensor<T> balanced;
  if (o.sinkhorn) {
    balanced = BasicTensor<T>::empty(logits.shape());
    sinkhorn_forward(logits, balanced);
  }
  std::vector<std::int32_t> order, plain;
  std::vector<T> key(static_cast<std::size_t>(e)), group_key, group_score(o.num_groups), scratch;
  std::vector<char> eligible;
  for (std::int64_t i = 0; i < t; ++i) {
    const T* x = logits.row(i);
    T* p = probs.row(i);
    // The token's columns of the statistics: its sequence's under seq_aux_loss.
    double* probability = stats.probability.data() + (o.sequences > 0 ? i % o.sequences * e : 0);
    double* assignments = stats.assignments.data() + (o.sequences > 0 ? i % o.sequences * e : 0);
    const T m = *std::max_element(x, x + e);
    double sum = 0;
    for (std::int64_t j = 0; j < e; ++j)
      sum += (p[j] = std::exp(x[j] - m));
    const double lse = static_cast<double>(m) + std::log(sum);
    stats.squared_lse += lse * lse;
    if (per_expert) {
      double score_sum = 0;
      for (std::int64_t j = 0; j < e; ++j)
        score_sum += (p[j] = static_cast<T>(expert_score(o.score, static_cast<double>(x[j]))));
      for (std::int64_t j = 0; j < e; ++j)
        probability[j] += p[j] / (score_sum + kSigmoidSumEpsilon);
    } else {
      for (std::int64_t j = 0; j < e; ++j) {
        p[j] = static_cast<T>(p[j] / sum);
        probability[j] += p[j];
      }
    }
    // The routing scores: the scores plus the bias. Megatron-Core's softmax routing without
    // pre-softmax takes the top-k of the logits (the same order as the probabilities') and so
    // also scores the groups by the logits.
    for (std::int64_t j = 0; j < e; ++j)
      key[j] = biased ? static_cast<T>(p[j] + o.expert_bias[j]) : p[j];
    if (o.sinkhorn) key.assign(balanced.row(i), balanced.row(i) + e);
    if (grouped) {
      if (!per_expert && o.renormalize) {
        group_key.assign(x, x + e);
        eligible_groups(o, group_key, eligible, group_score, scratch);
      } else {
        eligible_groups(o, key, eligible, group_score, scratch);
      }
    }
    top_experts(key, eligible, k, order);
    if (grouped || biased) {
      // The load-balancing loss counts the plain top-k of the scores.
      key.assign(p, p + e);
      top_experts(key, {}, k, plain);
    }
    const std::vector<std::int32_t>& counted = grouped || biased ? plain : order;
    T* w = topk_weight.row(i);
    T chosen = 0;
    for (std::int64_t s = 0; s < k; ++s) {
      topk_index[i * k + s] = order[s];
      assignments[counted[s]] += 1;
      chosen += (w[s] = p[order[s]]);
    }
    if (o.renormalize) {
      const T divisor = per_expert ? static_cast<T>(chosen + kSigmoidSumEpsilon) : chosen;
      for (std::int64_t s = 0; s < k; ++s)
        w[s] /= divisor;
    }
    if (o.topk_scaling_factor != 1)
      for (std::int64_t s = 0; s < k; ++s)
        w[s] = static_cast<T>(w[s] * o.topk_scaling_factor);
  }
  return stats;
}

double aux_loss(const RouterOptions& o, const RouterStatistics& total) {
  const std::int64_t sequences = std::max(o.sequences, 1);
  const auto e = static_cast<std::int64_t>(total.assignments.size()) / sequences;
  check_total(o, total, e);
  // Each sequence's loss over its own tokens; one "sequence" of all of them for aux_loss.
  double sum = 0;
  const double tokens = static_cast<double>(total.tokens / sequences);
  for (std::size_t j = 0; j < total.assignments.size(); ++j)
    sum += total.assignments[j] / (tokens * o.top_k) * (total.probability[j] / tokens);
  return o.aux_loss_coeff * static_cast<double>(e) * sum / static_cast<double>(sequences);
}

double z_loss(const RouterOptions& o, const RouterStatistics& total) {
  check_total(o, total,
              static_cast<std::int64_t>(total.assignments.size()) / std::max(o.sequences, 1));
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
  const bool per_expert = o.score != RouterScore::softmax;
  check_total(o, total, e);
  const std::int64_t sequences = std::max(o.sequences, 1);
  const double tokens = static_cast<double>(total.tokens);
  // d aux / d p[i, j] = coeff E f_j / tokens, the same for every token; under seq_aux_loss
  // coeff E f_bj / (tokens_b B) for a token of sequence b (tokens_b = tokens / B of them).
  const double per_sequence = tokens / static_cast<double>(sequences);
  std::vector<T> aux_grad(total.assignments.size());
  for (std::size_t j = 0; j < aux_grad.size(); ++j)
    aux_grad[j] = static_cast<T>(loss_scale * o.aux_loss_coeff * static_cast<double>(e) *
                                 (total.assignments[j] / (per_sequence * k)) / per_sequence /
                                 static_cast<double>(sequences));
  const T z_scale = static_cast<T>(loss_scale * o.z_loss_coeff * 2.0 / tokens);
  std::vector<T> dp(static_cast<std::size_t>(e));
  // The weights before the scaling factor and their gradient: w = f u, so du = f dw.
  const T f = static_cast<T>(o.topk_scaling_factor);
  std::vector<T> unscaled(static_cast<std::size_t>(k)), d_unscaled(static_cast<std::size_t>(k));
  for (std::int64_t i = 0; i < t; ++i) {
    const T* p = probs.row(i);
    const T* token_aux_grad = aux_grad.data() + (o.sequences > 0 ? i % o.sequences * e : 0);
    for (std::int64_t s = 0; s < k; ++s) {
      unscaled[s] = topk_weight.row(i)[s] / f;
      d_unscaled[s] = d_topk_weight.row(i)[s] * f;
    }
    const T* w = unscaled.data();
    const T* dw = d_unscaled.data();
    if (per_expert) {
      // The loss takes q_j = p_j / S, S = sum_j p_j + 1e-20: dp_j = a_j / S - sum_r a_r p_r / S^2.
      T score_sum = static_cast<T>(kSigmoidSumEpsilon), weighted = 0;
      for (std::int64_t j = 0; j < e; ++j) {
        score_sum += p[j];
        weighted += token_aux_grad[j] * p[j];
      }
      for (std::int64_t j = 0; j < e; ++j)
        dp[j] = token_aux_grad[j] / score_sum - weighted / (score_sum * score_sum);
    } else {
      std::copy(token_aux_grad, token_aux_grad + e, dp.begin());
    }
    if (o.renormalize) {
      // w_s = p_s / sum(p_chosen): dp_s = (dw_s - sum_r dw_r w_r) / sum(p_chosen).
      T chosen = per_expert ? static_cast<T>(kSigmoidSumEpsilon) : T{0}, dot = 0;
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
    // Softmax backward, plus the z-loss: d lse^2 / d logit_j = 2 lse softmax_j.
    const T* x = logits.row(i);
    const T m = *std::max_element(x, x + e);
    double sum = 0;
    for (std::int64_t j = 0; j < e; ++j)
      sum += std::exp(static_cast<double>(x[j] - m));
    const T lse = static_cast<T>(static_cast<double>(m) + std::log(sum));
    T* g = dlogits.row(i);
    if (o.score == RouterScore::sigmoid) {
      // d sigmoid_j / d logit_j = p_j (1 - p_j).
      for (std::int64_t j = 0; j < e; ++j)
        g[j] = dp[j] * p[j] * (1 - p[j]) +
               z_scale * lse * static_cast<T>(std::exp(static_cast<double>(x[j]) - lse));
    } else if (per_expert) {
      for (std::int64_t j = 0; j < e; ++j)
        g[j] = dp[j] * static_cast<T>(sqrtsoftplus_derivative(static_cast<double>(x[j]),
                                                              static_cast<double>(p[j]))) +
               z_scale * lse * static_cast<T>(std::exp(static_cast<double>(x[j]) - lse));
    } else {
      T inner = 0;
      for (std::int64_t j = 0; j < e; ++j)
        inner += dp[j] * p[j];
      for (std::int64_t j = 0; j < e; ++j)
        g[j] = p[j] * (dp[j] - inner) + z_scale * lse * p[j];
    }
  }
}

void update_expert_bias(std::span<const float> loads, std::span<float> bias, double rate) {
  if (loads.size() != bias.size() || loads.empty())
    throw std::invalid_argument(
        fmt::format("expert bias update: {} loads for {} biases; need one load per expert",
                    loads.size(), bias.size()));
  float total = 0;
  for (float n : loads)
    total += n;
  const float mean = total / static_cast<float>(loads.size());
  const auto step = static_cast<float>(rate);
  for (std::size_t e = 0; e < bias.size(); ++e) {
    const float offset = mean - loads[e];
    bias[e] += static_cast<float>((offset > 0) - (offset < 0)) * step;
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
