// The MoE layer's router (Megatron-Core's TopKRouter, or MindSpeed's deepspeed_moe gate with
// ModelConfig::moe_gate): each token's logits over the experts, its top-k picks and their
// weights, the statistics of the routed tokens and the load-balancing and z losses from them, and
// the backward of all of it. Decoding routes its token through the same route_tokens.
#include <algorithm>
#include <cmath>

#include "model/half_precision.hpp"
#include "moe/moe_expert_bias.hpp"
#include "moe/moe_mlp.hpp"
#include "moe/moe_router.hpp"
#include "step/step_costs.hpp"
#include "weave/ops/deepspeed_gate.hpp"
#include "weave/ops/elementwise.hpp"
#include "weave/ops/linear.hpp"
#include "weave/ops/sinkhorn.hpp"

namespace weave::graphs {

ops::RouterOptions router_options(const ModelConfig& m) {
  // MindSpeed's gate renormalises top-2's weights (after its drops; a lone decoded token drops
  // nothing) and leaves top-1's its probability.
  if (m.moe_gate == MoeGate::deepspeed)
    return {.top_k = m.moe_router_topk,
            .renormalize = m.moe_router_topk == 2,
            .aux_loss_coeff = m.moe_aux_loss_coeff,
            .z_loss_coeff = m.moe_z_loss_coeff};
  // Megatron-Core's sinkhorn routing weighs the picks by their softmax scores (top-1 by its
  // sigmoid), unrenormalised and unscaled; outside training it picks the top-k of those scores.
  if (m.moe_load_balancing == MoeLoadBalancing::sinkhorn)
    return {.top_k = m.moe_router_topk,
            .score = m.moe_router_topk == 1 ? ops::RouterScore::sigmoid : ops::RouterScore::softmax,
            .renormalize = false,
            .aux_loss_coeff = m.moe_aux_loss_coeff,
            .z_loss_coeff = m.moe_z_loss_coeff};
  // Megatron-Core divides sigmoid and sqrtsoftplus scores by the picks' sum whenever top-k > 1,
  // pre-softmax or not (topk_routing_with_score_function).
  const ops::RouterScore score =
      m.moe_router_score_function == "sigmoid"        ? ops::RouterScore::sigmoid
      : m.moe_router_score_function == "sqrtsoftplus" ? ops::RouterScore::sqrtsoftplus
                                                      : ops::RouterScore::softmax;
  const bool per_expert = score != ops::RouterScore::softmax;
  return {.top_k = m.moe_router_topk,
          .score = score,
          .renormalize = per_expert ? m.moe_router_topk > 1 : m.moe_router_renormalize,
          .aux_loss_coeff = m.moe_aux_loss_coeff,
          .z_loss_coeff = m.moe_z_loss_coeff,
          .topk_scaling_factor = m.moe_router_topk_scaling_factor,
          .num_groups = m.moe_router_group_topk != 0 ? m.moe_router_num_groups : 0,
          .group_topk = m.moe_router_group_topk};
}

ops::RouterOptions training_router_options(const StepShape& z) {
  ops::RouterOptions options = router_options(z.model);
  if (z.model.moe_gate != MoeGate::megatron) return options;
  // seq_aux_loss: the micro-batch's B sequences, whose tokens every slot holds [s, B].
  if (z.model.moe_load_balancing == MoeLoadBalancing::seq_aux_loss)
    options.sequences = static_cast<int>(z.B);
  options.sinkhorn = z.model.moe_load_balancing == MoeLoadBalancing::sinkhorn;
  return options;
}

std::int64_t router_statistics_size(const StepShape& z) {
  return 2 * z.model.num_experts * std::max(training_router_options(z).sequences, 1) + 2;
}

namespace {

// The router's options with the layer's expert bias, when it has one.
ops::RouterOptions biased_router_options(ops::RouterOptions options, const MoeRouterParameters& W) {
  if (W.expert_bias != nullptr)
    options.expert_bias = {W.expert_bias->value.data(),
                           static_cast<std::size_t>(W.expert_bias->value.numel())};
  return options;
}

// A layer's DeepSpeed-style gate losses on this rank: one per gate call (slot).
double gate_losses(const ModelConfig& m, const MoeActivations& A) {
  // MindSpeed's top-1 gate computes its loss and its layer discards it: only top-2's trains.
  if (m.moe_router_topk != 2) return 0;
  double sum = 0;
  for (const MoeSlot& S : A.slots)
    sum += ops::gate_balance_loss(S.probs, S.topk_index, m.moe_router_topk, m.moe_aux_loss_coeff);
  return sum;
}

// The statistics as a slot's tensor holds them: the counts and the probability sums (each
// `columns` wide: the experts, of each sequence under seq_aux_loss), the squared log-sum-exps and
// the tokens.
ops::RouterStatistics unpack_stats(const Tensor& stats) {
  const std::int64_t columns = (stats.numel() - 2) / 2;
  ops::RouterStatistics s;
  const float* p = stats.data();
  s.assignments.assign(p, p + columns);
  s.probability.assign(p + columns, p + 2 * columns);
  s.squared_lse = p[2 * columns];
  s.tokens = static_cast<std::int64_t>(std::llround(p[2 * columns + 1]));
  return s;
}

}  // namespace

void declare_router_parameters(ParameterDeclarer& declare, const std::string& prefix,
                               MoeRouterParameters& W) {
  const ModelConfig& m = declare.model;
  const std::int64_t h = m.hidden_size, E = m.num_experts;
  // The MoE layer routes this rank's share of the tokens: with tp > 1 the router's gradient is a
  // partial sum over the tensor-parallel ranks, summed. MindSpeed's gate under tp without SP
  // routes the same tokens on every tp rank: its gradient is the same there, not summed. (Under
  // SP MindSpeed's gate sets sequence_parallel on its Linear module, not on the weight, whose
  // attribute Megatron's tp all-reduce of sequence-parallel gradients reads: MindSpeed never sums
  // that gradient and its tp ranks' copies drift apart; weave sums it and keeps them equal.)
  W.weight = &declare.replicated(
      declare.add(prefix + "router.weight", {E, h}, E, h, RowMap::range(0, E), 0, declare.std, 0),
      !plan_routes_replicated(m, declare.mesh.plan()));
  if (uses_expert_bias(m)) W.expert_bias = &declare.state(prefix + "router.expert_bias", {E});
}

ops::RouterStatistics route_tokens(const ModelConfig& m, const MoeRouterParameters& W,
                                   const Tensor& x, const Tensor& logits, const Tensor& probs,
                                   std::span<std::int32_t> topk_index, const Tensor& topk_weight) {
  ops::linear_forward(x, W.weight->value, Tensor{}, logits);
  // MindSpeed's gate balances whatever tokens it is given: a decoded token alone too.
  if (m.moe_use_sinkhorn) ops::sinkhorn_forward(logits, logits);
  return ops::router_forward(biased_router_options(router_options(m), W), logits, probs, topk_index,
                             topk_weight);
}

void route_slot(const StepShape& z, const MoeRouterParameters& W, MoeSlot& A) {
  const ModelConfig& m = z.model;
  // A bf16 run routes in fp32 as Megatron-Core with --moe-router-dtype fp32 (and MindSpeed's
  // gate, which casts its input and weight to fp32): the bf16 input and the weight's bf16 copy
  // widened, their products summed in fp32, the logits, softmax and top-k in fp32.
  ops::linear_forward(A.moe_in, compute_value(*W.weight), Tensor{}, A.router_logits);
  ops::RouterOptions options = biased_router_options(training_router_options(z), W);
  // The DeepSpeed-style gate takes its weights after the dispatch plan's drops (permute_slot).
  if (m.moe_gate == MoeGate::deepspeed) options.renormalize = false;
  // MindSpeed's gate with --moe-use-sinkhorn routes on the call's balanced logits.
  const Tensor& routed = m.moe_use_sinkhorn ? A.balanced_logits : A.router_logits;
  if (m.moe_use_sinkhorn) ops::sinkhorn_forward(A.router_logits, A.balanced_logits);
  const ops::RouterStatistics st =
      ops::router_forward(options, routed, A.probs, std::span(A.topk_index), A.topk_weight);
  float* s = A.stats.data();
  const auto columns = static_cast<std::int64_t>(st.assignments.size());
  for (std::int64_t e = 0; e < columns; ++e) {
    s[e] = static_cast<float>(st.assignments[e]);
    s[columns + e] = static_cast<float>(st.probability[e]);
  }
  s[2 * columns] = static_cast<float>(st.squared_lse);
  s[2 * columns + 1] = static_cast<float>(st.tokens);
}

void route_slot_backward(const StepShape& z, const MoeRouterParameters& W,
                         const Tensor& stats_total, double loss_scale, MoeSlot& A) {
  const ModelConfig& m = z.model;
  if (m.moe_gate == MoeGate::deepspeed) {
    // MindSpeed back-propagates each gate call's loss unscaled (its own loss scaler's scale is
    // never set), and Megatron's data-parallel reduction averages the gradients. A loss scaler's
    // scale multiplies it here as every gradient its unscaling divides.
    const double balance =
        m.moe_router_topk == 2 ? loss_scale * m.moe_aux_loss_coeff / z.plan.data_parallel : 0.0;
    ops::gate_backward<float>(A.dispatch, A.probs, A.topk_index, A.d_topk, balance,
                              A.d_router_logits);
    // Back through the Sinkhorn rounds (MindSpeed's autograd takes them), rerun from the
    // product's logits.
    if (m.moe_use_sinkhorn)
      ops::sinkhorn_backward(A.router_logits, A.d_router_logits, A.d_router_logits);
  } else {
    const ops::RouterStatistics st = unpack_stats(stats_total);
    // Megatron-Core's MoEAuxLossAutoScaler: the losses' gradient is the loss scale over the
    // number of micro-batches (the data-parallel average here too).
    const double scale = loss_scale / (z.M * z.plan.data_parallel);
    ops::router_backward<float>(training_router_options(z), A.router_logits, A.probs, A.topk_index,
                                A.topk_weight, A.d_topk, st, scale, A.d_router_logits);
  }
  ops::linear_backward_weight(A.moe_in, A.d_router_logits, W.weight->grad, Tensor{});
  // d_moe_in += d_logits W_router (d_moe is free again and holds the product).
  ops::linear_backward_input(A.d_router_logits, compute_value(*W.weight), A.d_moe);
  // A bf16 run: the router's input gradient is cast to the input's bf16, and the sum of the two
  // bf16 gradients of the bf16 input is rounded again.
  const bool bf16 = W.weight->value16.defined();
  if (bf16) round_in_place(m.precision, A.d_moe);
  ops::accumulate(A.d_moe, A.d_moe_in);
  if (bf16) round_in_place(m.precision, A.d_moe_in);
}

TaskId MoeMlp::statistics(const BuildPosition& pos, TaskId ready) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set, mb = pos.micro_batch;
  const bool counted = !pos.recomputing;
  const StepShape& z = P->shape;
  const rt::TaskTags tags = pos.tags(rt::Phase::forward, l);
  const std::string at = fmt::format("L{}.", l);
  TaskId summed = ready;
  if (z.ampipe > 1) {
    const double stats =
        static_cast<double>(z.ampipe + 1) * static_cast<double>(router_statistics_size(z) - 1);
    summed = P->compute(at + "router_statistics", tags, cost::streamed(z, stats), [p, layer, set] {
      LayerActivations& A = p->acts(set, layer);
      A.moe().stats_total.fill(0.f);
      for (const MoeSlot& S : A.moe().slots)
        ops::accumulate(S.stats, A.moe().stats_total);
    });
    P->after(ready, summed);
  }
  const TaskId reduced =
      P->tensor_context.all_reduce(summed, all_of(P->acts(set, l).moe().stats_total),
                                   devices::ReduceOp::sum, at + "router_stats", tags);
  const TaskId losses =
      P->compute(at + "router_losses", tags, cost::streamed(z, 2.0 * z.model.num_experts + 1),
                 [p, layer, set, mb, counted] {
                   const ModelConfig& m = p->shape.model;
                   const MoeActivations& A = p->acts(set, layer).moe();
                   double aux = 0;
                   if (m.moe_gate == MoeGate::deepspeed) {
                     aux = gate_losses(m, A);  // this rank's gate calls, each on its own tokens
                   } else {
                     const ops::RouterStatistics st = unpack_stats(A.stats_total);
                     const ops::RouterOptions options = training_router_options(p->shape);
                     aux = ops::aux_loss(options, st) + ops::z_loss(options, st);
                   }
                   if (counted) p->state.aux[static_cast<std::size_t>(mb)] += aux;
                 });
  P->after(reduced, losses);
  P->after(summed, losses);
  return losses;
}

}  // namespace weave::graphs
