// The MoE layer's token dispatcher (as Megatron-Core's all-to-all token dispatcher): the dispatch
// plan that permutes each slot's top-k picks into expert order (dropping those over capacity),
// the expert-parallel all-to-alls that carry the rows to the experts' ranks (framed with their
// per-expert counts) and back, the regrouping by local expert, and the weighted combine into the
// slot's output rows; forward and backward, per slot or per --use-pipe-experts item.
#include <cstdint>
#include <span>

#include "model/half_precision.hpp"
#include "moe/moe_expert_bias.hpp"
#include "moe/moe_mlp.hpp"
#include "moe/moe_token_dispatcher.hpp"
#include "step/step_costs.hpp"
#include "weave/ops/deepspeed_gate.hpp"

namespace weave::graphs {

namespace {

// A hash of one slot's routing: each token's experts and whether each pick was kept, by the
// token's place in the slot. Summed over picks (the order of a token's picks, which changes its
// output by rounding only, does not count) and over slots (the step's digest does not depend on
// the order they run in).
std::uint64_t routing_digest(int layer, const ops::DispatchPlan& plan,
                             std::span<const std::int32_t> topk_index) {
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i < topk_index.size(); ++i) {
    // splitmix64's finaliser over (layer, token, expert, kept)
    const auto token = static_cast<std::uint64_t>(i / static_cast<std::size_t>(plan.top_k));
    std::uint64_t x = (static_cast<std::uint64_t>(layer) << 48) ^ (token << 17) ^
                      (static_cast<std::uint64_t>(topk_index[i]) << 1) ^
                      static_cast<std::uint64_t>(plan.pick_row[i] >= 0);
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    sum += x ^ (x >> 31);
  }
  return sum;
}

}  // namespace

void permute_slot(RankProgram& P, int layer, MoeSlot& A, bool counted) {
  const StepShape& z = P.shape;
  const ModelConfig& m = z.model;
  // Capacity applies per slot: per rank and Ampipe chunk, where each gate call of MindSpeed's
  // sees its tokens (under tp without SP the whole chunk, on every tp rank).
  if (m.moe_gate == MoeGate::deepspeed) {
    const std::int64_t capacity =
        m.moe_no_drop ? 0
                      : ops::gate_capacity(A.tokens, m.num_experts, m.moe_router_topk,
                                           m.moe_train_capacity_factor);
    A.dispatch = ops::plan_dispatch(A.topk_index, A.tokens, m.moe_router_topk, m.num_experts,
                                    {.capacity = capacity, .first_choices_first = true});
    ops::gate_weights_after_drops(A.dispatch, A.topk_weight);
  } else {
    // Megatron-Core's probs policy ranks an expert's picks by their (renormalised) weights.
    std::span<const float> priority;
    if (m.moe_token_drop_by_probability)
      priority = {A.topk_weight.data(), static_cast<std::size_t>(A.tokens * m.moe_router_topk)};
    A.dispatch = ops::plan_dispatch(
        A.topk_index, A.tokens, m.moe_router_topk, m.num_experts,
        {.capacity_factor = m.moe_expert_capacity_factor, .pick_priority = priority});
  }
  // Every rank routes different tokens (its SP shard, tp slice, cp chunks, dp batch); routed
  // replicated, the tp ranks route the same ones, counted once.
  if (counted && (!z.routes_replicated || P.at.tp == 0)) {
    P.state.routed_picks += A.tokens * m.moe_router_topk;
    P.state.dropped_picks += A.dispatch.dropped;
    P.state.routing_digest += routing_digest(
        layer, A.dispatch,
        std::span<const std::int32_t>(A.topk_index).first(A.dispatch.pick_row.size()));
    count_expert_loads(P, layer, A.dispatch);
  }
  switch (z.spec(layer).moe_mlp.dispatcher) {
    case TokenDispatcher::permute:
      ops::permute_tokens(A.dispatch, A.moe_in, A.grouped.slice(0, 0, A.dispatch.rows()));
      break;
    case TokenDispatcher::all_to_all:
      frame_dispatch(z, A);
      break;
    case TokenDispatcher::item_all_to_all:
      frame_items(z, A);
      break;
  }
  A.items_hidden_rows = 0;  // the items take their hidden rows anew (take_hidden_rows)
}

void unpermute_gradients(const StepShape& z, MoeSlot& A, bool half) {
  for (const ExpertItem& I : A.items)  // each item's input gradients into the slot's rows
    for (std::size_t x = 0; x < I.rows.size(); ++x)
      std::copy_n(I.d_home.row(static_cast<std::int64_t>(x)), z.h, A.d_grouped.row(I.rows[x]));
  // A bf16 run's experts' input gradients are bf16 values (a tp-split expert's reduced sum is
  // rounded here, as the bf16 reduce-scatter leaves it); the picks of a token are summed in fp32
  // and rounded once, as a bf16 tensor's gradient.
  if (half) round_in_place(z.model.precision, A.d_grouped.slice(0, 0, A.dispatch.rows()));
  ops::permute_tokens_backward(A.dispatch, A.d_grouped.slice(0, 0, A.dispatch.rows()), A.d_moe_in);
  if (half) round_in_place(z.model.precision, A.d_moe_in);
}

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

TaskId MoeMlp::slot_exchange(const BuildPosition& pos, int c, TaskId ready,
                             Tensor MoeDispatchState::*from, Tensor MoeDispatchState::*into,
                             bool outbound, const std::string& name, bool framed,
                             rt::Phase phase) const {
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
                                z.h, slot_prefix(c) + name,
                                pos.chunk_tags(phase, l, slot_chunk(c)));
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
                                pos.chunk_tags(phase, l, slot_chunk(c)), stream);
}

SlotProgress MoeMlp::dispatch(const BuildPosition& pos, int c, TaskId permuted) const {
  const StepShape& z = P->shape;
  const int set = pos.set;
  const TokenDispatcher dispatcher = z.spec(l).moe_mlp.dispatcher;
  if (dispatcher == TokenDispatcher::permute) return {permuted, {}};
  if (z.chained_items()) return {permuted, {}};  // the item pipeline issues them in its chain
  if (dispatcher == TokenDispatcher::item_all_to_all) {
    // Every item's dispatch is launched now; the permutation is what the statistics wait for.
    SlotProgress out{permuted, {}};
    const std::size_t count = P->slot(set, l, c).items.size();
    for (std::size_t i = 0; i < count; ++i)
      out.items.push_back(item_exchange(pos, c, static_cast<int>(i), permuted, &ExpertItem::send,
                                        &ExpertItem::arrived, true, true, "dispatch",
                                        rt::Phase::forward));
    return out;
  }
  return {slot_exchange(pos, c, permuted, &MoeSlot::grouped, &MoeSlot::arrived, true, "dispatch",
                        /*framed=*/true, rt::Phase::forward),
          {}};
}

TaskId MoeMlp::combine(const BuildPosition& pos, int c, const SlotProgress& computed) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const std::int64_t h = P->shape.h;
  const TaskId combined = P->compute(
      slot_prefix(c) + "combine", pos.chunk_tags(rt::Phase::forward, l, slot_chunk(c)),
      cost::combine(P->shape) + cost::einsum_combine(P->shape), [=] {
        MoeSlot& A = p->slot(set, layer, c);
        for (const ExpertItem& I : A.items)  // the items' results back into the slot's rows
          for (std::size_t x = 0; x < I.rows.size(); ++x)
            std::copy_n(I.back.row(static_cast<std::int64_t>(x)), h, A.expert_out.row(I.rows[x]));
        const Tensor out = A.expert_out.slice(0, 0, A.dispatch.rows());
        // A bf16 run: the experts' outputs are bf16 values (a tp-split expert's reduced sum is
        // rounded here, as the bf16 reduce-scatter leaves it), weighed and summed in fp32 and
        // rounded once into the bf16 output, as Megatron-Core's unpermute with fp32 router
        // probabilities (--moe-router-dtype fp32) casts its fp32 sum back to the tokens' dtype.
        if (p->half()) round_in_place(p->precision(), out);
        ops::combine_tokens(A.dispatch, out, A.topk_weight, A.moe_out);
        if (p->half()) round_in_place(p->precision(), A.moe_out);
      });
  P->after(computed.task, combined);
  for (TaskId returned : computed.items)
    P->after(returned, combined);
  return combined;
}

SlotProgress MoeMlp::combine_backward(const BuildPosition& pos, int c, TaskId ready) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const std::int64_t h = P->shape.h;
  const TaskId combined = P->compute(
      slot_prefix(c) + "combine_backward", pos.chunk_tags(rt::Phase::backward, l, slot_chunk(c)),
      cost::combine_backward(P->shape) + cost::einsum_combine_backward(P->shape), [=] {
        MoeSlot& A = p->slot(set, layer, c);
        // This slot's tokens' output gradient.
        A.d_moe.copy_from(slot_tokens(*p, c, p->ws().d_mlp));
        const std::int64_t rows = A.dispatch.rows();
        // A bf16 run: the bf16 output's gradient is bf16, and so is the experts' outputs'.
        if (p->half()) round_in_place(p->precision(), A.d_moe);
        ops::combine_tokens_backward(A.dispatch, A.expert_out.slice(0, 0, rows), A.topk_weight,
                                     A.d_moe, A.d_expert_out.slice(0, 0, rows), A.d_topk);
        if (p->half()) round_in_place(p->precision(), A.d_expert_out.slice(0, 0, rows));
        for (ExpertItem& I : A.items)  // each item's rows, by destination
          for (std::size_t x = 0; x < I.rows.size(); ++x)
            std::copy_n(A.d_expert_out.row(I.rows[x]), h,
                        I.d_back.row(static_cast<std::int64_t>(x)));
      });
  P->after(ready, combined);
  const TokenDispatcher dispatcher = P->shape.spec(l).moe_mlp.dispatcher;
  if (dispatcher == TokenDispatcher::permute) return {combined, {}};
  if (P->shape.chained_items()) return {combined, {}};  // issued in the item pipeline's chain
  if (dispatcher == TokenDispatcher::item_all_to_all) {
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

}  // namespace weave::graphs
