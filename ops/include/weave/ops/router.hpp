// Mixture-of-Experts router: softmax over experts, then top-k, with the Switch/GShard
// auxiliary load-balancing loss and the optional router z-loss.
//
// Both losses are functions of statistics summed over tokens (expert assignment counts,
// probability sums, squared log-sum-exps). router_forward returns this call's statistics;
// when a batch is routed in parts (Ampipe chunks, sequence-parallel shards, micro-batches)
// the caller adds the parts' statistics (or all-reduces them) and passes the total to
// aux_loss / z_loss / router_backward, so the losses and gradients equal the whole batch's.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "weave/ops/tensor.hpp"

namespace weave::ops {

struct RouterOptions {
  int top_k = 2;
  bool renormalize = true;    // divide the top-k probabilities by their sum (Mixtral, DeepSeek)
  double aux_loss_coeff = 0;  // Megatron's --moe-aux-loss-coeff
  double z_loss_coeff = 0;    // Megatron's --moe-z-loss-coeff
  // Megatron-Core's --moe-router-topk-scaling-factor: the weights (after any renormalisation)
  // multiplied by it; 1 leaves them.
  double topk_scaling_factor = 1;
};

struct RouterStatistics {
  std::int64_t tokens = 0;
  std::vector<double> assignments;  // [experts]: top-k picks of each expert
  std::vector<double> probability;  // [experts]: sum over tokens of softmax probabilities
  double squared_lse = 0;           // sum over tokens of logsumexp(logits)^2

  // Adds another part's statistics (same number of experts).
  RouterStatistics& operator+=(const RouterStatistics& other);
};

// logits [t, e] -> probs [t, e] (the full softmax, kept for the backward), topk_index [t * k]
// (experts of token i at [i*k, i*k + k), highest probability first, ties to the lower index),
// topk_weight [t, k] (renormalised or not, then scaled by topk_scaling_factor).
template <typename T>
RouterStatistics router_forward(const RouterOptions& options, const BasicTensor<T>& logits,
                                const BasicTensor<T>& probs, std::span<std::int32_t> topk_index,
                                const BasicTensor<T>& topk_weight);

// coeff * E * sum_e f_e P_e with f_e = assignments_e / (tokens * k), P_e = probability_e / tokens.
double aux_loss(const RouterOptions& options, const RouterStatistics& total);
// coeff * squared_lse / tokens.
double z_loss(const RouterOptions& options, const RouterStatistics& total);

// dlogits [t, e] (written) from the gradient of the top-k weights d_topk_weight [t, k] plus
// loss_scale times the gradients of the aux and z losses, whose statistics are `total`
// (f_e is a count: it has no gradient, as in Megatron and Switch).
template <typename T>
void router_backward(const RouterOptions& options, const BasicTensor<T>& logits,
                     const BasicTensor<T>& probs, std::span<const std::int32_t> topk_index,
                     const BasicTensor<T>& topk_weight, const BasicTensor<T>& d_topk_weight,
                     const RouterStatistics& total, double loss_scale,
                     const BasicTensor<T>& dlogits);

}  // namespace weave::ops
