// The DeepSpeed-style top-1 / top-2 gate that MindSpeed's deepspeed_moe layer routes with: a
// capacity per expert from the tokens of one gate call (clamped to a minimum), every first choice
// placed before any second choice, the weights taken after the drops, and a load-balancing loss
// over the first choices of the call's own tokens.
//
// It reuses the router's softmax and top-k (router_forward without renormalisation) and the
// dispatch plan (plan_dispatch with a fixed capacity, first choices first); these functions add
// what differs: the capacity rule, the weights after drops, the loss and the backward.
#pragma once

#include <cstdint>
#include <span>

#include "weave/ops/moe_dispatch.hpp"
#include "weave/ops/tensor.hpp"

namespace weave::ops {

// The smallest capacity the gate gives an expert, whatever the factor (MindSpeed's min_capacity).
inline constexpr std::int64_t kGateMinCapacity = 4;

// Picks each expert may take in a gate call of `tokens` tokens: ceil(tokens / experts * top_k *
// factor), computed in single precision as the gate does; raised to `min_capacity` when below it,
// else lowered to `tokens` when above (so a call of fewer than min_capacity tokens drops nothing).
// Throws std::invalid_argument for a factor <= 0, top_k < 1 or experts < 1.
std::int64_t gate_capacity(std::int64_t tokens, std::int64_t experts, int top_k,
                           double capacity_factor, std::int64_t min_capacity = kGateMinCapacity);

// The kept picks' weights, in place: `topk_weight` [t, k] holds each pick's softmax probability
// on entry. A dropped pick's weight becomes 0. Top-1: a kept pick keeps its probability. Top-2:
// each kept pick is divided by the sum of its token's kept probabilities (clamped below at the
// type's epsilon), so a token that lost one pick sends its other with weight 1.
template <typename T>
void gate_weights_after_drops(const DispatchPlan& plan, const BasicTensor<T>& topk_weight);

// The load-balancing loss of one gate call: coeff * E * sum_e mean_t(probs[t, e]) * (share of
// the call's tokens whose first choice is e), counted before any drop.
template <typename T>
double gate_balance_loss(const BasicTensor<T>& probs, std::span<const std::int32_t> topk_index,
                         int top_k, double coeff);

// dlogits [t, e] (written) of one gate call: from the kept weights' gradient d_topk_weight [t, k]
// (as gate_weights_after_drops made them) plus `balance_scale` times the gradient of
// gate_balance_loss with coefficient 1 (the first-choice shares are counts: no gradient).
template <typename T>
void gate_backward(const DispatchPlan& plan, const BasicTensor<T>& probs,
                   std::span<const std::int32_t> topk_index, const BasicTensor<T>& d_topk_weight,
                   double balance_scale, const BasicTensor<T>& dlogits);

}  // namespace weave::ops
