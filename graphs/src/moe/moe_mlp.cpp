// A MoE layer's MLP composed of its parts, as Megatron-Core's MoELayer runs its router, token
// dispatcher and experts: the slot's tokens, the phases that run the parts in order, and the
// layer's forward and backward at Ampipe degree 1.
#include "moe/moe_mlp.hpp"
#include "model/half_precision.hpp"
#include "moe/moe_experts.hpp"
#include "moe/moe_router.hpp"
#include "moe/moe_shared_experts.hpp"
#include "moe/moe_token_dispatcher.hpp"
#include "step/step_costs.hpp"
#include "weave/ops/elementwise.hpp"

namespace weave::graphs {

Tensor slot_tokens(const RankProgram& P, int c, const Tensor& sbh) {
  const StepShape& z = P.shape;
  const std::int64_t n = z.slot_tokens();
  if (!z.routes_tp_slices()) return sbh.reshape({z.T, z.h}).slice(0, c * n, n);
  // Replicated: tp rank j routes slice j of every chunk, so that a chunk's slices are routed
  // once the chunk's norm is there and gather back into the chunk's contiguous rows.
  const std::int64_t rows = z.Sc / (z.tp * z.ampipe);
  return sbh.slice(0, c * (z.Sc / z.ampipe) + P.at.tp * rows, rows).reshape({n, z.h});
}

void MoeMlp::declare_parameters(ParameterDeclarer& declare, const LayerSpec&, int layer,
                                MoeMlpParameters& L) {
  const std::string prefix = fmt::format("layers.{}.moe.", layer);
  declare_router_parameters(declare, prefix, L.router);
  declare_experts_parameters(declare, prefix, L.experts);
  if (declare.model.has_shared_experts()) {
    declare_shared_expert_parameters(declare, prefix, L.shared);
    L.shared_gate = declare_shared_expert_gate(declare, prefix);
  }
}

std::string MoeMlp::slot_prefix(int c) const {
  return fmt::format("L{}.", l) + (P->shape.ampipe > 1 ? fmt::format("c{}.", c) : "");
}

SlotProgress MoeMlp::route(const BuildPosition& pos, int c, TaskId ready) const {
  return dispatch(pos, c, router(pos, c, ready));
}

TaskId MoeMlp::router(const BuildPosition& pos, int c, TaskId ready) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const bool counted = !pos.recomputing;
  const StepShape& z = P->shape;
  const rt::TaskTags tags = pos.chunk_tags(rt::Phase::forward, l, slot_chunk(c));
  // The logits' product, and the tokens' copy, scores and permutation that stream around it.
  const rt::CostHint price = cost::router(z, static_cast<double>(z.slot_tokens())) +
                             cost::routing(z) + cost::einsum_dispatch(z);
  const TaskId routed = P->compute(slot_prefix(c) + "router", tags, price, [=] {
    MoeSlot& A = p->slot(set, layer, c);
    A.moe_in.copy_from(slot_tokens(*p, c, p->acts(set, layer).ln2));
    route_slot(p->shape, p->moe_parameters(layer).router, A);
    permute_slot(*p, layer, A, counted);
    // MindSpeed's gate weighs the experts' bf16 outputs with its weights cast to bf16
    // (combine_weights.type_as(input)); Megatron-Core's fp32 router keeps them fp32.
    if (p->half() && p->shape.model.moe_gate == MoeGate::deepspeed)
      round_in_place(p->precision(), A.topk_weight);
  });
  P->after(ready, routed);
  return routed;
}

TaskId MoeMlp::forward(const BuildPosition& pos, TaskId ready) const {
  const StepShape& z = P->shape;
  const bool shared = z.model.has_shared_experts(), overlap = z.model.moe_shared_expert_overlap;
  const SharedExperts shared_experts(*P, l);
  // Shared experts: before the router, as Megatron-Core's MoELayer runs them. Overlapped, in the
  // places Megatron-Core's alltoall dispatcher calls them from: the input's sp all-gather
  // (pre_forward_comm) once the router has run and fc1 with the activation
  // (linear_fc1_forward_and_act) once the tokens are permuted, both while the dispatch
  // all-to-all is in flight (the router's task permutes; the compute stream runs fc1 after it,
  // before the experts that wait for the dispatch); fc2 and its reduction (linear_fc2_forward,
  // post_forward_comm) once the experts have run, while the combine all-to-all is in flight.
  TaskId shared_out = rt::kNoTask;
  if (shared && !overlap) shared_out = shared_experts.forward(pos, ready);
  const TaskId permuted = router(pos, 0, shared && !overlap ? shared_out : ready);
  const SlotProgress routed = dispatch(pos, 0, permuted);
  TaskId shared_fc1 = rt::kNoTask;
  if (shared && overlap)
    shared_fc1 =
        shared_experts.fc1_forward(pos, permuted, shared_experts.gather_input(pos, permuted));
  const TaskId stats = statistics(pos, routed.task);
  const SlotProgress computed = experts(pos, 0, routed);
  if (shared && overlap) shared_out = shared_experts.fc2_forward(pos, shared_fc1);
  const TaskId combined = combine(pos, 0, computed);
  P->after(stats, combined);
  TaskId routed_out = combined;
  if (z.routes_tp_slices())  // Without SP the layer's output is replicated: gather the slices.
    routed_out = P->tensor.all_gather(
        combined, read_of(P->slot(pos.set, l, 0).moe_out), all_of(P->acts(pos.set, l).mlp_out),
        fmt::format("L{}.moe_gather", l), pos.tags(rt::Phase::forward, l));
  if (!shared) return routed_out;
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const TaskId sum = P->compute(
      fmt::format("L{}.shared_expert_add", l), pos.tags(rt::Phase::forward, l),
      cost::streamed(z, 3.0 * static_cast<double>(P->acts(pos.set, l).mlp_out.numel())), [=] {
        LayerActivations& A = p->acts(set, layer);
        // A 16-bit run: the shared experts' reduced (or gated) output and the sum are 16-bit
        // values, as Megatron-Core's bf16 MoELayer adds two bf16 outputs.
        if (p->half()) round_in_place(p->precision(), A.moe().shared.out);
        ops::accumulate(A.moe().shared.out, A.mlp_out);
        if (p->half()) round_in_place(p->precision(), A.mlp_out);
      });
  P->after(routed_out, sum);
  P->after(shared_out, sum);
  return sum;
}

TaskId MoeMlp::router_backward(const BuildPosition& pos, int c, const SlotProgress& home) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const double tokens = static_cast<double>(z.slot_tokens());
  const TaskId router = P->compute(
      slot_prefix(c) + "router_backward", pos.chunk_tags(rt::Phase::backward, l, slot_chunk(c)),
      2 * cost::router(z, tokens) + cost::routing_backward(z) + cost::einsum_dispatch_backward(z),
      [=] {
        MoeSlot& A = p->slot(set, layer, c);
        unpermute_gradients(p->shape, A, p->half());
        route_slot_backward(p->shape, p->moe_parameters(layer).router,
                            p->acts(set, layer).moe().stats_total,
                            p->opt.loss_scaling ? p->inputs.loss_scale : 1.0, A);
      });
  P->after(home.task, router);
  for (TaskId item : home.items)
    P->after(item, router);
  return router;
}

TaskId MoeMlp::backward(const BuildPosition& pos, TaskId ready, WeightHalves& halves) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const bool shared = z.model.has_shared_experts(), overlap = z.model.moe_shared_expert_overlap;
  const SharedExperts shared_experts(*P, l);
  const SlotProgress combined = combine_backward(pos, 0, ready);
  // Overlapped shared experts: the mirror of their forward, in the order autograd runs
  // Megatron-Core's (it runs the ready node of the highest sequence number first, and
  // SharedExpertMLP sets those numbers): the gate's backward and their output gradient's sp
  // all-gather first (the reduce-scatter's backward, numbered last); fc2's backward once the
  // combine's gradient all-to-all is launched (that all-to-all numbered last as well), so while it
  // is in flight; the activation's and fc1's backward after the routed experts' (numbered just
  // below the dispatch all-to-all, whose backward is launched first, and _BackwardStreamWait
  // holding their stream behind the routed experts' backward), while the dispatch's gradient
  // all-to-all is in flight; then their input gradient's reduction (pre_forward_comm's backward).
  TaskId shared_fc2 = rt::kNoTask, shared_grad = rt::kNoTask;
  if (shared && overlap) shared_fc2 = shared_experts.fc2_backward(pos, ready, halves);
  halves.flush();  // the layer above's, while the combine's gradient is in flight
  const SlotProgress dispatched = experts_backward(pos, 0, combined, halves);
  if (shared && overlap) shared_grad = shared_experts.fc1_backward(pos, shared_fc2, halves);
  const TaskId router = router_backward(pos, 0, dispatched);
  // Routed replicated, every tp rank's input gradient is the whole sequence's already.
  const bool local = !z.routes_tp_slices();
  const std::int64_t T = z.T, h = z.h;
  const TaskId placed =
      P->compute(fmt::format("L{}.moe_input_grad", l), pos.tags(rt::Phase::backward, l),
                 cost::streamed(z, 2.0 * T * h), [=] {
                   if (local)
                     p->ws().d_norm.reshape({T, h}).copy_from(p->slot(set, layer, 0).d_moe_in);
                 });
  P->after(router, placed);
  // Replicated layout: every rank needs the whole sequence's input gradient.
  const TaskId routed_grad =
      local ? placed
            : P->tensor.all_gather(router, read_of(P->slot(set, l, 0).d_moe_in),
                                   all_of(P->ws().d_norm), fmt::format("L{}.moe_grad_gather", l),
                                   pos.tags(rt::Phase::backward, l));
  if (!shared) return routed_grad;
  // Not overlapped: the shared experts' backward after the routed experts', the reverse of their
  // forward's order.
  if (!overlap) shared_grad = shared_experts.backward(pos, routed_grad, halves);
  const TaskId sum =
      P->compute(fmt::format("L{}.shared_expert_grad_add", l), pos.tags(rt::Phase::backward, l),
                 cost::streamed(z, 3.0 * static_cast<double>(P->ws().d_norm.numel())), [=] {
                   BackwardWorkspace& w = p->ws();
                   // A 16-bit run: the two input gradients and their sum are 16-bit values.
                   if (p->half()) round_in_place(p->precision(), w.shared_expert.d_in);
                   ops::accumulate(w.shared_expert.d_in, w.d_norm);
                   if (p->half()) round_in_place(p->precision(), w.d_norm);
                 });
  P->after(routed_grad, sum);
  P->after(shared_grad, sum);
  return sum;
}

}  // namespace weave::graphs
