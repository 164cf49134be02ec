// The MoE layer's router, its statistics and losses, the combine, and the layer's forward and
// backward at Ampipe degree 1.
#include <cmath>

#include "model/attention_block.hpp"
#include "moe/moe_mlp.hpp"
#include "step/step_costs.hpp"
#include "weave/ops/elementwise.hpp"
#include "weave/ops/linear.hpp"

namespace weave::graphs {

ops::RouterOptions router_options(const ModelConfig& m) {
  return {.top_k = m.moe_router_topk,
          .renormalize = m.moe_router_renormalize,
          .aux_loss_coeff = m.moe_aux_loss_coeff,
          .z_loss_coeff = m.moe_z_loss_coeff};
}

ops::ExpertActivation expert_activation(const ModelConfig& m) {
  return m.activation == Activation::swiglu ? ops::ExpertActivation::swiglu
                                            : ops::ExpertActivation::gelu_tanh;
}

Tensor slot_tokens(const RankProgram& P, int c, const Tensor& sbh) {
  const StepShape& z = P.shape;
  const std::int64_t n = z.slot_tokens();
  const Tensor tokens =
      z.sp() || z.tp == 1 ? sbh.reshape({z.T, z.h})
                          : sbh.slice(0, P.at.tp * (z.Sc / z.tp), z.Sc / z.tp).reshape({z.T, z.h});
  return tokens.slice(0, c * n, n);
}

namespace {

ops::RouterStatistics unpack_stats(const Tensor& stats, std::int64_t E) {
  ops::RouterStatistics s;
  const float* p = stats.data();
  s.assignments.assign(p, p + E);
  s.probability.assign(p + E, p + 2 * E);
  s.squared_lse = p[2 * E];
  s.tokens = static_cast<std::int64_t>(std::llround(p[2 * E + 1]));
  return s;
}

}  // namespace

std::string MoeMlp::slot_prefix(int c) const {
  return fmt::format("L{}.", l) + (P->shape.ampipe > 1 ? fmt::format("c{}.", c) : "");
}

SlotProgress MoeMlp::route(const BuildPosition& pos, int c, TaskId ready) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const rt::TaskTags tags = pos.tags(rt::Phase::forward, l);
  const std::int64_t E = z.model.num_experts;
  const int ep = z.ep;
  const bool items = z.expert_items();
  const TaskId router = P->compute(
      slot_prefix(c) + "router", tags, cost::router(z, static_cast<double>(z.slot_tokens())), [=] {
        MoeSlot& A = p->slot(set, layer, c);
        const ModelConfig& m = p->shape.model;
        A.moe_in.copy_from(slot_tokens(*p, c, p->acts(set, layer).ln2));
        ops::linear_forward(A.moe_in, p->moe_parameters(layer).router_weight->value, Tensor{},
                            A.router_logits);
        const ops::RouterStatistics st = ops::router_forward(
            router_options(m), A.router_logits, A.probs, std::span(A.topk_index), A.topk_weight);
        float* s = A.stats.data();
        for (std::int64_t e = 0; e < E; ++e) {
          s[e] = static_cast<float>(st.assignments[e]);
          s[E + e] = static_cast<float>(st.probability[e]);
        }
        s[2 * E] = static_cast<float>(st.squared_lse);
        s[2 * E + 1] = static_cast<float>(st.tokens);
        // Capacity applies per slot (per Ampipe chunk, as MindSpeed does).
        A.dispatch = ops::plan_dispatch(A.topk_index, A.tokens, m.moe_router_topk, E,
                                        {.capacity_factor = m.moe_expert_capacity_factor});
        // Every rank routes different tokens (its SP shard, tp slice, cp chunks, dp batch).
        p->state.routed_picks += A.tokens * m.moe_router_topk;
        p->state.dropped_picks += A.dispatch.dropped;
        if (ep == 1) {
          ops::permute_tokens(A.dispatch, A.moe_in, A.grouped.slice(0, 0, A.dispatch.rows()));
          return;
        }
        if (items)
          frame_items(p->shape, A);
        else
          frame_dispatch(p->shape, A);
      });
  P->after(ready, router);
  if (ep == 1) return {router, {}};
  if (z.chained_items()) return {router, {}};  // the item pipeline issues them in its chain
  if (items) {
    // Every item's dispatch is launched now; the router is what the statistics wait for.
    SlotProgress out{router, {}};
    const std::size_t count = P->slot(set, l, c).items.size();
    for (std::size_t i = 0; i < count; ++i)
      out.items.push_back(item_exchange(pos, c, static_cast<int>(i), router, &ExpertItem::send,
                                        &ExpertItem::arrived, true, true, "dispatch",
                                        rt::Phase::forward));
    return out;
  }
  return {slot_exchange(pos, c, router, &MoeSlot::grouped, &MoeSlot::arrived, true, "dispatch",
                        /*framed=*/true, rt::Phase::forward),
          {}};
}

TaskId MoeMlp::statistics(const BuildPosition& pos, TaskId ready) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set, mb = pos.micro_batch;
  const StepShape& z = P->shape;
  const rt::TaskTags tags = pos.tags(rt::Phase::forward, l);
  const std::string at = fmt::format("L{}.", l);
  TaskId summed = ready;
  if (z.ampipe > 1) {
    const double stats = static_cast<double>(z.ampipe + 1) * (2 * z.model.num_experts + 1);
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
                 [p, layer, set, mb] {
                   const ModelConfig& m = p->shape.model;
                   const ops::RouterStatistics st =
                       unpack_stats(p->acts(set, layer).moe().stats_total, m.num_experts);
                   p->state.aux[static_cast<std::size_t>(mb)] +=
                       ops::aux_loss(router_options(m), st) + ops::z_loss(router_options(m), st);
                 });
  P->after(reduced, losses);
  P->after(summed, losses);
  return losses;
}

TaskId MoeMlp::combine(const BuildPosition& pos, int c, const SlotProgress& computed) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const std::int64_t h = P->shape.h;
  const TaskId combined = P->compute(
      slot_prefix(c) + "combine", pos.tags(rt::Phase::forward, l),
      cost::streamed(P->shape, cost::combine_elements(P->shape)), [=] {
        MoeSlot& A = p->slot(set, layer, c);
        for (const ExpertItem& I : A.items)  // the items' results back into the slot's rows
          for (std::size_t x = 0; x < I.rows.size(); ++x)
            std::copy_n(I.back.row(static_cast<std::int64_t>(x)), h, A.expert_out.row(I.rows[x]));
        ops::combine_tokens(A.dispatch, A.expert_out.slice(0, 0, A.dispatch.rows()), A.topk_weight,
                            A.moe_out);
      });
  P->after(computed.task, combined);
  for (TaskId returned : computed.items)
    P->after(returned, combined);
  return combined;
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

SlotProgress MoeMlp::combine_backward(const BuildPosition& pos, int c, TaskId ready) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const std::int64_t h = P->shape.h;
  const TaskId combined = P->compute(
      slot_prefix(c) + "combine_backward", pos.tags(rt::Phase::backward, l),
      cost::streamed(P->shape, 2 * cost::combine_elements(P->shape)), [=] {
        MoeSlot& A = p->slot(set, layer, c);
        // This slot's tokens' output gradient.
        A.d_moe.copy_from(slot_tokens(*p, c, p->ws().d_mlp));
        const std::int64_t rows = A.dispatch.rows();
        ops::combine_tokens_backward(A.dispatch, A.expert_out.slice(0, 0, rows), A.topk_weight,
                                     A.d_moe, A.d_expert_out.slice(0, 0, rows), A.d_topk);
        for (ExpertItem& I : A.items)  // each item's rows, by destination
          for (std::size_t x = 0; x < I.rows.size(); ++x)
            std::copy_n(A.d_expert_out.row(I.rows[x]), h,
                        I.d_back.row(static_cast<std::int64_t>(x)));
      });
  P->after(ready, combined);
  if (P->shape.ep == 1) return {combined, {}};
  if (P->shape.chained_items()) return {combined, {}};  // issued in the item pipeline's chain
  if (P->shape.expert_items()) {
    SlotProgress out{combined, {}};
    const std::size_t count = P->slot(set, l, c).items.size();
    for (std::size_t i = 0; i < count; ++i)
      out.items.push_back(item_exchange(pos, c, static_cast<int>(i), combined, &ExpertItem::d_back,
                                        &ExpertItem::d_arrived, true, false, "combine_backward",
                                        rt::Phase::backward));
    return out;
  }
  return {slot_exchange(pos, c, combined, &MoeSlot::d_expert_out, &MoeSlot::d_arrived, true,
                        "combine_backward", false, rt::Phase::backward),
          {}};
}

TaskId MoeMlp::router_backward(const BuildPosition& pos, int c, const SlotProgress& home) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const std::int64_t h = z.h;
  const double tokens = static_cast<double>(z.slot_tokens());
  const TaskId router = P->compute(
      slot_prefix(c) + "router_backward", pos.tags(rt::Phase::backward, l),
      2 * cost::router(z, tokens), [=] {
        MoeSlot& A = p->slot(set, layer, c);
        const MoeMlpParameters& W = p->moe_parameters(layer);
        const StepShape& z = p->shape;
        for (const ExpertItem& I : A.items)  // each item's input gradients into the slot's rows
          for (std::size_t x = 0; x < I.rows.size(); ++x)
            std::copy_n(I.d_home.row(static_cast<std::int64_t>(x)), h, A.d_grouped.row(I.rows[x]));
        ops::permute_tokens_backward(A.dispatch, A.d_grouped.slice(0, 0, A.dispatch.rows()),
                                     A.d_moe_in);
        const ops::RouterStatistics st =
            unpack_stats(p->acts(set, layer).moe().stats_total, z.model.num_experts);
        const double scale = 1.0 / (z.M * z.plan.data_parallel);
        ops::router_backward<float>(router_options(z.model), A.router_logits, A.probs, A.topk_index,
                                    A.topk_weight, A.d_topk, st, scale, A.d_router_logits);
        ops::linear_backward_weight(A.moe_in, A.d_router_logits, W.router_weight->grad, Tensor{});
        // d_moe_in += d_logits W_router (d_moe is free again and holds the product).
        ops::linear_backward_input(A.d_router_logits, W.router_weight->value, A.d_moe);
        ops::accumulate(A.d_moe, A.d_moe_in);
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
