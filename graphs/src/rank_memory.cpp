// What a rank allocates for its step: its shard, its activation and output sets (as many as the
// schedule has in flight), the gradient workspace its layers share, and the MoE slots' routing
// and expert buffers.
#include "rank_program.hpp"

#include "weave/ops/cross_entropy.hpp"

namespace weave::graphs {

namespace {

// --use-pipe-experts: the buffers of every item (local expert x capacity slice) of a slot.
void allocate_items(RankProgram& P, MoeSlot& slot) {
  const StepShape& z = P.shape;
  const std::int64_t n = z.slot_tokens(), k = z.model.moe_router_topk, h = z.h, ep = z.ep;
  const std::int64_t f1 = z.expert_f1(), f = z.f;
  // A source sends an expert at most one pick per token (and at most its capacity).
  const std::int64_t capacity = z.expert_capacity();
  const std::int64_t in = ep * (capacity > 0 ? std::min(n, capacity) : n);
  const int slices = z.plan.pipe_experts_slices();
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
      I.hidden_pre = P.activation({in, f1});
      I.hidden = P.activation({in, f});
      I.expert_result = P.activation({in, h});
      I.back = P.activation({n * k, h});
      I.d_back = P.activation({n * k, h});
      I.d_arrived = P.activation({in, h});
      I.d_expert_in = P.activation({in, h});
      I.d_home = P.activation({n * k, h});
    }
}

// MoE slot c of a layer: the tokens the rank routes at once (all of them, or an Ampipe chunk).
void allocate_slot(RankProgram& P, LayerActivations& A, int c) {
  const StepShape& z = P.shape;
  MoeSlot& S = A.moe[static_cast<std::size_t>(c)];
  const std::int64_t E = z.model.num_experts, k = z.model.moe_router_topk, h = z.h;
  const std::int64_t n = z.slot_tokens(), ep = z.ep;
  S.tokens = n;
  S.moe_in = P.activation({n, h});
  S.router_logits = P.activation({n, E});
  S.probs = P.activation({n, E});
  S.topk_weight = P.activation({n, k});
  S.topk_index.assign(static_cast<std::size_t>(n * k), 0);
  // Under EP the dispatch sends `grouped` framed by header rows.
  S.grouped = P.activation({n * k + (ep > 1 ? ep * z.header_rows() : 0), h});
  S.expert_out = P.activation({n * k, h});
  S.stats = z.ampipe == 1 ? A.stats_total : P.activation({2 * E + 2});
  // The slot's output: its rows of the layer's MLP output, or (tensor parallelism without SP)
  // this rank's tokens before the all-gather.
  S.moe_out =
      (z.sp() || z.tp == 1) ? A.mlp_out.reshape({z.T, h}).slice(0, c * n, n) : P.activation({n, h});
  const std::int64_t capacity = z.slot_capacity();
  S.hidden_pre = P.activation({capacity, z.expert_f1()});
  S.hidden = P.activation({capacity, z.f});
  if (z.splits_backward && !z.pipe_experts())
    S.saved_d_pre = P.activation({capacity, z.expert_f1()});
  if (ep > 1) {
    S.counts_recv = P.activation({ep * z.local_experts()});
    for (auto* v : {&S.send_rows, &S.recv_rows, &S.framed_send_rows, &S.framed_recv_rows})
      v->assign(static_cast<std::size_t>(ep), 0);
    S.arrived = P.activation({capacity + ep * z.header_rows(), h});
    S.expert_in = P.activation({capacity, h});
    S.expert_result = P.activation({capacity, h});
    S.leaving = P.activation({capacity, h});
    S.d_arrived = P.activation({capacity, h});
    S.d_expert_in = P.activation({capacity, h});
    S.d_expert_result = P.activation({capacity, h});
    S.d_leaving = P.activation({capacity, h});
  }
  if (z.pipe_experts()) allocate_items(P, S);
  S.d_moe = P.activation({n, h});
  S.d_grouped = P.activation({n * k, h});
  S.d_expert_out = P.activation({n * k, h});
  S.d_topk = P.activation({n, k});
  S.d_router_logits = P.activation({n, E});
  S.d_moe_in = P.activation({n, h});
}

// An activation set laid out for model chunk k's layers.
void allocate_set(RankProgram& P, ActivationSet& X, int k) {
  const StepShape& z = P.shape;
  const bool sp = z.sp();
  const std::int64_t Sl = z.Sl, Sc = z.Sc, B = z.B, h = z.h, Hl = z.Hl, d = z.d, cp = z.cp;
  const StageContents& holds = P.state.shard->contents();
  // Sets shared by chunks serve every one of them: the first chunk's embedding, a later
  // chunk's transfers.
  X.x_in = P.activation({Sl, B, h});
  if (holds.input_embedding) X.emb_partial = sp ? P.activation({Sc, B, h}) : X.x_in;
  if (P.layout.chunks() > 1) {
    X.d_send = P.activation({Sl, B, h});
    X.d_recv = P.activation({Sl, B, h});
  }
  Tensor x = X.x_in;
  const int first = P.layout.first_layer(k);
  X.layers.resize(static_cast<std::size_t>(P.layout.end_layer(k) - first));
  for (int l = first; l < P.layout.end_layer(k); ++l) {
    LayerActivations& A = X.layers[static_cast<std::size_t>(l - first)];
    const bool moe = P.layer(l).moe;
    A.x_in = x;
    A.ln1 = P.activation({Sl, B, h});
    A.ln1_mean = P.activation({Sl * B});
    A.ln1_rstd = P.activation({Sl * B});
    A.ln1_full = sp ? P.activation({Sc, B, h}) : A.ln1;
    A.qkv = P.activation({Sc, B, Hl, 3 * d});
    A.attn = P.activation({Sc, B, Hl, d});
    // Ampipe: one [B, Hl, q] block per (chunk, piece).
    A.lse = z.ampipe > 1 && moe ? P.activation({z.ampipe * z.t_sp, B, Hl, z.piece_rows()})
                                : P.activation({cp > 1 ? 2 : 1, B, Hl, z.chunk});
    A.proj_partial = P.activation({Sc, B, h});
    if (cp > 1 && z.ampipe > 1 && moe) {
      A.kv_store = P.activation({cp * Sc, B, Hl, 2 * d});
      A.kv_local = A.kv_store.slice(0, P.at.cp * Sc, Sc);
    } else if (cp > 1) {
      A.kv_local = P.activation({Sc, B, Hl, 2 * d});
    }
    A.proj_out = sp ? P.activation({Sl, B, h}) : A.proj_partial;
    A.x_mid = P.activation({Sl, B, h});
    A.ln2 = P.activation({Sl, B, h});
    A.ln2_mean = P.activation({Sl * B});
    A.ln2_rstd = P.activation({Sl * B});
    if (moe) {
      const std::int64_t E = z.model.num_experts;
      A.stats_total = P.activation({2 * E + 2});
      A.mlp_out = sp || z.tp == 1 ? P.activation({Sl, B, h}) : P.activation({Sc, B, h});
      A.moe.resize(static_cast<std::size_t>(z.ampipe));
      for (int c = 0; c < z.ampipe; ++c)
        allocate_slot(P, A, c);
    } else {
      A.ln2_full = sp ? P.activation({Sc, B, h}) : A.ln2;
      A.fc1 = P.activation({Sc, B, z.f1l});
      A.act = P.activation({Sc, B, z.fl});
      A.fc2_partial = P.activation({Sc, B, h});
      A.mlp_out = sp ? P.activation({Sl, B, h}) : A.fc2_partial;
    }
    A.x_out = P.activation({Sl, B, h});
    x = A.x_out;
    if (z.splits_backward) {
      A.saved_d_proj = P.activation({Sc, B, h});
      A.saved_d_qkv = P.activation({Sc, B, Hl * 3 * d});
      if (!moe) {
        A.saved_d_fc2 = P.activation({Sc, B, h});
        A.saved_d_fc1 = P.activation({Sc, B, z.f1l});
      }
    }
  }
}

void allocate_output(RankProgram& P, OutputSet& O) {
  const StepShape& z = P.shape;
  const std::int64_t Sl = z.Sl, Sc = z.Sc, B = z.B, h = z.h;
  O.final_ln = P.activation({Sl, B, h});
  O.final_mean = P.activation({Sl * B});
  O.final_rstd = P.activation({Sl * B});
  O.final_full = z.sp() ? P.activation({Sc, B, h}) : O.final_ln;
  O.logits = P.activation({Sc * B, z.Vl});
  O.row_max = P.activation({Sc * B});
  O.partials = P.activation({Sc * B, ops::kCrossEntropyPartials});
  O.lse = P.activation({Sc * B});
  if (z.splits_backward) O.saved_d_logits = P.activation({Sc * B, z.Vl});
}

}  // namespace

void RankProgram::allocate() {
  const StepShape& z = shape;
  RankState& R = state;
  const int pp = at.pp;
  const StageContents contents = layout.contents(pp);
  R.shard = std::make_unique<ModelShard>(z.model, mesh, rank, device, contents, materialize);
  const std::int64_t Sl = z.Sl, Sc = z.Sc, B = z.B, h = z.h, Hl = z.Hl, d = z.d, cp = z.cp;
  const bool sp = z.sp();
  const auto& chunks = set_plan.set_chunks[static_cast<std::size_t>(pp)];
  R.sets.resize(chunks.size());
  for (std::size_t i = 0; i < R.sets.size(); ++i)
    allocate_set(*this, R.sets[i], chunks[i]);
  R.outputs.resize(static_cast<std::size_t>(set_plan.output_sets[static_cast<std::size_t>(pp)]));
  for (OutputSet& O : R.outputs)
    allocate_output(*this, O);
  R.norm_sq = activation({1});
  R.loss.assign(static_cast<std::size_t>(z.M), 0.0);
  R.aux.assign(static_cast<std::size_t>(z.M), 0.0);
  BackwardWorkspace& W = R.ws;
  W.d_x = activation({Sl, B, h});
  W.d_x_mid = activation({Sl, B, h});
  W.d_tmp = activation({Sl, B, h});
  W.d_mlp = activation({Sl, B, h});
  W.d_mlp_full = sp ? activation({Sc, B, h}) : W.d_mlp;
  W.d_act = activation({Sc, B, z.fl});
  W.d_fc1 = activation({Sc, B, z.f1l});
  W.d_norm_full = activation({Sc, B, h});
  W.d_norm = sp ? activation({Sl, B, h}) : W.d_norm_full;
  W.d_attn = activation({Sc, B, Hl * d});
  W.d_qkv = activation({Sc, B, Hl, 3 * d});
  if (cp > 1) {
    for (int i = 0; i < 2; ++i) {
      W.ring[i] = activation({Sc, B, Hl, 2 * d});
      W.dring[i] = activation({Sc, B, Hl, 2 * d});
    }
    if (z.ampipe > 1) {
      W.dkv_send = activation({cp * Sc, B, Hl, 2 * d});
      W.dkv_recv = activation({cp * Sc, B, Hl, 2 * d});
    }
    W.o_part = activation({z.chunk, B, Hl, d});
    W.dq_part = activation({z.chunk, B, Hl, d});
    W.lse_part = activation({B, Hl, z.chunk});
    W.ring_send.assign(static_cast<std::size_t>(cp), 0);
    W.ring_send[static_cast<std::size_t>((at.cp + 1) % cp)] = Sc;
    W.ring_recv.assign(static_cast<std::size_t>(cp), 0);
  }
  if (contents.output_layer) {
    W.d_logits = activation({Sc * B, z.Vl});
    W.d_final_full = activation({Sc, B, h});
  }
}

}  // namespace weave::graphs
