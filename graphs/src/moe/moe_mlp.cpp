// A MoE layer's MLP composed of its parts, as Megatron-Core's MoELayer runs its router, token
// dispatcher and experts: the slot's tokens, the phases that run the parts in order, and the
// layer's forward and backward at Ampipe degree 1.
#include "moe/moe_mlp.hpp"
#include "model/half_precision.hpp"
#include "moe/moe_experts.hpp"
#include "moe/moe_router.hpp"
#include "moe/moe_token_dispatcher.hpp"
#include "step/step_costs.hpp"

namespace weave::graphs {

Tensor slot_tokens(const RankProgram& P, int c, const Tensor& sbh) {
  const StepShape& z = P.shape;
  const std::int64_t n = z.slot_tokens();
  const Tensor tokens =
      z.sp() || z.tp == 1 ? sbh.reshape({z.T, z.h})
                          : sbh.slice(0, P.at.tp * (z.Sc / z.tp), z.Sc / z.tp).reshape({z.T, z.h});
  return tokens.slice(0, c * n, n);
}

void MoeMlp::declare_parameters(ParameterDeclarer& declare, const LayerSpec&, int layer,
                                MoeMlpParameters& L) {
  const std::string prefix = fmt::format("layers.{}.moe.", layer);
  declare_router_parameters(declare, prefix, L.router);
  declare_experts_parameters(declare, prefix, L.experts);
}

std::string MoeMlp::slot_prefix(int c) const {
  return fmt::format("L{}.", l) + (P->shape.ampipe > 1 ? fmt::format("c{}.", c) : "");
}

SlotProgress MoeMlp::route(const BuildPosition& pos, int c, TaskId ready) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const bool counted = !pos.recomputing;
  const StepShape& z = P->shape;
  const rt::TaskTags tags = pos.chunk_tags(rt::Phase::forward, l, slot_chunk(c));
  const TaskId router = P->compute(
      slot_prefix(c) + "router", tags, cost::router(z, static_cast<double>(z.slot_tokens())), [=] {
        MoeSlot& A = p->slot(set, layer, c);
        A.moe_in.copy_from(slot_tokens(*p, c, p->acts(set, layer).ln2));
        route_slot(p->shape.model, p->moe_parameters(layer).router, A);
        permute_slot(*p, layer, A, counted);
        // MindSpeed's gate weighs the experts' bf16 outputs with its weights cast to bf16
        // (combine_weights.type_as(input)); Megatron-Core's fp32 router keeps them fp32.
        if (p->half() && p->shape.model.moe_gate == MoeGate::deepspeed)
          round_in_place(p->precision(), A.topk_weight);
      });
  P->after(ready, router);
  return dispatch(pos, c, router);
}

TaskId MoeMlp::forward(const BuildPosition& pos, TaskId ready) const {
  const StepShape& z = P->shape;
  const SlotProgress routed = route(pos, 0, ready);
  const TaskId stats = statistics(pos, routed.task);
  const TaskId combined = combine(pos, 0, experts(pos, 0, routed));
  P->after(stats, combined);
  if (z.sp() || z.tp == 1) return combined;
  // Without SP the layer's output is replicated: gather the ranks' slices.
  return P->tensor.all_gather(combined, read_of(P->slot(pos.set, l, 0).moe_out),
                              all_of(P->acts(pos.set, l).mlp_out), fmt::format("L{}.moe_gather", l),
                              pos.tags(rt::Phase::forward, l));
}

TaskId MoeMlp::router_backward(const BuildPosition& pos, int c, const SlotProgress& home) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const double tokens = static_cast<double>(z.slot_tokens());
  const TaskId router = P->compute(slot_prefix(c) + "router_backward",
                                   pos.chunk_tags(rt::Phase::backward, l, slot_chunk(c)),
                                   2 * cost::router(z, tokens), [=] {
                                     MoeSlot& A = p->slot(set, layer, c);
                                     unpermute_gradients(p->shape, A, p->half());
                                     route_slot_backward(p->shape, p->moe_parameters(layer).router,
                                                         p->acts(set, layer).moe().stats_total, A);
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
  const SlotProgress combined = combine_backward(pos, 0, ready);
  halves.flush();  // the layer above's, while the combine's gradient is in flight
  const TaskId router = router_backward(pos, 0, experts_backward(pos, 0, combined, halves));
  const bool local = z.sp() || z.tp == 1;
  const std::int64_t T = z.T, h = z.h;
  const TaskId placed =
      P->compute(fmt::format("L{}.moe_input_grad", l), pos.tags(rt::Phase::backward, l),
                 cost::streamed(z, 2.0 * T * h), [=] {
                   if (local)
                     p->ws().d_norm.reshape({T, h}).copy_from(p->slot(set, layer, 0).d_moe_in);
                 });
  P->after(router, placed);
  if (local) return placed;
  // Replicated layout: every rank needs the whole sequence's input gradient.
  return P->tensor.all_gather(router, read_of(P->slot(set, l, 0).d_moe_in), all_of(P->ws().d_norm),
                              fmt::format("L{}.moe_grad_gather", l),
                              pos.tags(rt::Phase::backward, l));
}

}  // namespace weave::graphs
