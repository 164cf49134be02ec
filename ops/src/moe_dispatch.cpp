#include "weave/ops/moe_dispatch.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace weave::ops {

std::vector<std::int64_t> DispatchPlan::rows_per_rank(int ranks) const {
  if (ranks < 1 || experts % ranks != 0)
    throw std::invalid_argument(fmt::format(
        "{} experts cannot be split evenly over {} expert-parallel ranks", experts, ranks));
  const std::int64_t per = experts / ranks;
  std::vector<std::int64_t> rows(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r)
    rows[r] = expert_begin[(r + 1) * per] - expert_begin[r * per];
  return rows;
}

namespace {

// plan_dispatch's rows when an expert over capacity keeps its highest-priority picks: each
// expert's picks ranked by priority (then by pick), the first `capacity` kept, rows in pick order.
void plan_by_priority(DispatchPlan& plan, std::span<const std::int32_t> topk_index,
                      const CapacityOptions& options, const std::vector<std::int64_t>& count) {
  const std::span<const float> priority = options.pick_priority;
  if (priority.size() != topk_index.size())
    throw std::invalid_argument(fmt::format("dispatch: {} pick priorities for {} picks",
                                            priority.size(), topk_index.size()));
  std::vector<std::vector<std::int32_t>> picks(count.size());
  for (std::size_t i = 0; i < topk_index.size(); ++i)
    picks[static_cast<std::size_t>(topk_index[i])].push_back(static_cast<std::int32_t>(i));
  std::vector<bool> keep(topk_index.size(), true);
  for (auto& of_expert : picks) {
    if (plan.capacity == 0 || static_cast<std::int64_t>(of_expert.size()) <= plan.capacity)
      continue;
    std::vector<std::int32_t> ranked = of_expert;
    std::stable_sort(ranked.begin(), ranked.end(),
                     [&](std::int32_t a, std::int32_t b) { return priority[a] > priority[b]; });
    for (std::size_t r = static_cast<std::size_t>(plan.capacity); r < ranked.size(); ++r)
      keep[static_cast<std::size_t>(ranked[r])] = false;
  }
  const auto experts = static_cast<std::int64_t>(count.size());
  plan.expert_begin.assign(static_cast<std::size_t>(experts) + 1, 0);
  for (std::int64_t e = 0; e < experts; ++e)
    plan.expert_begin[e + 1] =
        plan.expert_begin[e] + (plan.capacity > 0 ? std::min(count[e], plan.capacity) : count[e]);
  plan.row_token.assign(static_cast<std::size_t>(plan.rows()), 0);
  plan.pick_row.assign(topk_index.size(), -1);
  std::vector<std::int64_t> next(plan.expert_begin.begin(), plan.expert_begin.end() - 1);
  for (std::size_t i = 0; i < topk_index.size(); ++i) {
    if (!keep[i]) {
      ++plan.dropped;
      continue;
    }
    const std::int64_t row = next[topk_index[i]]++;
    plan.row_token[row] = static_cast<std::int32_t>(i / static_cast<std::size_t>(plan.top_k));
    plan.pick_row[i] = static_cast<std::int32_t>(row);
  }
}

}  // namespace

DispatchPlan plan_dispatch(std::span<const std::int32_t> topk_index, std::int64_t tokens, int top_k,
                           std::int64_t experts, const CapacityOptions& options) {
  if (tokens < 0 || top_k < 1 || experts < 1 ||
      static_cast<std::int64_t>(topk_index.size()) != tokens * top_k)
    throw std::invalid_argument(
        fmt::format("dispatch: {} expert picks for {} tokens x top-{} over {} experts",
                    topk_index.size(), tokens, top_k, experts));
  if (options.capacity_factor < 0)
    throw std::invalid_argument(fmt::format(
        "expert capacity factor must be >= 0 (0: dropless), got {}", options.capacity_factor));
  DispatchPlan plan;
  plan.tokens = tokens;
  plan.top_k = top_k;
  plan.experts = experts;
  if (options.capacity < 0)
    throw std::invalid_argument(
        fmt::format("expert capacity must be >= 0 (0: from the factor), got {}", options.capacity));
  plan.capacity = options.capacity > 0 ? options.capacity
                  : options.capacity_factor > 0
                      ? static_cast<std::int64_t>(std::ceil(options.capacity_factor *
                                                            static_cast<double>(tokens * top_k) /
                                                            static_cast<double>(experts)))
                      : 0;
  std::vector<std::int64_t> count(static_cast<std::size_t>(experts), 0);
  for (std::size_t i = 0; i < topk_index.size(); ++i) {
    const std::int32_t e = topk_index[i];
    if (e < 0 || e >= experts)
      throw std::invalid_argument(fmt::format("dispatch: token {} picks expert {}, outside [0, {})",
                                              i / static_cast<std::size_t>(top_k), e, experts));
    ++count[e];
  }
  if (!options.pick_priority.empty()) {
    plan_by_priority(plan, topk_index, options, count);
    return plan;
  }
  std::vector<std::int64_t> kept(count);
  if (plan.capacity > 0)
    for (auto& c : kept)
      c = std::min(c, plan.capacity);
  plan.expert_begin.assign(static_cast<std::size_t>(experts) + 1, 0);
  for (std::int64_t e = 0; e < experts; ++e)
    plan.expert_begin[e + 1] = plan.expert_begin[e] + kept[e];
  plan.row_token.assign(static_cast<std::size_t>(plan.rows()), 0);
  plan.pick_row.assign(topk_index.size(), -1);
  std::vector<std::int64_t> next(plan.expert_begin.begin(), plan.expert_begin.end() - 1);
  const std::size_t k = static_cast<std::size_t>(top_k), n = static_cast<std::size_t>(tokens);
  for (std::size_t order = 0; order < topk_index.size(); ++order) {
    // The order-th pick considered: token-major, or choice-major for first choices first.
    const std::size_t i = options.first_choices_first ? (order % n) * k + order / n : order;
    const std::int32_t e = topk_index[i];
    if (next[e] == plan.expert_begin[e + 1]) {
      ++plan.dropped;
      continue;
    }
    const std::int64_t row = next[e]++;
    plan.row_token[row] = static_cast<std::int32_t>(i / k);
    plan.pick_row[i] = static_cast<std::int32_t>(row);
  }
  return plan;
}

namespace {

template <typename T>
void check_plan_tensors(const DispatchPlan& plan, const BasicTensor<T>& tokens_side,
                        const BasicTensor<T>& grouped, const char* tokens_name,
                        const char* grouped_name) {
  check_rows(tokens_name, tokens_side);
  check_rows(grouped_name, grouped);
  if (tokens_side.rank() != 2)
    throw std::invalid_argument(
        fmt::format("{} must be [tokens, hidden], got {}", tokens_name, tokens_side.shape().str()));
  check_shape(tokens_name, tokens_side.shape(), Shape{plan.tokens, tokens_side.dim(1)});
  check_shape(grouped_name, grouped.shape(), Shape{plan.rows(), tokens_side.dim(1)});
}

}  // namespace

template <typename T>
void permute_tokens(const DispatchPlan& plan, const BasicTensor<T>& x,
                    const BasicTensor<T>& grouped) {
  check_plan_tensors(plan, x, grouped, "dispatch input", "dispatched tokens");
  const std::int64_t h = x.dim(1);
  for (std::int64_t r = 0; r < plan.rows(); ++r)
    std::copy_n(x.row(plan.row_token[r]), h, grouped.row(r));
}

template <typename T>
void permute_tokens_backward(const DispatchPlan& plan, const BasicTensor<T>& d_grouped,
                             const BasicTensor<T>& dx) {
  check_plan_tensors(plan, dx, d_grouped, "dispatch input gradient", "dispatched tokens gradient");
  const std::int64_t h = dx.dim(1);
  for (std::int64_t t = 0; t < plan.tokens; ++t) {
    T* out = dx.row(t);
    std::fill_n(out, h, T(0));
    for (std::int64_t s = 0; s < plan.top_k; ++s) {
      const std::int32_t row = plan.pick_row[t * plan.top_k + s];
      if (row < 0) continue;
      const T* g = d_grouped.row(row);
      for (std::int64_t c = 0; c < h; ++c)
        out[c] += g[c];
    }
  }
}

template <typename T>
void combine_tokens(const DispatchPlan& plan, const BasicTensor<T>& grouped,
                    const BasicTensor<T>& weight, const BasicTensor<T>& y) {
  check_plan_tensors(plan, y, grouped, "combine output", "expert outputs");
  check_shape("combine weights", weight.shape(), Shape{plan.tokens, plan.top_k});
  const std::int64_t h = y.dim(1);
  for (std::int64_t t = 0; t < plan.tokens; ++t) {
    T* out = y.row(t);
    std::fill_n(out, h, T(0));
    for (std::int64_t s = 0; s < plan.top_k; ++s) {
      const std::int32_t row = plan.pick_row[t * plan.top_k + s];
      if (row < 0) continue;
      const T w = weight(t, s);
      const T* g = grouped.row(row);
      for (std::int64_t c = 0; c < h; ++c)
        out[c] += w * g[c];
    }
  }
}

template <typename T>
void combine_tokens_backward(const DispatchPlan& plan, const BasicTensor<T>& grouped,
                             const BasicTensor<T>& weight, const BasicTensor<T>& dy,
                             const BasicTensor<T>& d_grouped, const BasicTensor<T>& d_weight) {
  check_plan_tensors(plan, dy, grouped, "combine output gradient", "expert outputs");
  check_plan_tensors(plan, dy, d_grouped, "combine output gradient", "expert outputs gradient");
  check_shape("combine weights", weight.shape(), Shape{plan.tokens, plan.top_k});
  check_shape("combine weights gradient", d_weight.shape(), weight.shape());
  const std::int64_t h = dy.dim(1);
  for (std::int64_t t = 0; t < plan.tokens; ++t) {
    const T* g = dy.row(t);
    for (std::int64_t s = 0; s < plan.top_k; ++s) {
      const std::int32_t row = plan.pick_row[t * plan.top_k + s];
      if (row < 0) {
        d_weight(t, s) = T(0);
        continue;
      }
      const T w = weight(t, s);
      const T* e = grouped.row(row);
      T* d = d_grouped.row(row);
      T dot = 0;
      for (std::int64_t c = 0; c < h; ++c) {
        d[c] = w * g[c];
        dot += e[c] * g[c];
      }
      d_weight(t, s) = dot;
    }
  }
}

#define WEAVE_INSTANTIATE(T)                                                                       \
  template void permute_tokens(const DispatchPlan&, const BasicTensor<T>&, const BasicTensor<T>&); \
  template void permute_tokens_backward(const DispatchPlan&, const BasicTensor<T>&,                \
                                        const BasicTensor<T>&);                                    \
  template void combine_tokens(const DispatchPlan&, const BasicTensor<T>&, const BasicTensor<T>&,  \
                               const BasicTensor<T>&);                                             \
  template void combine_tokens_backward(const DispatchPlan&, const BasicTensor<T>&,                \
                                        const BasicTensor<T>&, const BasicTensor<T>&,              \
                                        const BasicTensor<T>&, const BasicTensor<T>&);
WEAVE_INSTANTIATE(float)
WEAVE_INSTANTIATE(double)

}  // namespace weave::ops
