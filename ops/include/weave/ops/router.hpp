// Mixture-of-Experts router: scores over experts (softmax, or Megatron-Core's sigmoid or
// sqrtsoftplus), then top-k (optionally limited to the best groups of experts, and chosen by the
// scores plus a per-expert bias), with the Switch/GShard auxiliary load-balancing loss and the
// optional router z-loss, as Megatron-Core's TopKRouter routes.
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

// How a token's logits become its scores: softmax over the experts, or each expert's own score
// of its logit: sigmoid (DeepSeek-V3's, Megatron-Core's --moe-router-score-function sigmoid) or
// sqrt(softplus) (Megatron-Core's sqrtsoftplus; softplus as PyTorch's, the logit itself above
// 20). The two per-expert scores are routed alike: divided by the picks' sum (plus 1e-20) when
// the caller renormalises, by the sum over every expert (plus 1e-20) for the load-balancing loss.
enum class RouterScore { softmax, sigmoid, sqrtsoftplus };

struct RouterOptions {
  int top_k = 2;
  RouterScore score = RouterScore::softmax;
  // Divide the top-k scores by their sum (Mixtral, DeepSeek). Megatron-Core's sigmoid and
  // sqrtsoftplus scores are divided by their sum plus 1e-20 whenever top_k > 1: the caller sets
  // it so.
  bool renormalize = true;
  double aux_loss_coeff = 0;  // Megatron's --moe-aux-loss-coeff
  double z_loss_coeff = 0;    // Megatron's --moe-z-loss-coeff
  // Megatron-Core's --moe-router-topk-scaling-factor: the weights (after any renormalisation)
  // multiplied by it; 1 leaves them.
  double topk_scaling_factor = 1;
  // Megatron-Core's group-limited routing (--moe-router-num-groups, --moe-router-group-topk):
  // the experts split into num_groups equal groups of consecutive experts; each token's group
  // score is the sum of its top (top_k / group_topk) routing scores in the group, and only the
  // experts of its group_topk best groups can be picked. group_topk = 0: no groups.
  int num_groups = 0;
  int group_topk = 0;
  // Megatron-Core's aux-loss-free expert bias (sigmoid or sqrtsoftplus scores): [experts] values
  // added to the scores for the choice of the experts (and of the groups) only; the weights are
  // the scores themselves. Empty: no bias.
  std::span<const float> expert_bias;
  // Megatron-Core's --moe-router-load-balancing-type seq_aux_loss: the tokens are those of this
  // many sequences, stored [s, sequences] (token i belongs to sequence i mod sequences), and the
  // load-balancing loss is each sequence's own, averaged over the sequences. 0: the loss of all
  // the tokens together (aux_loss).
  int sequences = 0;
  // Megatron-Core's --moe-router-load-balancing-type sinkhorn in training: each token's picks are
  // the top-k of the Sinkhorn-balanced logits of all the tokens routed in the call (ops/
  // sinkhorn.hpp, without gradient), its weights the picks' scores as they are (softmax over the
  // experts, or the sigmoid when top_k is 1: the caller sets `score` and `renormalize` so).
  bool sinkhorn = false;
};

struct RouterStatistics {
  std::int64_t tokens = 0;
  // [experts], or [sequences, experts] with RouterOptions::sequences: picks of each expert by the
  // plain top-k of the scores (no groups, no bias), the counts Megatron-Core's load-balancing
  // loss takes; without groups and bias, the picks.
  std::vector<double> assignments;
  // Shaped as assignments: sum over tokens of the scores the loss takes: the softmax
  // probabilities, or the sigmoid (sqrtsoftplus) scores divided by their sum over the experts
  // (plus 1e-20).
  std::vector<double> probability;
  double squared_lse = 0;  // sum over tokens of logsumexp(logits)^2

  // Adds another part's statistics (same number of experts).
  RouterStatistics& operator+=(const RouterStatistics& other);
};

// logits [t, e] -> probs [t, e] (every expert's score, softmax, sigmoid or sqrtsoftplus, kept for
// the backward), topk_index [t * k] (experts of token i at [i*k, i*k + k), highest routing score
// first, ties to the lower index), topk_weight [t, k] (the picks' scores, renormalised or not,
// then scaled by topk_scaling_factor).
template <typename T>
RouterStatistics router_forward(const RouterOptions& options, const BasicTensor<T>& logits,
                                const BasicTensor<T>& probs, std::span<std::int32_t> topk_index,
                                const BasicTensor<T>& topk_weight);

// coeff * E * sum_e f_e P_e with f_e = assignments_e / (tokens * k), P_e = probability_e / tokens;
// with RouterOptions::sequences = B, the mean over the B sequences of that loss of each sequence's
// statistics (tokens / B tokens each), as Megatron-Core's seq_aux_loss.
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

// Megatron-Core's update of the aux-loss-free expert bias from the loads (picks each expert kept,
// summed over the step and the replicas): bias_e += rate x sign(mean load - load_e), in fp32 as
// its get_updated_expert_bias; an expert at the mean keeps its bias.
void update_expert_bias(std::span<const float> loads, std::span<float> bias, double rate);

}  // namespace weave::ops
