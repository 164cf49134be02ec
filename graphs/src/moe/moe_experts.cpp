// The MoE layer's token dispatcher and experts: the expert-parallel all-to-alls (framed with
// per-expert counts), regrouping by local expert, the experts forward and backward, and the
// items of --use-pipe-experts.
#include <array>

#include "moe/moe_mlp.hpp"
#include "step/step_costs.hpp"
#include "weave/ops/experts.hpp"

namespace weave::graphs {

void frame_dispatch(const StepShape& z, MoeSlot& A) {
  const std::int64_t local = z.local_experts(), H = z.header_rows(), h = z.h;
  const ops::DispatchPlan& D = A.dispatch;
  std::int64_t at = 0;
  for (int j = 0; j < z.ep; ++j) {
    std::fill_n(A.grouped.row(at), H * h, 0.f);
    float* header = A.grouped.row(at);
    for (std::int64_t e = 0; e < local; ++e)
      header[e] =
          static_cast<float>(D.expert_begin[j * local + e + 1] - D.expert_begin[j * local + e]);
    at += H;
    const std::int64_t first = D.expert_begin[j * local], last = D.expert_begin[(j + 1) * local];
    for (std::int64_t row = first; row < last; ++row, ++at)
      std::copy_n(A.moe_in.row(D.row_token[row]), h, A.grouped.row(at));
    // In place: the collectives hold spans of these vectors from when the graph was built.
    A.send_rows[j] = last - first;
    A.framed_send_rows[j] = H + last - first;
  }
}

void frame_items(const StepShape& z, MoeSlot& A) {
  const std::int64_t local = z.local_experts(), h = z.h;
  const std::int64_t slices = z.item_slices();
  const ops::DispatchPlan& D = A.dispatch;
  for (ExpertItem& I : A.items) {
    I.rows.clear();
    std::int64_t at = 0;
    for (int p = 0; p < z.ep; ++p) {
      const std::int64_t e = p * local + I.expert;
      const std::int64_t begin = D.expert_begin[e], count = D.expert_begin[e + 1] - begin;
      const std::int64_t lo = begin + count * I.slice / slices,
                         hi = begin + count * (I.slice + 1) / slices;
      std::fill_n(I.send.row(at), h, 0.f);
      I.send.row(at)[0] = static_cast<float>(hi - lo);
      ++at;
      for (std::int64_t row = lo; row < hi; ++row, ++at) {
        std::copy_n(A.moe_in.row(D.row_token[row]), h, I.send.row(at));
        I.rows.push_back(row);
      }
      // In place: the collectives hold spans of these vectors from when the graph was built.
      I.send_rows[p] = hi - lo;
      I.framed_send_rows[p] = 1 + hi - lo;
    }
  }
}

void regroup_by_expert(const StepShape& z, MoeSlot& A) {
  const std::int64_t local = z.local_experts(), H = z.header_rows();
  const int ep = z.ep;
  float* counts = A.counts_recv.data();  // [source][local expert]
  std::vector<std::int64_t> source_begin(static_cast<std::size_t>(ep) + 1, 0);
  std::int64_t framed_begin = 0;
  for (int j = 0; j < ep; ++j) {
    std::copy_n(A.arrived.row(framed_begin), local, counts + j * local);
    A.recv_rows[j] = A.framed_recv_rows[j] - H;
    source_begin[j + 1] = source_begin[j] + A.recv_rows[j];
    framed_begin += A.framed_recv_rows[j];
  }
  A.local_begin.assign(static_cast<std::size_t>(local) + 1, 0);
  A.source_row.clear();
  A.arrived_row.clear();
  for (std::int64_t e = 0; e < local; ++e) {
    for (int j = 0; j < ep; ++j) {
      std::int64_t offset = source_begin[j];
      for (std::int64_t x = 0; x < e; ++x)
        offset += static_cast<std::int64_t>(counts[j * local + x]);
      const auto n = static_cast<std::int64_t>(counts[j * local + e]);
      for (std::int64_t i = 0; i < n; ++i) {
        A.source_row.push_back(offset + i);
        A.arrived_row.push_back(offset + i + (j + 1) * H);
      }
    }
    A.local_begin[e + 1] = static_cast<std::int64_t>(A.source_row.size());
  }
  if (A.local_begin.back() != source_begin.back())
    throw std::logic_error(fmt::format("expert-parallel regrouping: {} rows arrived, counts say {}",
                                       source_begin.back(), A.local_begin.back()));
}

TaskId MoeMlp::slot_exchange(const BuildPosition& pos, int c, TaskId ready, Tensor MoeSlot::*from,
                             Tensor MoeSlot::*into, bool outbound, const std::string& name,
                             bool framed, rt::Phase phase) const {
  const StepShape& z = P->shape;
  MoeSlot& S = P->slot(pos.set, l, c);
  std::vector<std::int64_t>* sent = framed ? &S.framed_send_rows : &S.send_rows;
  std::vector<std::int64_t>* received = framed ? &S.framed_recv_rows : &S.recv_rows;
  if (!outbound) std::swap(sent, received);
  // Balanced routing, for the cost hint: every kept pick of the slot's tokens, plus headers.
  const std::int64_t expected_rows =
      std::min(z.slot_tokens() * z.model.moe_router_topk, z.slot_capacity()) +
      (framed ? z.ep * z.header_rows() : 0);
  return P->expert.all_to_all_v(ready,
                                {.send = read_of(S.*from),
                                 .send_counts = sent,
                                 .recv = all_of(S.*into),
                                 .recv_counts = std::span<std::int64_t>(*received),
                                 .expected_rows = expected_rows},
                                z.h, slot_prefix(c) + name, pos.tags(phase, l));
}

TaskId MoeMlp::item_exchange(const BuildPosition& pos, int c, int i, TaskId ready,
                             Tensor ExpertItem::*from, Tensor ExpertItem::*into, bool outbound,
                             bool framed, const std::string& name, rt::Phase phase) const {
  const StepShape& z = P->shape;
  ExpertItem& I = P->slot(pos.set, l, c).items[static_cast<std::size_t>(i)];
  // --pipe-experts-separate-streams: dispatches and combines on streams of their own.
  const std::string stream = !z.plan.pipe_experts_separate_streams ? std::string()
                             : outbound                            ? "ep_dispatch"
                                                                   : "ep_combine";
  // Balanced routing, for the cost hint: an item carries 1/(local experts x slices) of the picks.
  const std::int64_t expected_rows =
      z.slot_tokens() * z.model.moe_router_topk / (z.local_experts() * z.item_slices()) +
      (framed ? z.ep : 0);
  auto* sent = framed ? &I.framed_send_rows : outbound ? &I.send_rows : &I.recv_rows;
  auto* received = framed ? &I.framed_recv_rows : outbound ? &I.recv_rows : &I.send_rows;
  return P->expert.all_to_all_v(ready,
                                {.send = read_of(I.*from),
                                 .send_counts = sent,
                                 .recv = all_of(I.*into),
                                 .recv_counts = std::span<std::int64_t>(*received),
                                 .expected_rows = expected_rows},
                                z.h, slot_prefix(c) + fmt::format("i{}.", i) + name,
                                pos.tags(phase, l), stream);
}

SlotProgress MoeMlp::experts(const BuildPosition& pos, int c, const SlotProgress& routed) const {
  if (P->shape.expert_items()) {
    if (P->shape.experts_split()) return split_item_pipeline(pos, {c}, {routed})[0];
    return experts_items(pos, c, routed);
  }
  if (P->shape.experts_split()) return split_experts(pos, c, routed);
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const int ep = z.ep;
  const std::int64_t h = z.h;
  const TaskId experts = P->compute(
      slot_prefix(c) + "experts", pos.tags(rt::Phase::forward, l),
      cost::experts(z, static_cast<double>(z.slot_tokens())), [=] {
        MoeSlot& A = p->slot(set, layer, c);
        const MoeMlpParameters& W = p->moe_parameters(layer);
        const ops::ExpertActivation act = expert_activation(p->shape.model);
        if (ep == 1) {
          const std::int64_t rows = A.dispatch.rows();
          ops::experts_forward(act, A.grouped.slice(0, 0, rows), A.dispatch.expert_begin,
                               W.expert_fc1->value, W.expert_fc2->value,
                               A.hidden_pre.slice(0, 0, rows), A.hidden.slice(0, 0, rows),
                               A.expert_out.slice(0, 0, rows));
          return;
        }
        regroup_by_expert(p->shape, A);
        const auto rows = static_cast<std::int64_t>(A.source_row.size());
        for (std::int64_t i = 0; i < rows; ++i)
          std::copy_n(A.arrived.row(A.arrived_row[i]), h, A.expert_in.row(i));
        ops::experts_forward(act, A.expert_in.slice(0, 0, rows), A.local_begin, W.expert_fc1->value,
                             W.expert_fc2->value, A.hidden_pre.slice(0, 0, rows),
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
  const rt::CostHint per_item =
      cost::expert_item(z, static_cast<double>(z.slot_tokens()), z.item_slices());
  SlotProgress out{routed.task, {}};
  for (std::size_t i = 0; i < routed.items.size(); ++i) {
    const TaskId experts =
        P->compute(slot_prefix(c) + fmt::format("i{}.experts", i), pos.tags(rt::Phase::forward, l),
                   per_item, [=] {
                     ExpertItem& I = p->slot(set, layer, c).items[i];
                     const MoeMlpParameters& W = p->moe_parameters(layer);
                     std::int64_t at = 0, rows = 0;
                     for (int q = 0; q < ep; ++q) {
                       const std::int64_t count = I.framed_recv_rows[q] - 1;
                       const auto announced = static_cast<std::int64_t>(I.arrived.row(at)[0]);
                       if (announced != count)
                         throw std::logic_error(fmt::format(
                             "pipe experts: expert-parallel rank {} announced {} rows and sent {}",
                             q, announced, count));
                       I.recv_rows[q] = count;
                       for (std::int64_t x = 0; x < count; ++x)
                         std::copy_n(I.arrived.row(at + 1 + x), h, I.expert_in.row(rows + x));
                       at += 1 + count;
                       rows += count;
                     }
                     const std::array<std::int64_t, 2> begin{0, rows};
                     ops::experts_forward(
                         expert_activation(p->shape.model), I.expert_in.slice(0, 0, rows), begin,
                         W.expert_fc1->value.slice(0, I.expert, 1),
                         W.expert_fc2->value.slice(0, I.expert, 1), I.hidden_pre.slice(0, 0, rows),
                         I.hidden.slice(0, 0, rows), I.expert_result.slice(0, 0, rows));
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
  if (P->shape.expert_items()) {
    if (P->shape.experts_split())
      return split_item_pipeline_backward(pos, {c}, {arrived}, halves)[0];
    return experts_backward_items(pos, c, arrived);
  }
  if (P->shape.experts_split()) return split_experts_backward(pos, c, arrived, halves);
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
  const rt::CostHint experts_flops = cost::experts(z, static_cast<double>(z.slot_tokens()));
  const std::string at = slot_prefix(c);
  const TaskId experts = P->compute(
      at + "experts_backward", pos.tags(rt::Phase::backward, l), (keep ? 1 : 2) * experts_flops,
      [=] {
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
          ops::experts_backward_input(act, E.x, E.begin, W.expert_fc1->value, W.expert_fc2->value,
                                      pre, hid, E.dy, E.dx, A.saved_d_pre.slice(0, 0, E.rows));
        else
          ops::experts_backward(act, E.x, E.begin, W.expert_fc1->value, W.expert_fc2->value, pre,
                                hid, E.dy, E.dx, W.expert_fc1->grad, W.expert_fc2->grad);
        if (ep > 1)
          for (std::size_t i = 0; i < A.source_row.size(); ++i)
            std::copy_n(A.d_expert_in.row(static_cast<std::int64_t>(i)), h,
                        A.d_leaving.row(A.source_row[i]));
      });
  P->after(arrived.task, experts);
  if (keep)
    halves.place(WeightPlacement::zero_bubble, [=] {
      return p->compute(at + "experts_weight_grad", pos.tags(rt::Phase::weight, layer),
                        experts_flops, [=] {
                          MoeSlot& A = p->slot(set, layer, c);
                          const MoeMlpParameters& W = p->moe_parameters(layer);
                          const ExpertRows E = expert_rows(A);
                          ops::experts_backward_weight(E.x, E.begin, A.hidden.slice(0, 0, E.rows),
                                                       E.dy, A.saved_d_pre.slice(0, 0, E.rows),
                                                       W.expert_fc1->grad, W.expert_fc2->grad);
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
        slot_prefix(c) + fmt::format("i{}.experts_backward", i), pos.tags(rt::Phase::backward, l),
        2 * per_item, [=] {
          ExpertItem& I = p->slot(set, layer, c).items[i];
          const MoeMlpParameters& W = p->moe_parameters(layer);
          std::int64_t rows = 0;
          for (int q = 0; q < ep; ++q)
            rows += I.recv_rows[q];
          const std::array<std::int64_t, 2> begin{0, rows};
          ops::experts_backward(
              expert_activation(p->shape.model), I.expert_in.slice(0, 0, rows), begin,
              W.expert_fc1->value.slice(0, I.expert, 1), W.expert_fc2->value.slice(0, I.expert, 1),
              I.hidden_pre.slice(0, 0, rows), I.hidden.slice(0, 0, rows),
              I.d_arrived.slice(0, 0, rows), I.d_expert_in.slice(0, 0, rows),
              W.expert_fc1->grad.slice(0, I.expert, 1), W.expert_fc2->grad.slice(0, I.expert, 1));
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
