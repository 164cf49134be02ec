// Token dispatch for Mixture-of-Experts: which (token, pick) goes to which row of the
// expert-grouped buffer, with a capacity per expert or dropless; the permutation that groups
// tokens by expert (before the all-to-all that sends them to their experts' devices) and its
// inverse that combines the experts' outputs weighted by the router.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "weave/ops/tensor.hpp"

namespace weave::ops {

struct CapacityOptions {
  // Megatron's --moe-expert-capacity-factor: each expert takes at most
  // ceil(factor * tokens * k / experts) picks; 0 means dropless (no limit).
  double capacity_factor = 0;
  // A capacity fixed by the caller (the DeepSpeed-style gate's rule): used instead of the factor
  // when > 0.
  std::int64_t capacity = 0;
  // Fill each expert with every token's first choice before any second choice (the DeepSpeed
  // gate's order); otherwise picks come in token order, a token's picks together.
  bool first_choices_first = false;
  // [tokens * k] or empty: an expert over capacity keeps its picks of the highest priority (ties
  // to the earlier pick) instead of the earliest (Megatron-Core's --moe-token-drop-policy probs,
  // the priority being the pick's weight); its rows stay in token order.
  std::span<const float> pick_priority;
};

// Picks beyond an expert's capacity are dropped in the order the options say (token order, or
// first choices first; first come, first served within each): a dropped pick contributes nothing
// to its token's output. An expert's rows are its kept picks in that order.
struct DispatchPlan {
  std::int64_t tokens = 0;
  std::int64_t top_k = 0;
  std::int64_t experts = 0;
  std::int64_t capacity = 0;  // picks an expert may take; 0 when dropless
  std::vector<std::int64_t>
      expert_begin;                     // [experts + 1]: expert e's rows are [begin[e], begin[e+1])
  std::vector<std::int32_t> row_token;  // [rows]: the token each grouped row came from
  std::vector<std::int32_t> pick_row;   // [tokens * k]: the row of pick (t, s), or -1 if dropped
  std::int64_t dropped = 0;

  std::int64_t rows() const { return expert_begin.empty() ? 0 : expert_begin.back(); }
  // Rows bound for each of `ranks` devices holding experts/ranks consecutive experts each:
  // the send splits of the dispatch all-to-all.
  std::vector<std::int64_t> rows_per_rank(int ranks) const;
};

// Throws std::invalid_argument for an expert index outside [0, experts) (naming the token).
DispatchPlan plan_dispatch(std::span<const std::int32_t> topk_index, std::int64_t tokens, int top_k,
                           std::int64_t experts, const CapacityOptions& options);

// grouped [rows, h] row r = x[row_token[r]].
template <typename T>
void permute_tokens(const DispatchPlan& plan, const BasicTensor<T>& x,
                    const BasicTensor<T>& grouped);
// dx [tokens, h] (written) = the sum over each token's kept picks of d_grouped's rows, in pick
// order.
template <typename T>
void permute_tokens_backward(const DispatchPlan& plan, const BasicTensor<T>& d_grouped,
                             const BasicTensor<T>& dx);

// y [tokens, h] = sum over kept picks s of weight[t, s] * grouped[pick_row(t, s)].
template <typename T>
void combine_tokens(const DispatchPlan& plan, const BasicTensor<T>& grouped,
                    const BasicTensor<T>& weight, const BasicTensor<T>& y);
// d_grouped [rows, h] and d_weight [tokens, k] (written; 0 for dropped picks).
template <typename T>
void combine_tokens_backward(const DispatchPlan& plan, const BasicTensor<T>& grouped,
                             const BasicTensor<T>& weight, const BasicTensor<T>& dy,
                             const BasicTensor<T>& d_grouped, const BasicTensor<T>& d_weight);

}  // namespace weave::ops
