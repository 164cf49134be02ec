// The MoE layer's buffers for one micro-batch: each slot's router, dispatcher and experts state
// (sized for the largest split the routing allows), and the pipe-experts items'.
#include "moe/moe_mlp.hpp"
#include "moe/moe_router.hpp"
#include "moe/moe_shared_experts.hpp"
#include "step/working_set.hpp"

namespace weave::graphs {

namespace {

// --use-pipe-experts and --ampipe-tp-sp-comm-overlap: the buffers of every item (local expert x
// capacity slice) of a slot. What its collectives move is the item's own, sized for the most
// rows the item can carry (a source sends an expert at most one pick per token): the collectives
// hold those buffers' spans from when the graph is built, while the routing that decides how a
// slot's rows fall into its items is known only when the step runs. Its hidden layer (kept for
// the backward) and, split over tp, its gradients are rows of the slot's (allocate_experts),
// taken by each item as its forward runs (take_hidden_rows): together the items hold at most
// the rows the slot can receive, as the experts without items do.
void allocate_items(RankProgram& P, MoeSlot& slot) {
  const StepShape& z = P.shape;
  const std::int64_t n = z.slot_tokens(), k = z.model.moe_router_topk, h = z.h, ep = z.ep;
  // A source sends an expert at most one pick per token (and at most its capacity).
  const std::int64_t capacity = z.expert_capacity();
  const std::int64_t in = ep * (capacity > 0 ? std::min(n, capacity) : n);
  const int slices = z.item_slices();
  // Split experts run every tensor-parallel rank's rows of the item (routed replicated, the rows
  // every tp rank holds alike).
  const std::int64_t run = z.experts_split() && !z.routes_replicated ? z.tp * in : in;
  for (int e = 0; e < z.local_experts(); ++e)
    for (int j = 0; j < slices; ++j) {
      ExpertItem& I = slot.items.emplace_back();
      I.expert = e;
      I.slice = j;
      for (auto* v : {&I.send_rows, &I.recv_rows, &I.framed_send_rows, &I.framed_recv_rows})
        v->assign(static_cast<std::size_t>(ep), 0);
      I.send = P.activation({n * k + ep, h});
      I.arrived = P.activation({in + ep, h});
      I.expert_in = P.activation({in, h});
      I.expert_result = P.activation({in, h});
      I.back = P.activation({n * k, h});
      I.d_back = P.activation({n * k, h});
      I.d_arrived = P.activation({in, h});
      I.d_expert_in = P.activation({in, h});
      I.d_home = P.activation({n * k, h});
      if (z.experts_split()) {
        I.tp_gathered = P.activation({run, h});
        I.tp_partial = P.activation({run, h});
        I.tp_d_gathered = P.activation({run, h});
        I.tp_gathered_rows.assign(static_cast<std::size_t>(z.tp), 0);
        I.tp_d_gathered_rows.assign(static_cast<std::size_t>(z.tp), 0);
      }
    }
}

// The router's: each token's logits, probabilities and picks, and the slot's statistics (the
// micro-batch's own without Ampipe).
void allocate_router(RankProgram& P, const MoeActivations& M, MoeSlot& S) {
  const StepShape& z = P.shape;
  const std::int64_t E = z.model.num_experts, k = z.model.moe_router_topk, n = z.slot_tokens();
  S.router_logits = P.activation({n, E});
  if (z.model.moe_use_sinkhorn) S.balanced_logits = P.activation({n, E});
  S.probs = P.activation({n, E});
  S.topk_weight = P.activation({n, k});
  S.topk_index.assign(static_cast<std::size_t>(n * k), 0);
  S.stats = z.ampipe == 1 ? M.stats_total : P.activation({router_statistics_size(z)});
  S.d_topk = P.activation({n, k});
  S.d_router_logits = P.activation({n, E});
}

// The dispatcher's: the picks grouped by expert and the experts' outputs in that order, and under
// EP the all-to-alls' rows.
void allocate_dispatch(RankProgram& P, MoeSlot& S) {
  const StepShape& z = P.shape;
  const std::int64_t k = z.model.moe_router_topk, h = z.h, n = z.slot_tokens(), ep = z.ep;
  // Under EP the dispatch sends `grouped` framed by header rows; items send their own rows.
  if (ep == 1 || !z.expert_items())
    S.grouped = P.activation({n * k + (ep > 1 ? ep * z.header_rows() : 0), h});
  S.expert_out = P.activation({n * k, h});
  S.d_grouped = P.activation({n * k, h});
  S.d_expert_out = P.activation({n * k, h});
  // Items (expert_items) send and receive in buffers of their own (allocate_items).
  if (ep == 1 || z.expert_items()) return;
  const std::int64_t capacity = z.slot_capacity();
  S.counts_recv = P.activation({ep * z.local_experts()});
  for (auto* v : {&S.send_rows, &S.recv_rows, &S.framed_send_rows, &S.framed_recv_rows})
    v->assign(static_cast<std::size_t>(ep), 0);
  S.arrived = P.activation({capacity + ep * z.header_rows(), h});
  S.leaving = P.activation({capacity, h});
  S.d_arrived = P.activation({capacity, h});
  S.d_leaving = P.activation({capacity, h});
}

// The experts': their hidden layers, under EP the rows regrouped by expert, and split over tp
// every tp rank's rows gathered.
void allocate_experts(RankProgram& P, MoeSlot& S) {
  const StepShape& z = P.shape;
  const std::int64_t h = z.h, capacity = z.slot_capacity();
  // Split experts run every tensor-parallel rank's rows on this rank's share of the hidden layer
  // (routed replicated, the rows every tp rank holds alike).
  const std::int64_t expert_rows =
      z.experts_split() && !z.routes_replicated ? z.tp * capacity : capacity;
  S.hidden_pre = P.activation({expert_rows, z.expert_local_f1()});
  // --recompute-modules moe_act: the rank's one hidden layer, computed again where read.
  S.hidden = kept_or_shared(z.model.recompute.recomputes(kRecomputeMoeActivation),
                            P.state.recomputed_expert_hidden, [&] {
                              return P.activation({expert_rows, z.expert_local_f()});
                            });
  if (z.splits_backward && !z.expert_items())
    S.saved_d_pre = P.activation({expert_rows, z.expert_local_f1()});
  if (z.expert_items()) {  // the items' rows of the hidden layer's gradients (allocate_items)
    if (z.experts_split()) {
      S.item_d_hidden = P.activation({expert_rows, z.expert_local_f()});
      S.item_d_pre = P.activation({expert_rows, z.expert_local_f1()});
    }
    return;
  }
  if (z.ep > 1) {
    S.expert_in = P.activation({capacity, h});
    S.expert_result = P.activation({capacity, h});
    S.d_expert_in = P.activation({capacity, h});
    S.d_expert_result = P.activation({capacity, h});
  }
  if (!z.experts_split() || z.expert_items() || z.routes_replicated) return;
  const std::int64_t H = z.header_rows();
  S.tp_send = P.activation({H + capacity, h});
  S.tp_gathered = P.activation({z.tp * (H + capacity), h});
  S.tp_partial = P.activation({expert_rows, h});
  S.tp_result = P.activation({capacity, h});
  S.tp_d_rows = P.activation({capacity, h});
  S.tp_d_gathered = P.activation({expert_rows, h});
  S.tp_d_in = P.activation({capacity, h});
  for (auto* v : {&S.tp_gathered_rows, &S.tp_rows, &S.tp_d_gathered_rows})
    v->assign(static_cast<std::size_t>(z.tp), 0);
  S.tp_begin.assign(static_cast<std::size_t>(z.tp),
                    std::vector<std::int64_t>(static_cast<std::size_t>(z.local_experts()) + 1));
}

// MoE slot c of a layer: the tokens the rank routes at once (all of them, or an Ampipe chunk),
// and each part's state of them.
void allocate_slot(RankProgram& P, LayerActivations& A, int c) {
  const StepShape& z = P.shape;
  MoeSlot& S = A.moe().slots[static_cast<std::size_t>(c)];
  const std::int64_t n = z.slot_tokens(), h = z.h;
  S.tokens = n;
  S.moe_in = P.activation({n, h});
  // The slot's output: its rows of the layer's MLP output, or (tensor parallelism without SP,
  // each tp rank routing a slice) this rank's tokens before the all-gather.
  S.moe_out =
      z.routes_tp_slices() ? P.activation({n, h}) : A.mlp_out.reshape({z.T, h}).slice(0, c * n, n);
  S.d_moe = P.activation({n, h});
  S.d_moe_in = P.activation({n, h});
  allocate_router(P, A.moe(), S);
  allocate_dispatch(P, S);
  allocate_experts(P, S);
  if (z.expert_items()) allocate_items(P, S);
}

}  // namespace

void MoeMlp::allocate(LayerActivations& A) const {
  const StepShape& z = P->shape;
  if (z.model.recompute.recomputes(kRecomputeMoe)) {
    // Recomputed whole: the layer's MoE state is the rank's working set (laid out by the first
    // MoE layer that takes it); only the layer's norm output, its input, is its own.
    LayerActivations& W = P->state.recomputed_moe_layer;
    if (!W.mlp_out.defined()) {
      W.ln2 = A.ln2;
      allocate_state(W);
    }
    A.mlp = W.mlp;
    A.mlp_out = W.mlp_out;
    // Without SP the shared experts read the norm's output itself: this layer's.
    if (z.model.has_shared_experts() && !z.sp()) A.moe().shared.input = A.ln2;
    return;
  }
  allocate_state(A);
}

void MoeMlp::allocate_state(LayerActivations& A) const {
  const StepShape& z = P->shape;
  MoeActivations& M = A.mlp.emplace<MoeActivations>();
  M.stats_total = P->activation({router_statistics_size(z)});
  A.mlp_out = P->activation({z.routes_tp_slices() ? z.Sc : z.Sl, z.B, z.h});
  M.slots.resize(static_cast<std::size_t>(z.ampipe));
  for (int c = 0; c < z.ampipe; ++c)
    allocate_slot(*P, A, c);
  if (z.model.has_shared_experts()) SharedExperts(*P, l).allocate(A);
}

}  // namespace weave::graphs
