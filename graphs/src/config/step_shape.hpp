// The sizes of one training step, named once: every rank program reads them, none changes them.
//
//   S    the sequence                      Sc  a rank's part under context parallelism
//   chunk  one of a cp rank's two halves   Sl  its part under sequence parallelism too
//   B    micro-batch size                  h   hidden size        d   head dimension
//   Hl   attention heads of a tp rank      f   ffn hidden size    fl  its tp rank's share
//   Gl   key/value heads (query groups) of a tp rank, each shared by qpg query heads
//   f1l  the first MLP linear's local outputs (2 fl for SwiGLU)   Vl  vocabulary rows of a tp rank
//   fe   a routed expert's hidden size (--moe-ffn-hidden-size)
//   T    the tokens a rank routes through a MoE layer (Sc / tp x B; Sc x B routed replicated)
//   M    micro-batches a data-parallel rank runs per step
#pragma once

#include <cstdint>
#include <vector>

#include "config/layer_spec.hpp"
#include "weave/graphs/model_config.hpp"
#include "weave/graphs/parallel_plan.hpp"

namespace weave::graphs {

// MindSpeed's deepspeed_moe gate under tensor parallelism without SP: every tp rank holds the
// whole sequence and gates all of it, the same tokens on each (its router's gradient the same
// there, not summed), its split experts' partial sums all-reduced over tp.
inline bool plan_routes_replicated(const ModelConfig& m, const ParallelPlan& p) {
  return m.num_experts > 0 && m.moe_gate == MoeGate::deepspeed && p.tensor_parallel > 1 &&
         !p.sequence_parallel;
}

struct StepShape {
  StepShape(const ModelConfig& model, const ParallelPlan& plan);

  ModelConfig model;
  ParallelPlan plan;
  int tp, t_sp, cp, ep, M, ampipe;
  int etp;  // expert tensor parallelism: 1, or tp when every expert is split over the tp group
  std::int64_t S, Sc, chunk, B, Sl, h, d, Hl, Gl, qpg, f, fl, f1l, fe, Vl, T;
  // Whether the schedule splits backwards into input and weight halves (zero-bubble): the
  // activation sets then keep the output gradients the weight halves need.
  bool splits_backward = false;
  // Each model layer's modules, resolved once (resolve_layer_spec).
  std::vector<LayerSpec> layers;

  const LayerSpec& spec(int layer) const { return layers.at(static_cast<std::size_t>(layer)); }

  bool sp() const { return t_sp > 1; }
  // plan_routes_replicated: every tp rank routes all of its T = Sc B tokens.
  bool routes_replicated = false;
  // Megatron-Core's router under tp without SP: each tp rank routes its 1/tp slice of the
  // sequence (of every Ampipe chunk), the slices' outputs and input gradients gathered back.
  bool routes_tp_slices() const { return tp > 1 && !sp() && !routes_replicated; }
  // A QKV row of a key/value group: its qpg query heads, its key and its value.
  std::int64_t qkv_group_width() const { return (qpg + 2) * d; }
  // The QKV projection's local outputs: (Hl + 2 Gl) d.
  std::int64_t qkv_width() const { return Gl * qkv_group_width(); }
  // The experts' hidden size times the first linear's outputs per hidden unit (SwiGLU: 2).
  std::int64_t expert_f1() const { return model.activation == Activation::swiglu ? 2 * fe : fe; }
  // Experts split over the tensor-parallel group (etp ranks): each rank's share of an expert's
  // hidden layer, and of fc1's outputs.
  std::int64_t expert_local_f() const { return fe / etp; }
  std::int64_t expert_local_f1() const { return expert_f1() / etp; }
  bool experts_split() const { return etp > 1; }
  std::int64_t local_experts() const { return model.num_experts / ep; }
  bool pipe_experts() const { return plan_pipes_experts(plan); }
  // --ampipe-tp-sp-comm-overlap (section 4 of MindSpeed's Ampipe): split experts run as items
  // of (chunk, local expert), their tensor-parallel collectives pipelined across the chunks.
  bool tp_sp_overlap() const { return plan_overlaps_tp_sp(plan); }
  // Whether a MoE slot's expert work runs as items with their own all-to-alls, and the
  // capacity slices per local expert it is cut into.
  bool expert_items() const { return pipe_experts() || tp_sp_overlap(); }
  // MindSpeed's deepspeed_moe experts are tensor-parallel linears whose backward (Megatron-LM's
  // LinearWithGradAccumulationAndAsyncCommunication) launches fc1's input-gradient reduce-scatter
  // (all-reduce without SP) asynchronously and computes the weight gradients under it. Megatron-
  // Core's experts split by --expert-tensor-parallel-size leave that collective to the token
  // dispatcher, after their whole backward. A zero-bubble schedule holds the weight half for W.
  bool experts_reduce_under_weight_gradient() const {
    return model.num_experts > 0 && experts_split() && !expert_items() && !splits_backward &&
           plan.moe_model_type == "deepspeed_moe";
  }
  int item_slices() const { return pipe_experts() ? plan.pipe_experts_slices() : 1; }
  // --pipe-experts-multi-stream with split experts: every item collective in one chain, each
  // all-to-all issued where the chain reaches it (not all at once after the router).
  bool chained_items() const {
    return plan.pipe_experts_multi_stream && experts_split() && expert_items();
  }
  // Rows of h floats that hold one destination's per-local-expert counts in the dispatch.
  std::int64_t header_rows() const { return (local_experts() + h - 1) / h; }
  // The tokens one MoE slot routes: a rank's T, or one Ampipe chunk of them (routed replicated
  // the whole chunk, so the deepspeed_moe gate's capacity is the chunk's, as MindSpeed's).
  std::int64_t slot_tokens() const { return T / ampipe; }
  // The picks an expert takes from one source's MoE slot (plan_dispatch's ceil(f n k / E), or
  // MindSpeed's gate's capacity per gate call), or 0 when dropless.
  std::int64_t expert_capacity() const;
  // Rows a rank's MoE slot may receive: dropless, every pick of every source's n tokens; with a
  // capacity factor, at most each local expert's capacity from each source.
  std::int64_t slot_capacity() const;

  // Under SP with Ampipe the shards are chunk-major (MindSpeed's layout): a tp rank's shard is
  // sp_chunks() pieces of piece_rows() rows, piece c on rank j being the rows [c n + j q,
  // c n + (j+1) q) of the rank's sequence (q = piece_rows(), n = tp q), so the tp ranks' pieces c
  // together are the contiguous chunk c, every chunk's rows are routed where MindSpeed routes
  // them, and the sequence-parallel gathers and scatters run per chunk. Otherwise one piece:
  // rank j's shard is rows [j Sl, (j+1) Sl).
  int sp_chunks() const { return sp() && ampipe > 1 ? ampipe : 1; }
  // A shard's rows of one Ampipe chunk (the whole shard at degree 1).
  std::int64_t piece_rows() const { return Sl / ampipe; }
  // The row of the rank's sequence (of Sc) where chunk c's piece on tp rank j starts.
  std::int64_t piece_start(int c, int j) const {
    return (static_cast<std::int64_t>(c) * t_sp + j) * piece_rows();
  }
  // The row of the rank's sequence that row s of tp rank j's shard holds.
  std::int64_t shard_row(int tp_rank, std::int64_t s) const {
    if (!sp()) return s;
    return piece_start(static_cast<int>(s / piece_rows()), tp_rank) + s % piece_rows();
  }

  // The global position of a context-parallel rank's local position s in [0, Sc): it holds
  // chunks cp_rank and 2 cp - 1 - cp_rank of the 2 cp chunks, so causal work is even.
  std::int64_t context_position(int cp_rank, std::int64_t s) const;
  // The global position of row s of the [Sl, B, ...] activations of the rank at (tp, cp).
  std::int64_t position(int tp_rank, int cp_rank, std::int64_t s) const {
    return context_position(cp_rank, shard_row(tp_rank, s));
  }
};

}  // namespace weave::graphs
