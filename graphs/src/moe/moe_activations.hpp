// What a MoE layer's MLP keeps for one micro-batch: a slot per Ampipe chunk (one without Ampipe)
// with its routing, dispatch and expert rows, forward and backward, and the router's statistics
// of the whole micro-batch.
#pragma once

#include <cstdint>
#include <vector>

#include "weave/ops/moe_dispatch.hpp"
#include "weave/ops/tensor.hpp"

namespace weave::graphs {

using ops::Tensor;

// --use-pipe-experts: one item of a MoE slot, the picks bound for local expert `expert` of every
// expert-parallel rank (capacity slice `slice` of them), with its own all-to-alls.
struct ExpertItem {
  int expert = 0, slice = 0;
  std::vector<std::int64_t> rows;  // the slot's grouped rows it carries, by destination rank
  std::vector<std::int64_t> send_rows, recv_rows, framed_send_rows, framed_recv_rows;  // [ep]
  Tensor send, arrived;             // framed: one header row (the count) per destination / source
  Tensor expert_in, expert_result;  // by source
  Tensor back;                      // results home, by destination
  Tensor d_back, d_arrived, d_expert_in, d_home;  // backward
  // Its rows of the slot's hidden layers (hidden_pre, hidden; split, item_d_hidden and
  // item_d_pre too): the first row, taken when its forward runs (item_rows).
  std::int64_t hidden_at = 0;
  // Experts split over tp: this rank's rows of the item (expert_in) and every tp rank's
  // gathered, fc2's partial sums of them (fc1's input-gradient partial sums in backward) and the
  // gathered output gradients.
  std::int64_t tp_send_rows = 0;
  Tensor tp_gathered, tp_partial, tp_d_gathered;                   // [tp in, h]
  std::vector<std::int64_t> tp_gathered_rows, tp_d_gathered_rows;  // [tp]
};

// The router's state of a slot: each token's logits, probabilities and top-k picks and weights,
// the slot's statistics for the losses, and their gradients.
struct MoeRouterState {
  Tensor router_logits, probs, topk_weight, stats;
  // --moe-use-sinkhorn: the gate's Sinkhorn-balanced logits, which it routes on (router_logits
  // keeps the product's, which the backward reruns the rounds from).
  Tensor balanced_logits;
  std::vector<std::int32_t> topk_index;
  Tensor d_topk, d_router_logits;
};

// The token dispatcher's state of a slot: the plan that permutes the picks into expert order and
// back, the rows grouped by expert (sent to the experts' ranks) and the experts' outputs in the
// same order, and under expert parallelism the all-to-alls' rows and counts.
struct MoeDispatchState {
  ops::DispatchPlan dispatch;
  Tensor grouped, expert_out;
  // Expert parallelism: rows leave grouped by destination rank, arrive grouped by source rank
  // (each source's rows in local-expert order), and are regrouped by local expert to run. The
  // dispatch frames each destination's rows with header rows holding their per-expert counts,
  // so one all-to-all carries both (no separate count exchange ahead of it); every later
  // exchange moves unframed rows.
  Tensor counts_recv;                              // [ep x local experts]: rows per expert
  std::vector<std::int64_t> send_rows, recv_rows;  // [ep]: rows per destination / source
  std::vector<std::int64_t> framed_send_rows, framed_recv_rows;  // the same plus headers
  Tensor arrived, leaving;                                       // [ep tokens k (+ headers), h]
  std::vector<std::int64_t> local_begin;  // [local experts + 1] rows of expert_in
  std::vector<std::int64_t> source_row;   // expert_in row -> unframed arrival row
  std::vector<std::int64_t> arrived_row;  // expert_in row -> row of `arrived`
  Tensor d_grouped, d_expert_out, d_arrived, d_leaving;
};

// The experts' state of a slot: the rows they ran (regrouped by local expert under expert
// parallelism), their hidden layer before and after the activation, their results, and the
// gradients.
struct MoeExpertsState {
  Tensor hidden_pre, hidden;
  Tensor expert_in, expert_result;  // [capacity, h], expert parallelism
  Tensor d_expert_in, d_expert_result;
  // Experts split over the tensor-parallel group (StepShape::experts_split): the rows this rank
  // received framed with their per-local-expert counts, every tp rank's gathered (each block
  // framed), fc2's partial sums of all of them (in backward fc1's input-gradient partial sums),
  // and this rank's rows reduced; in backward the output gradients of this rank's rows and of
  // every rank's.
  Tensor tp_send;                                   // [H + capacity, h]
  std::int64_t tp_send_rows = 0;                    // framed rows this rank sends
  Tensor tp_gathered;                               // [tp (H + capacity), h]
  std::vector<std::int64_t> tp_gathered_rows;       // [tp]: framed rows of each block
  std::vector<std::int64_t> tp_rows;                // [tp]: unframed rows of each block
  std::vector<std::vector<std::int64_t>> tp_begin;  // [tp][local experts + 1]: expert offsets
  Tensor tp_partial;                                // [tp capacity, h]
  Tensor tp_result;                                 // [capacity, h]
  Tensor tp_d_rows;                                 // [capacity, h]
  std::int64_t tp_d_send_rows = 0;
  Tensor tp_d_gathered;                          // [tp capacity, h]
  std::vector<std::int64_t> tp_d_gathered_rows;  // [tp]
  Tensor tp_d_in;                                // [capacity, h]
  Tensor saved_d_pre;  // a split backward: the experts' first-product gradient, for W
  // Items (--use-pipe-experts, --ampipe-tp-sp-comm-overlap): their hidden layers are rows of
  // hidden_pre and hidden, each item's taken in turn as its forward runs (items_hidden_rows of
  // them so far), and split over tp their gradients rows of these.
  std::int64_t items_hidden_rows = 0;
  Tensor item_d_hidden, item_d_pre;  // [tp capacity, f / tp], [tp capacity, f1 / tp]
};

// One MoE slot: the tokens a rank routes at once (all of its T tokens, or one Ampipe chunk of
// them), their input and output rows and gradients, and each part's state. The parts' fields
// are the slot's own, so each part's code reads them by name.
struct MoeSlot : MoeRouterState, MoeDispatchState, MoeExpertsState {
  std::int64_t tokens = 0;
  Tensor moe_in, moe_out;  // [n, h]
  Tensor d_moe, d_moe_in;
  // --use-pipe-experts or the tp-sp overlap: the slot's work cut into items, each with the
  // dispatcher's and the experts' rows of its own.
  std::vector<ExpertItem> items;
};

// Item I's `rows` rows of its slot's hidden-layer buffer `slot_buffer` (hidden_pre, hidden,
// item_d_hidden, item_d_pre).
inline Tensor item_rows(const Tensor& slot_buffer, const ExpertItem& I, std::int64_t rows) {
  return slot_buffer.slice(0, I.hidden_at, rows);
}
// Item I's forward takes its `rows` rows of slot S's hidden layers, after those of the items that
// ran before it: the slot's items together hold at most the rows the slot can receive, what the
// slot's hidden layers are sized for. The items' forwards run one after another on the compute
// stream, after the slot's router reset the count (permute_slot).
inline void take_hidden_rows(MoeExpertsState& S, ExpertItem& I, std::int64_t rows) {
  I.hidden_at = S.items_hidden_rows;
  S.items_hidden_rows += rows;
}

// --moe-shared-expert-intermediate-size: what the shared experts keep for one micro-batch. Their
// input is the norm gathered over sp (the norm itself otherwise); fc1's and the activation's
// outputs are this rank's columns; fc2's partial sums are reduced into `out` (in place without
// sp).
struct SharedExpertActivations {
  Tensor input;         // [Sc, B, h]
  Tensor fc1, act;      // [Sc, B, f1 / tp], [Sc, B, f / tp]
  Tensor partial, out;  // [Sc, B, h], [Sl, B, h]
  // --moe-shared-expert-gate: the output before the gate and each token's gate score, on the
  // norm's rows (out's).
  Tensor ungated;  // as out
  Tensor gate;     // [out's rows, 1]
  // A zero-bubble schedule's I action: the output gradients the W action's weight gradients read
  // (fc2's output, gathered over sp, and fc1's), kept as the workspace is reused meanwhile.
  Tensor saved_d_out;  // [Sc, B, h]
  Tensor saved_d_fc1;  // [Sc, B, f1 / tp]
};

// The shared experts' share of the backward's workspace, one per device: the output gradient
// gathered over sp (the layer's d_mlp otherwise), the activation's and fc1's output gradients,
// and the input gradient's partial sums and their reduction.
struct SharedExpertWorkspace {
  Tensor d_out;            // [Sc, B, h]
  Tensor d_act, d_fc1;     // [Sc, B, f / tp], [Sc, B, f1 / tp]
  Tensor d_in_full, d_in;  // [Sc, B, h], [Sl, B, h]
  // --moe-shared-expert-gate: the gradient of the output before the gate (d_mlp times the gate),
  // and of each token's gate logit.
  Tensor d_gated;  // as d_mlp
  Tensor d_logit;  // [d_mlp's rows, 1]
};

struct MoeActivations {
  std::vector<MoeSlot> slots;
  Tensor stats_total;  // the statistics the router's losses use (router_statistics_size)
  SharedExpertActivations shared;  // with shared experts only
};

}  // namespace weave::graphs
