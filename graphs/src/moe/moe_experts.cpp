// The MoE layer's experts (the experts Megatron-Core's MoESubmodules name): this rank's local
// experts' parameters, and their forward and backward on the rows the dispatcher grouped by
// expert, per slot or per --use-pipe-experts item. Split over the tensor-parallel group they run
// in moe_split_experts.cpp and moe_split_items.cpp.
#include <array>

#include "moe/expert_products.hpp"
#include "moe/moe_experts.hpp"
#include "moe/moe_mlp.hpp"
#include "moe/moe_token_dispatcher.hpp"
#include "step/step_costs.hpp"
#include "weave/ops/experts.hpp"

namespace weave::graphs {

ops::ExpertActivation expert_activation(const ModelConfig& m) {
  return m.activation == Activation::swiglu ? ops::ExpertActivation::swiglu
                                            : ops::ExpertActivation::gelu_tanh;
}

void declare_experts_parameters(ParameterDeclarer& declare, const std::string& prefix,
                                MoeExpertsParameters& W) {
  const ModelConfig& m = declare.model;
  const std::int64_t h = m.hidden_size, f = m.expert_ffn_hidden_size(), E = m.num_experts;
  const bool swiglu = m.activation == Activation::swiglu;
  const std::int64_t f1 = swiglu ? 2 * f : f;
  const std::int64_t local = E / declare.mesh.plan().expert_parallel, first = declare.at.ep * local;
  // Split over the tensor-parallel group (mesh.experts_split()), each local expert's fc1 holds
  // this rank's columns of the hidden layer (SwiGLU: its gates, then its values) and fc2 the
  // matching rows of the input dimension.
  const bool split = declare.mesh.experts_split();
  const std::int64_t etp = split ? declare.tp : 1, et = split ? declare.at.tp : 0;
  const std::int64_t fe = f / etp, f1e = swiglu ? 2 * fe : fe;
  RowMap fc1_rows;
  for (std::int64_t e = first; e < first + local; ++e) {
    fc1_rows.append(e * f1 + et * fe, fe);
    if (swiglu) fc1_rows.append(e * f1 + f + et * fe, fe);
  }
  W.fc1 = &declare.add(prefix + "experts.fc1.weight", {local, f1e, h}, E * f1, h, fc1_rows, 0,
                       declare.std, 0);
  W.fc2 = &declare.add(prefix + "experts.fc2.weight", {local, h, fe}, E * h, f,
                       RowMap::range(first * h, local * h), et * fe, declare.out_std, 0);
  W.fc1->expert = W.fc2->expert = true;
}

SlotProgress MoeMlp::experts(const BuildPosition& pos, int c, const SlotProgress& routed) const {
  const MoeSpec& spec = P->shape.spec(l).moe_mlp;
  const bool split = spec.experts == ExpertsModule::tensor_split;
  if (spec.dispatcher == TokenDispatcher::item_all_to_all)
    return split ? split_item_pipeline(pos, {c}, {routed})[0] : experts_items(pos, c, routed);
  if (split) return split_experts(pos, c, routed);
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const int ep = z.ep;
  const std::int64_t h = z.h;
  const rt::CostHint products = cost::experts(z, static_cast<double>(z.slot_tokens()));
  const TaskId experts = P->compute(
      slot_prefix(c) + "experts", pos.chunk_tags(rt::Phase::forward, l, slot_chunk(c)),
      ep > 1 ? products + cost::expert_regrouping(z) : products, [=] {
        MoeSlot& A = p->slot(set, layer, c);
        const MoeMlpParameters& W = p->moe_parameters(layer);
        const ops::ExpertActivation act = expert_activation(p->shape.model);
        if (ep == 1) {
          const std::int64_t rows = A.dispatch.rows();
          graphs::experts_forward(act, A.grouped.slice(0, 0, rows), A.dispatch.expert_begin,
                                  expert_weights(W.experts), A.hidden_pre.slice(0, 0, rows),
                                  A.hidden.slice(0, 0, rows), A.expert_out.slice(0, 0, rows));
          return;
        }
        regroup_by_expert(p->shape, A);
        const auto rows = static_cast<std::int64_t>(A.source_row.size());
        for (std::int64_t i = 0; i < rows; ++i)
          std::copy_n(A.arrived.row(A.arrived_row[i]), h, A.expert_in.row(i));
        graphs::experts_forward(act, A.expert_in.slice(0, 0, rows), A.local_begin,
                                expert_weights(W.experts), A.hidden_pre.slice(0, 0, rows),
                                A.hidden.slice(0, 0, rows), A.expert_result.slice(0, 0, rows));
        for (std::int64_t i = 0; i < rows; ++i)
          std::copy_n(A.expert_result.row(i), h, A.leaving.row(A.source_row[i]));
      });
  P->after(routed.task, experts);
  if (ep == 1) return {experts, {}};
  return {slot_exchange(pos, c, experts, &MoeSlot::leaving, &MoeSlot::expert_out, false, "combine",
                        false, rt::Phase::forward),
          {}};
}

SlotProgress MoeMlp::experts_items(const BuildPosition& pos, int c,
                                   const SlotProgress& routed) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const int ep = z.ep;
  const std::int64_t h = z.h;
  // Each item's arrived rows are copied into its experts' input (read and written) first.
  const rt::CostHint per_item =
      cost::expert_item(z, static_cast<double>(z.slot_tokens()), z.item_slices()) +
      cost::streamed(z, cost::regrouped_elements(z) /
                            static_cast<double>(z.local_experts() * z.item_slices()));
  SlotProgress out{routed.task, {}};
  for (std::size_t i = 0; i < routed.items.size(); ++i) {
    const TaskId experts = P->compute(
        slot_prefix(c) + fmt::format("i{}.experts", i),
        pos.chunk_tags(rt::Phase::forward, l, slot_chunk(c)), per_item, [=] {
          ExpertItem& I = p->slot(set, layer, c).items[i];
          const MoeMlpParameters& W = p->moe_parameters(layer);
          std::int64_t at = 0, rows = 0;
          for (int q = 0; q < ep; ++q) {
            const std::int64_t count = I.framed_recv_rows[q] - 1;
            const auto announced = static_cast<std::int64_t>(I.arrived.row(at)[0]);
            if (announced != count)
              throw std::logic_error(
                  fmt::format("pipe experts: expert-parallel rank {} announced {} rows and sent {}",
                              q, announced, count));
            I.recv_rows[q] = count;
            for (std::int64_t x = 0; x < count; ++x)
              std::copy_n(I.arrived.row(at + 1 + x), h, I.expert_in.row(rows + x));
            at += 1 + count;
            rows += count;
          }
          const std::array<std::int64_t, 2> begin{0, rows};
          MoeSlot& S = p->slot(set, layer, c);
          take_hidden_rows(S, I, rows);
          graphs::experts_forward(expert_activation(p->shape.model), I.expert_in.slice(0, 0, rows),
                                  begin, expert_weights(W.experts).expert(I.expert),
                                  item_rows(S.hidden_pre, I, rows), item_rows(S.hidden, I, rows),
                                  I.expert_result.slice(0, 0, rows));
        });
    P->after(routed.task, experts);
    P->after(routed.items[i], experts);
    out.items.push_back(item_exchange(pos, c, static_cast<int>(i), experts,
                                      &ExpertItem::expert_result, &ExpertItem::back, false, false,
                                      "combine", rt::Phase::forward));
  }
  return out;
}

SlotProgress MoeMlp::experts_backward(const BuildPosition& pos, int c, const SlotProgress& arrived,
                                      WeightHalves& halves) const {
  const MoeSpec& spec = P->shape.spec(l).moe_mlp;
  const bool split = spec.experts == ExpertsModule::tensor_split;
  if (spec.dispatcher == TokenDispatcher::item_all_to_all)
    return split ? split_item_pipeline_backward(pos, {c}, {arrived}, halves)[0]
                 : experts_backward_items(pos, c, arrived);
  if (split) return split_experts_backward(pos, c, arrived, halves);
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const int ep = z.ep;
  const std::int64_t h = z.h;
  // The rows the local experts ran, grouped by expert, with their offsets and gradients.
  struct ExpertRows {
    Tensor x, dy, dx;
    std::span<const std::int64_t> begin;
    std::int64_t rows;
  };
  auto expert_rows = [ep](MoeSlot& A) -> ExpertRows {
    if (ep == 1) {
      const std::int64_t rows = A.dispatch.rows();
      return {A.grouped.slice(0, 0, rows), A.d_expert_out.slice(0, 0, rows),
              A.d_grouped.slice(0, 0, rows), A.dispatch.expert_begin, rows};
    }
    const auto rows = static_cast<std::int64_t>(A.source_row.size());
    return {A.expert_in.slice(0, 0, rows), A.d_expert_result.slice(0, 0, rows),
            A.d_expert_in.slice(0, 0, rows), A.local_begin, rows};
  };
  const bool keep = halves.zero_bubble();
  // --recompute-modules moe_act: the task that reads the hidden layer for fc2's weight gradient
  // (this one, or the W action's) computes it again first.
  const bool again = z.model.recompute.recomputes(kRecomputeMoeActivation);
  const rt::CostHint experts_flops = cost::experts(z, static_cast<double>(z.slot_tokens()));
  const rt::CostHint activation_again =
      again ? cost::expert_activation(z, static_cast<double>(z.slot_tokens())) : rt::CostHint{};
  const std::string at = slot_prefix(c);
  const rt::CostHint backward_products =
      keep ? experts_flops : 2 * experts_flops + activation_again;
  const TaskId experts = P->compute(
      at + "experts_backward", pos.chunk_tags(rt::Phase::backward, l, slot_chunk(c)),
      ep > 1 ? backward_products + cost::expert_regrouping(z) : backward_products, [=] {
        MoeSlot& A = p->slot(set, layer, c);
        const MoeMlpParameters& W = p->moe_parameters(layer);
        const ops::ExpertActivation act = expert_activation(p->shape.model);
        if (ep > 1)  // the gradient rows arrived by source: regroup them by expert
          for (std::size_t i = 0; i < A.source_row.size(); ++i)
            std::copy_n(A.d_arrived.row(A.source_row[i]), h,
                        A.d_expert_result.row(static_cast<std::int64_t>(i)));
        const ExpertRows E = expert_rows(A);
        const Tensor pre = A.hidden_pre.slice(0, 0, E.rows), hid = A.hidden.slice(0, 0, E.rows);
        if (keep)  // the weight half waits for the W action
          graphs::experts_backward_input(act, E.x, E.begin, expert_weights(W.experts), pre, hid,
                                         E.dy, E.dx, A.saved_d_pre.slice(0, 0, E.rows));
        else
          graphs::experts_backward(act, E.x, E.begin, expert_weights(W.experts), pre, hid, E.dy,
                                   E.dx, W.experts.fc1->grad, W.experts.fc2->grad, again);
        if (ep > 1)
          for (std::size_t i = 0; i < A.source_row.size(); ++i)
            std::copy_n(A.d_expert_in.row(static_cast<std::int64_t>(i)), h,
                        A.d_leaving.row(A.source_row[i]));
      });
  P->after(arrived.task, experts);
  if (keep)
    halves.place(WeightPlacement::zero_bubble, [=, chunk = slot_chunk(c)] {
      return p->compute(at + "experts_weight_grad", pos.chunk_tags(rt::Phase::weight, layer, chunk),
                        experts_flops + activation_again, [=] {
                          MoeSlot& A = p->slot(set, layer, c);
                          const MoeMlpParameters& W = p->moe_parameters(layer);
                          const ExpertRows E = expert_rows(A);
                          graphs::experts_backward_weight(
                              expert_activation(p->shape.model), E.x, E.begin,
                              expert_weights(W.experts), A.hidden_pre.slice(0, 0, E.rows),
                              A.hidden.slice(0, 0, E.rows), E.dy, A.saved_d_pre.slice(0, 0, E.rows),
                              W.experts.fc1->grad, W.experts.fc2->grad, again);
                        });
    });
  if (ep == 1) return {experts, {}};
  return {slot_exchange(pos, c, experts, &MoeSlot::d_leaving, &MoeSlot::d_grouped, false,
                        "dispatch_backward", false, rt::Phase::backward),
          {}};
}

SlotProgress MoeMlp::experts_backward_items(const BuildPosition& pos, int c,
                                            const SlotProgress& arrived) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const int ep = z.ep;
  const rt::CostHint per_item =
      cost::expert_item(z, static_cast<double>(z.slot_tokens()), z.item_slices());
  SlotProgress out{arrived.task, {}};
  for (std::size_t i = 0; i < arrived.items.size(); ++i) {
    const TaskId experts = P->compute(
        slot_prefix(c) + fmt::format("i{}.experts_backward", i),
        pos.chunk_tags(rt::Phase::backward, l, slot_chunk(c)), 2 * per_item, [=] {
          ExpertItem& I = p->slot(set, layer, c).items[i];
          const MoeMlpParameters& W = p->moe_parameters(layer);
          std::int64_t rows = 0;
          for (int q = 0; q < ep; ++q)
            rows += I.recv_rows[q];
          const std::array<std::int64_t, 2> begin{0, rows};
          graphs::experts_backward(expert_activation(p->shape.model), I.expert_in.slice(0, 0, rows),
                                   begin, expert_weights(W.experts).expert(I.expert),
                                   item_rows(p->slot(set, layer, c).hidden_pre, I, rows),
                                   item_rows(p->slot(set, layer, c).hidden, I, rows),
                                   I.d_arrived.slice(0, 0, rows), I.d_expert_in.slice(0, 0, rows),
                                   W.experts.fc1->grad.slice(0, I.expert, 1),
                                   W.experts.fc2->grad.slice(0, I.expert, 1));
        });
    P->after(arrived.task, experts);
    P->after(arrived.items[i], experts);
    out.items.push_back(item_exchange(pos, c, static_cast<int>(i), experts,
                                      &ExpertItem::d_expert_in, &ExpertItem::d_home, false, false,
                                      "dispatch_backward", rt::Phase::backward));
  }
  return out;
}

}  // namespace weave::graphs
