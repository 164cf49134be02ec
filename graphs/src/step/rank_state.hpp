// What one rank holds while its step runs: per micro-batch in flight the activations each layer
// keeps for its backward, the gradient workspace its layers share, and its results. Data only:
// the rank program (rank_program.hpp) allocates it and its tasks read and write it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "weave/graphs/model_shard.hpp"
#include "weave/ops/moe_dispatch.hpp"
#include "weave/ops/tensor.hpp"

namespace weave::graphs {

using ops::Tensor;

// Everything a layer's forward keeps for its backward, on one device, for one micro-batch in
// flight (see ActivationSet).
struct LayerActivations {
  Tensor x_in;  // [Sl, B, h]: the previous layer's output
  Tensor ln1, ln1_mean, ln1_rstd, ln1_full;
  Tensor qkv, attn, lse, proj_partial, proj_out, x_mid;
  Tensor kv_local;  // context parallelism: this rank's keys and values [Sc, B, Hl, 2d]
  // Ampipe under CP, unless the blocks are sent again in backward: every cp rank's block, by
  // owner [cp Sc, B, Hl, 2d] (kv_local is this rank's slot).
  Tensor kv_store;
  Tensor ln2, ln2_mean, ln2_rstd, ln2_full;
  Tensor fc1, act, fc2_partial;  // dense
  Tensor mlp_out;                // [Sl, B, h]: the MLP's output, before bias and dropout
  Tensor x_out;
  // A split backward (zero-bubble schedules): the output gradients the weight-gradient GEMMs
  // need, kept from the input-gradient half (I) until the weight half (W) runs. Dense MLP: fc2's
  // and fc1's; every layer: the out-projection's and QKV's.
  Tensor saved_d_fc2, saved_d_fc1, saved_d_proj, saved_d_qkv;
  // MoE: one slot per Ampipe chunk (one slot without Ampipe), and the statistics of the whole
  // micro-batch the router's losses use.
  std::vector<struct MoeSlot> moe;
  Tensor stats_total;  // [2 E + 2]
};

// --use-pipe-experts: one item of a MoE slot, the picks bound for local expert `expert` of every
// expert-parallel rank (capacity slice `slice` of them), with its own all-to-alls.
struct ExpertItem {
  int expert = 0, slice = 0;
  std::vector<std::int64_t> rows;  // the slot's grouped rows it carries, by destination rank
  std::vector<std::int64_t> send_rows, recv_rows, framed_send_rows, framed_recv_rows;  // [ep]
  Tensor send, arrived;  // framed: one header row (the count) per destination / source
  Tensor expert_in, hidden_pre, hidden, expert_result;  // by source
  Tensor back;                                          // results home, by destination
  Tensor d_back, d_arrived, d_expert_in, d_home;        // backward
  // Experts split over tp: this rank's rows of the item (expert_in) and every tp rank's
  // gathered, fc2's partial sums of them (fc1's input-gradient partial sums in backward), the
  // gathered output gradients, and the hidden layer's and the first product's gradients.
  std::int64_t tp_send_rows = 0;
  Tensor tp_gathered, tp_partial, tp_d_gathered, d_hidden, d_pre;  // [tp in, ...]
  std::vector<std::int64_t> tp_gathered_rows, tp_d_gathered_rows;  // [tp]
};

// The routing and expert buffers of one MoE slot: the tokens a rank routes at once (all of its
// T tokens, or one Ampipe chunk of them), forward and backward.
struct MoeSlot {
  std::int64_t tokens = 0;
  Tensor moe_in, router_logits, probs, topk_weight, grouped, hidden_pre, hidden, expert_out,
      moe_out, stats;
  std::vector<std::int32_t> topk_index;
  ops::DispatchPlan dispatch;
  // Expert parallelism: rows leave grouped by destination rank, arrive grouped by source rank
  // (each source's rows in local-expert order), and are regrouped by local expert to run. The
  // dispatch frames each destination's rows with header rows holding their per-expert counts,
  // so one all-to-all carries both (no separate count exchange ahead of it); every later
  // exchange moves unframed rows.
  Tensor counts_recv;                              // [ep x local experts]: rows per expert
  std::vector<std::int64_t> send_rows, recv_rows;  // [ep]: rows per destination / source
  std::vector<std::int64_t> framed_send_rows, framed_recv_rows;  // the same plus headers
  Tensor arrived, expert_in, expert_result, leaving;             // [ep tokens k (+ headers), h]
  std::vector<std::int64_t> local_begin;  // [local experts + 1] rows of expert_in
  std::vector<std::int64_t> source_row;   // expert_in row -> unframed arrival row
  std::vector<std::int64_t> arrived_row;  // expert_in row -> row of `arrived`
  // Backward.
  Tensor d_moe, d_grouped, d_expert_out, d_topk, d_router_logits, d_moe_in;
  Tensor d_arrived, d_expert_in, d_expert_result, d_leaving;
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
  std::vector<ExpertItem> items;                 // --use-pipe-experts
  Tensor saved_d_pre;  // a split backward: the experts' first-product gradient, for W
};

// Gradient workspace shared by all layers of a device: the backward runs layer after layer.
struct BackwardWorkspace {
  Tensor d_x, d_x_mid, d_tmp;        // [Sl, B, h]
  Tensor d_mlp, d_mlp_full;          // [Sl, B, h], [S, B, h]
  Tensor d_act, d_fc1, d_norm_full;  // [S, B, f], [S, B, f1], [S, B, h]
  Tensor d_norm;                     // [Sl, B, h]
  Tensor d_attn, d_qkv;              // [S, B, Hl d], [S, B, Hl, 3d]
  // Context parallelism: key/value blocks and their gradients travelling round the ring
  // (double-buffered), and one block's partial attention.
  Tensor ring[2], dring[2];   // [Sc, B, Hl, 2d]
  Tensor dkv_send, dkv_recv;  // Ampipe under CP: block gradients by owner / by source [cp Sc, ...]
  // Ampipe under CP with --ampipe-cp-resend-kv: the other cp ranks' blocks, in the order the
  // forward's ring brings them and the backward's brings them again [(cp - 1) Sc, B, Hl, 2d].
  Tensor kv_forward, kv_backward;
  Tensor o_part, dq_part;                          // [chunk, B, Hl, d]
  Tensor lse_part;                                 // [B, Hl, chunk]
  std::vector<std::int64_t> ring_send, ring_recv;  // rows to each cp rank: all to the next
  Tensor d_logits, d_final_full;                   // [S B, Vl], [S, B, h]
};

// The activations one model chunk keeps for one micro-batch, from its forward until its
// backward has used them. A rank holds as many sets as its schedule has (chunk, micro-batch)
// forwards in flight at once (one without pipelining; p - r on 1F1B's stage r), so the device's
// activation memory is the schedule's. When the rank's chunks have the same layers (count and
// kinds) the sets are shared by all of them, as a caching allocator would reuse the memory;
// otherwise each chunk has its own.
struct ActivationSet {
  std::vector<LayerActivations> layers;  // by position in the chunk
  // The chunk's input [Sl, B, h]: the previous stage's output, or the embedding's. Under SP the
  // first chunk's embedding sums [Sc, B, h] partials first.
  Tensor x_in, emb_partial;
  // Pipelining: the gradient of the chunk's output from the next stage, and of its input for the
  // previous (both [Sl, B, h]).
  Tensor d_recv, d_send;
  std::vector<std::int32_t> tokens;  // [Sc B]: this rank's positions of the micro-batch
};

// The last chunk's final norm, output layer and cross-entropy for one micro-batch in flight.
struct OutputSet {
  Tensor final_ln, final_mean, final_rstd, final_full, logits;
  Tensor row_max, partials, lse;
  std::vector<std::int32_t> targets;  // [Sc B]
  Tensor saved_d_logits;              // a split backward: the output layer's gradient, for W
};

struct RankState {
  std::unique_ptr<ModelShard> shard;
  std::vector<ActivationSet> sets;
  // Full recomputation: what the layers of one recomputed group hold while their forward runs
  // again and their backward uses it, shared by every group and set of the rank (one group is
  // recomputed at a time), by (position in the group, MoE layer). The sets' recomputed layers
  // are views of it but for their input and the group's output.
  std::map<std::pair<int, bool>, LayerActivations> recompute_working_set;
  std::vector<OutputSet> outputs;
  BackwardWorkspace ws;
  Tensor norm_sq;                 // [1]: this rank's share of the squared grad norm
  std::vector<double> loss, aux;  // per micro-batch
  std::int64_t routed_picks = 0, dropped_picks = 0;  // this rank's tokens, the whole step
};

}  // namespace weave::graphs
