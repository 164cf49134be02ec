// The training step's builder, internal to graphs/: the per-device state and the Impl whose
// member functions build the step's task graph, defined by concern in training_step.cpp and
// the step_*.cpp files.
#pragma once

#include "weave/graphs/training_step.hpp"

#include "weave/graphs/pipeline_layout.hpp"

#include <fmt/format.h>

#include <array>
#include <cctype>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <span>
#include <tuple>

#include "weave/ops/activation.hpp"
#include "weave/ops/attention.hpp"
#include "weave/ops/cross_entropy.hpp"
#include "weave/ops/dropout.hpp"
#include "weave/ops/elementwise.hpp"
#include "weave/ops/embedding.hpp"
#include "weave/ops/experts.hpp"
#include "weave/ops/linear.hpp"
#include "weave/ops/moe_dispatch.hpp"
#include "weave/ops/normalization.hpp"
#include "weave/ops/router.hpp"

namespace weave::graphs {

using ops::Tensor;
using rt::TaskId;

// The step's per-device state, shared by the files that build the graph.
namespace step_detail {

// Everything a layer's forward keeps for its backward, on one device, for one micro-batch in
// flight (see ActivationSet).
struct LayerActivations {
  Tensor x_in;  // [Sl, B, h]: the previous layer's output
  Tensor ln1, ln1_mean, ln1_rstd, ln1_full;
  Tensor qkv, attn, lse, proj_partial, proj_out, x_mid;
  Tensor kv_local;  // context parallelism: this rank's keys and values [Sc, B, Hl, 2d]
  Tensor kv_store;  // Ampipe under CP: every cp rank's block, by owner [cp Sc, B, Hl, 2d]
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
  std::vector<ExpertItem> items;  // --use-pipe-experts
  Tensor saved_d_pre;             // a split backward: the experts' first-product gradient, for W
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
  Tensor o_part, dq_part;     // [chunk, B, Hl, d]
  Tensor lse_part;            // [B, Hl, chunk]
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
  std::vector<OutputSet> outputs;
  BackwardWorkspace ws;
  Tensor norm_sq;                 // [1]: this rank's share of the squared grad norm
  std::vector<double> loss, aux;  // per micro-batch
  std::int64_t routed_picks = 0, dropped_picks = 0;  // this rank's tokens, the whole step
};

inline std::span<float> all_of(const Tensor& t) {
  return {t.data(), static_cast<std::size_t>(t.numel())};
}

}  // namespace step_detail

using namespace step_detail;  // NOLINT: an internal header of the training step

struct TrainingStep::Impl {
  ModelConfig m;
  ParallelPlan plan;
  OptimizerConfig opt;
  devices::DeviceSet& devices;
  devices::Communicator& comm;
  Mesh mesh;
  rt::GraphBuilder b;
  rt::Graph graph;
  rt::StreamId compute_stream = rt::kComputeStream;
  std::vector<RankState> ranks;
  // The pipeline: its schedule, the layers of each model chunk, and per pipeline rank which
  // activation set each (chunk, micro-batch) uses.
  PipelineLayout layout;
  std::vector<std::vector<int>> set_chunks;            // [pp][set]: the chunk it is laid out for
  std::map<std::tuple<int, int, int>, int> set_index;  // (pp, chunk, micro-batch) -> set
  std::vector<int> output_sets;                        // [pp]: output sets (last chunk's rank)
  std::map<int, int> output_index;                     // micro-batch -> output set
  std::vector<int> chunk_of_layer;
  // While building: the pipeline stage whose ranks get tasks (-1: every rank) and the activation
  // and output sets the tasks use. Builders copy set_ into a local `set` their tasks capture.
  int stage_ = -1;
  int set_ = 0;
  int output_ = 0;
  int chunk_ = -1;  // the model chunk being built: its tasks' virtual_stage tag
  std::vector<std::vector<MicroBatch>> batches;  // [dp][micro-batch]
  std::vector<TaskId> last_comm;                 // per rank: the comm stream's latest task
  std::vector<TaskId> last_grad;                 // per rank: the gradient stream's latest task
  std::int64_t iteration = 1;
  double learning_rate = 0;
  bool update = true;
  // Weight-gradient GEMMs a layer's backward left to be emitted later (see flush_weight_grads).
  std::vector<std::function<void()>> deferred_weight_grads;
  // Zero-bubble schedules split the backward: while split_ is set (building an I action) the
  // weight-gradient GEMMs save their output gradients and leave their tasks in weight_work, which
  // the matching W action emits. MoE routers (and --use-pipe-experts items) keep theirs in I.
  bool split_ = false;
  std::vector<std::function<std::vector<TaskId>()>> weight_work;
  // Whether the schedule splits backwards (has I actions): the sets then keep the saved
  // gradients. Set by assign_sets.
  bool splits_backward_ = false;
  // Emits a weight-gradient task now, or leaves it for the W action under a split backward.
  void weight_grad(const std::string& name, rt::TaskTags tags, std::function<void(int)> fn);

  // Sizes.
  int tp, t_sp, cp, M;

  // S: the sequence; Sc: this rank's part under context parallelism (two chunks of c
  // positions); Sl: its part under sequence parallelism too; T: the tokens a rank routes.
  std::int64_t S, Sc, chunk, B, Sl, h, d, Hl, f, fl, f1l, Vl, T;

  Impl(const ModelConfig& model, const ParallelPlan& p, const OptimizerConfig& o,
       devices::DeviceSet& set, devices::Communicator& c);

  devices::Device& dev(int r) { return devices[static_cast<rt::DeviceId>(r)]; }

  int ep() const { return plan.expert_parallel; }

  Tensor act(int r, const ops::Shape& s) {
    return Tensor::empty(s, dev(r), rt::MemoryCategory::activations);
  }

  int ampipe() const { return plan.ampipe_degree; }

  // Rows of h floats that hold one destination's per-local-expert counts in the dispatch.
  std::int64_t header_rows() const { return (m.num_experts / ep() + h - 1) / h; }

  // Rows a rank's MoE slot may receive: dropless, every pick of every source's n tokens; with a
  // capacity factor, at most each local expert's capacity from each source (plan_dispatch's
  // ceil(f n k / E) per expert).
  std::int64_t slot_capacity() const;
  // The picks an expert takes from one source's MoE slot (plan_dispatch's ceil(f n k / E)), or 0
  // when dropless.
  std::int64_t expert_capacity() const;

  bool pipe_experts() const { return plan.pipe_experts && ep() > 1; }

  void allocate_items(int r, MoeSlot& S);

  void allocate_slot(int r, LayerActivations& A, int c);

  void allocate(int r);
  // An activation set of rank r laid out for model chunk k's layers.
  void allocate_set(int r, ActivationSet& X, int k);
  void allocate_output(int r, OutputSet& O);
  // Which activation set each forward takes, from the schedule: a set is free again after the
  // backward that used it (the weight-gradient half, when the backward is split).
  void assign_sets();

  ActivationSet& aset(int r, int set) { return ranks[r].sets[static_cast<std::size_t>(set)]; }
  LayerActivations& acts(int r, int set, int l) {
    const int k = chunk_of_layer[static_cast<std::size_t>(l)];
    return aset(r, set).layers[static_cast<std::size_t>(l - layout.first_layer(k))];
  }
  // Rank r -> its activations of layer l in the set being built now (captured, not read when
  // the task runs).
  auto layer_at(int l) {
    return [this, l, set = set_](int r) -> LayerActivations& { return acts(r, set, l); };
  }
  OutputSet& oset(int r, int out) { return ranks[r].outputs[static_cast<std::size_t>(out)]; }
  bool in_stage(int r) const { return stage_ < 0 || mesh.coordinates(r).pp == stage_; }
  // A rank of the stage being built (rank 0 when every rank is): its shard stands for the
  // stage's in what the builder asks of the stage's parameters.
  int stage_rank() const { return stage_ < 0 ? 0 : mesh.rank_of(0, 0, 0, stage_); }

  // ---------------------------------------------------------------------------- graph helpers
  // Adds one compute task per rank; fn(rank) is the work.
  std::vector<TaskId> each(const std::string& name, rt::TaskTags tags, std::function<void(int)> fn);

  // The multiply-adds (x2) of a task, by its kind, for the virtual clock: the matrix products
  // and attention; the element-wise work is small beside them.
  double flops_of(const std::string& name) const;

  void link(const std::vector<TaskId>& before, const std::vector<TaskId>& after) {
    for (std::size_t r = 0; r < before.size(); ++r)
      if (before[r] != rt::kNoTask && after[r] != rt::kNoTask) b.precede(before[r], after[r]);
  }

  // Runs `collective` once per group of `kind` (skipped for groups of one), after `producers`,
  // and returns the member task of each rank (kNoTask where skipped).
  using GroupCall = std::function<std::vector<TaskId>(const devices::ProcessGroup&)>;

  std::vector<TaskId> per_group(GroupKind kind, const std::vector<TaskId>& producers,
                                const GroupCall& call, bool gradient_stream = false);

  // Sum (or max) `buffer(rank)` in place over each group of `kind`; on the "grad_comm" stream
  // when `gradient_stream`.
  std::vector<TaskId> all_reduce_over(GroupKind kind, const std::vector<TaskId>& producers,
                                      std::function<Tensor(int)> buffer, devices::ReduceOp op,
                                      const std::string& name, rt::TaskTags tags,
                                      bool gradient_stream = false);

  std::vector<TaskId> tp_all_reduce(const std::vector<TaskId>& producers,
                                    std::function<Tensor(int)> buffer, devices::ReduceOp op,
                                    const std::string& name, rt::TaskTags tags);

  // Sequence parallelism's g: all-gather [Sl, B, ...] shards into [S, B, ...].
  std::vector<TaskId> tp_all_gather(const std::vector<TaskId>& producers,
                                    std::function<Tensor(int)> shard,
                                    std::function<Tensor(int)> full, const std::string& name,
                                    rt::TaskTags tags);

  // Sequence parallelism's g-bar: reduce-scatter [S, B, ...] partial sums into [Sl, B, ...].
  std::vector<TaskId> tp_reduce_scatter(const std::vector<TaskId>& producers,
                                        std::function<Tensor(int)> full,
                                        std::function<Tensor(int)> shard, const std::string& name,
                                        rt::TaskTags tags);

  // g-bar in forward: reduce-scatter under SP, all-reduce otherwise (the shard is the buffer).
  std::vector<TaskId> reduce_partial(const std::vector<TaskId>& producers,
                                     std::function<Tensor(int)> full,
                                     std::function<Tensor(int)> shard, const std::string& name,
                                     rt::TaskTags tags);

  // ------------------------------------------------------------------------------ the model
  // The global position of a context-parallel rank's local position s in [0, Sc): it holds
  // chunks cp_rank and 2 cp - 1 - cp_rank of the 2 cp chunks, so causal work is even.
  std::int64_t context_position(int cp_rank, std::int64_t s) const;

  // The global position of row s of rank r's [Sl, B, ...] activations.
  std::int64_t position(int r, std::int64_t s) const;

  // This rank's positions of the micro-batch's tokens (into *tokens, when given) or targets
  // (into *targets otherwise).
  void load_tokens(int r, int mb, std::vector<std::int32_t>* tokens,
                   std::vector<std::int32_t>* targets);

  // Dropout on rank r's [Sl, B, h] activations (out may be in): masks keyed by global token, so
  // any split of the sequence draws the one-device masks. Runs of contiguous positions go to the
  // kernel one at a time. Without dropout, a copy.
  void apply_dropout(bool backward, int r, int mb, int layer, int site, const Tensor& in,
                     const Tensor& out, std::int64_t first_row = 0);

  // x_out = x_in + dropout(y + bias): the residual branch's end, on [Sl, B, h].
  void bias_dropout_add(int r, int mb, int layer, int site, const Tensor& y, const Tensor& bias,
                        const Tensor& x_in, const Tensor& x_out, std::int64_t first_row = 0);

  // The backward of bias_dropout_add: d_y = dropout'(d_out); d_bias += rows of d_y.
  void bias_dropout_add_backward(int r, int mb, int layer, int site, const Tensor& d_out,
                                 const Tensor& d_y, const Tensor& d_bias,
                                 std::int64_t first_row = 0);

  // ------------------------------------------------------------------------------ pipeline
  // The schedule's actions, each on its stage's ranks, in an order that respects every
  // dependency between stages; activations and gradients move between stages by send/recv on
  // the "pipeline" stream (a copy when consecutive chunks share a rank). Then the tied word
  // embedding's gradient is summed over the first and last stage.
  void build_pipeline();

  // Moves from(r) on the ranks of pipeline rank `from_pp` into into(r') on the ranks of `to_pp`
  // with the same tp, cp and dp coordinates, after `produced` (per rank) and `free` (per
  // receiving rank: what must be done before `into` is overwritten). Returns the receiving
  // ranks' tasks.
  std::vector<TaskId> stage_transfer(int from_pp, int to_pp, const std::vector<TaskId>& produced,
                                     const std::vector<std::vector<TaskId>>& free,
                                     const std::function<Tensor(int)>& from,
                                     const std::function<Tensor(int)>& into,
                                     const std::string& name, rt::TaskTags tags);

  // Per rank, the task after which the word embedding's gradient of the step is complete on it
  // (the first stage's embedding backward, the last stage's output layer).
  std::vector<TaskId> word_grad_done;
  void word_grad_ready(const std::vector<TaskId>& tasks) {
    for (std::size_t r = 0; r < tasks.size(); ++r)
      if (tasks[r] != rt::kNoTask) word_grad_done[r] = tasks[r];
  }

  // The W action of chunk k: the weight-gradient tasks its I left, after which the set is free;
  // after the chunk's last W its gradient buckets are reduced.
  void build_weight_gradients(int k, const std::vector<std::function<std::vector<TaskId>()>>& work,
                              bool last, std::vector<std::vector<std::vector<TaskId>>>& free_after,
                              int set);

  // Sums the word embedding's gradient over the first and last stage when they are different
  // ranks (Megatron's embedding group), then reduces the embedding buckets over the replicas.
  void reduce_embedding();

  // The forward of model chunk k for micro-batch mb on the current stage, into set_: the
  // embedding first (chunk 0), the layers, the loss (the last chunk). `ready`: its input is
  // there. Returns the tasks after which its output (or loss) is.
  std::vector<TaskId> build_forward(int k, int mb, const std::vector<TaskId>& ready);

  std::vector<TaskId> build_layer_forward(int l, int mb, std::vector<TaskId> prev);

  // The input norm, sequence parallelism's gather and the QKV projection, on the whole local
  // sequence (also under Ampipe, whose chunks split only the queries).
  std::vector<TaskId> build_attention_input(int l, const std::vector<TaskId>& prev,
                                            rt::TaskTags tags);

  // Emits the deferred weight gradients: after the next layer's first all-to-all is launched,
  // so they fill the compute stream while it is in flight.
  void flush_weight_grads();

  // The backward of build_attention_input: QKV input gradient (with the ring's key/value
  // gradients under CP), its reduction over tp, the weight gradient overlapping that reduction,
  // and the input norm; then the attention half's gradient buckets.
  std::vector<TaskId> build_attention_input_backward(int l, const std::vector<TaskId>& ready_in,
                                                     bool last, rt::TaskTags tags);

  // ------------------------------------------------------------------------------- Ampipe
  //
  // A MoE layer with --ampipe-degree N: input norm and QKV run on the whole sequence; from the
  // attention to the MoE combine the sequence is cut into N chunks of queries (keys and values
  // whole, the causal diagonal offset by the chunk's start), and the chunks' work is ordered so
  // that a chunk's all-to-all runs on the comm stream while another chunk computes:
  //   forward:  attention side of every chunk (attention, out-projection, residual, norm,
  //             router; dispatch launched), then every chunk's experts (combine launched), then
  //             every chunk's combine and residual;
  //   backward: the same passes over the chunks in reverse, with the mirrored all-to-alls.
  // Under SP a chunk is one piece of q = Sl / N rows in every tp rank's shard (the layout
  // MindSpeed gets by permuting the sequence): local rows [c q, (c+1) q) on rank j are the
  // sequence's rows [j Sl + c q, j Sl + (c+1) q). Without SP there is one piece, the chunk.
  std::int64_t piece_rows() const { return Sl / ampipe(); }

  std::int64_t piece_start(int c, int j) const { return j * Sl + c * piece_rows(); }

  std::vector<TaskId> build_ampipe_layer_forward(int l, int mb, std::vector<TaskId> prev);

  std::vector<TaskId> build_ampipe_layer_backward(int l, int mb, std::vector<TaskId> prev,
                                                  bool last_micro_batch);

  // Ampipe under context parallelism (degree 2): the chunks are the two load-balanced halves a
  // rank holds. Chunk 0's attention runs the ring and keeps every key/value block it brings in
  // kv_store (by owner), so chunk 1 attends to them all without communication, while chunk 0's
  // dispatch runs. In backward both chunks add their key/value gradients to per-owner blocks,
  // which one all-to-all sends home.
  Tensor kv_block(int r, int set, int l, int owner);

  // Chunk c's attention; `finish(r)` (its projection, residual and norm) ends the last task.
  std::vector<TaskId> ampipe_ring_attention(int l, int c, const std::vector<TaskId>& qkv,
                                            rt::TaskTags tags, std::function<void(int)> finish);

  // Chunk c's attention backward against every stored block (after its projection's backward
  // into d_attn): dq into d_qkv, each block's dk and dv into dkv_send at its owner.
  void ampipe_ring_attention_backward(int r, int set, int l, int c);

  // Every rank's gradient of block o goes to rank o in one all-to-all over the cp group; each
  // rank sums what came into dring[cp % 2], where the QKV backward takes its block's gradient.
  std::vector<TaskId> send_block_gradients_home(int l, const std::vector<TaskId>& ready,
                                                rt::TaskTags tags);

  void activation_forward(const Tensor& pre, const Tensor& out);

  void activation_backward(const Tensor& pre, const Tensor& d_out, const Tensor& d_pre);

  static void swiglu_local(const Tensor& pre, const Tensor& out) { ops::swiglu_forward(pre, out); }

  ops::ExpertActivation expert_activation() const;

  ops::RouterOptions router_options() const;

  // This rank's tokens for the MoE layer: [T, h] (under SP its shard; otherwise its 1/tp of the
  // replicated sequence).
  Tensor moe_tokens(int r, const Tensor& sbh) const;

  static ops::RouterStatistics unpack_stats(const Tensor& stats, std::int64_t E);

  // Heads' part `part` (0 q, 1 k, 2 v; or 0 k, 1 v of a key/value block) of a [s, B, Hl, n d]
  // tensor, seen as [B, s, Hl, d] for the attention kernel.
  Tensor head_view(const Tensor& t, std::int64_t part) const {
    return t.slice(3, part * d, d).transpose(0, 1);
  }

  // One turn of the context-parallel ring: every rank passes `from(r)` to the next rank's
  // `into(next)`, as a single collective over each cp group (a shift is an all-to-all in which
  // each rank sends to one neighbour).
  std::vector<TaskId> ring_shift(const std::vector<TaskId>& producers,
                                 std::function<Tensor(int)> from, std::function<Tensor(int)> into,
                                 const std::string& name, rt::TaskTags tags);

  // Folds one key block's partial attention (o_part, lse_part) into the running result of a
  // chunk of queries: L = log(e^L1 + e^L2), O = e^(L1 - L) O1 + e^(L2 - L) O2.
  void merge_partial(const Tensor& o, const Tensor& lse, const Tensor& o_part,
                     const Tensor& lse_part) const;

  // The block held at ring step t: where it lives and whose positions it has.
  Tensor ring_block(int r, int set, int layer, int t);

  int ring_owner(int r, int t) const;

  // Attends half `half` of this rank's queries to `block` (`owner`'s keys and values), folding
  // it into the half's output and log-sum-exp.
  void attend_half(int r, int set, int l, std::int64_t half, const Tensor& block, int owner);
  // Its backward: dq added to d_qkv, the block's dk and dv added to `grads`.
  void attend_half_backward(int r, int set, int l, std::int64_t half, const Tensor& block,
                            const Tensor& grads, int owner);

  // Ring attention forward: cp steps; at step t each rank attends its two query chunks to the
  // key/value block of rank (me - t), while the comm stream already passes that block on.
  std::vector<TaskId> build_ring_attention_forward(int l, const std::vector<TaskId>& qkv,
                                                   rt::TaskTags tags);

  // Ring attention backward: the key/value blocks go round again; each rank adds its queries'
  // contribution to the travelling gradient of the block in hand and passes it on, so after cp
  // steps and one more turn every block's gradient is home (in dring[cp % 2]).
  std::vector<TaskId> build_ring_attention_backward(int l, const std::vector<TaskId>& start,
                                                    rt::TaskTags tags);

  // Expert-parallel all-to-all of rows over each expert-parallel group.
  std::vector<TaskId> ep_exchange(const std::vector<TaskId>& producers,
                                  std::function<Tensor(int)> send,
                                  std::function<std::vector<std::int64_t>*(int)> send_rows,
                                  std::function<Tensor(int)> recv,
                                  std::function<std::vector<std::int64_t>*(int)> recv_rows,
                                  std::int64_t expected_rows, const std::string& name,
                                  rt::TaskTags tags);

  // Regroups rows that arrived grouped by source (each source's rows by local expert) into rows
  // grouped by local expert, recording where each came from.
  // Reads the per-expert counts from each source's header rows first.
  void regroup_by_expert(MoeSlot& A);

  MoeSlot& slot(int r, int set, int l, int c) { return acts(r, set, l).moe[c]; }

  // Task names of MoE slot c of layer l: "L<l>." or, for an Ampipe chunk, "L<l>.c<c>.".
  std::string slot_prefix(int l, int c) const {
    return fmt::format("L{}.", l) + (ampipe() > 1 ? fmt::format("c{}.", c) : "");
  }

  // The expert-parallel all-to-all of a slot's rows: outbound (to the experts' ranks: the
  // slot's send_rows leave `from`, recv_rows arrive in `into`) or back (the counts reversed).
  std::vector<TaskId> slot_exchange(int l, int c, const std::vector<TaskId>& ready,
                                    Tensor MoeSlot::*from, Tensor MoeSlot::*into, bool outbound,
                                    const std::string& name, rt::TaskTags tags,
                                    bool framed = false);

  // This rank's tokens of MoE slot c: [n, h] rows of the layer's [S, B, h] activations (its
  // SP shard, its 1/tp slice of a replicated sequence, and within that the Ampipe chunk).
  Tensor slot_tokens(int r, int c, const Tensor& sbh) const;

  // MoE forward in three phases per slot, so Ampipe can interleave slots:
  //   route:   router, dispatch plan, permutation; per-expert counts and the dispatch all-to-all
  //   experts: the local experts; the combine all-to-all
  //   combine: the weighted combine into the slot's output rows
  std::vector<TaskId> moe_route(int l, int c, const std::vector<TaskId>& prev, rt::TaskTags tags);

  // --use-pipe-experts: the per-item exchanges of each (layer, slot) between the phases that
  // build them.
  std::map<std::pair<int, int>, std::vector<std::vector<TaskId>>> item_tasks;

  // Lays out each item's rows for its dispatch: for each destination rank, a header row with
  // the count, then the item's slice of the rows for that rank's local expert.
  void frame_items(MoeSlot& A);

  // Item i's all-to-all over each expert-parallel group: outbound (to the experts' ranks) or
  // back, framed or not; on its own stream per direction with --pipe-experts-multi-stream.
  std::vector<TaskId> item_exchange(int l, int c, int i, const std::vector<TaskId>& ready,
                                    Tensor ExpertItem::*from, Tensor ExpertItem::*into,
                                    bool outbound, bool framed, const std::string& name,
                                    rt::TaskTags tags);

  // Lays out a slot's rows for the dispatch all-to-all: for each destination rank, header rows
  // with the row counts of its local experts, then the rows themselves in expert order.
  void frame_dispatch(MoeSlot& A);

  std::vector<TaskId> moe_experts(int l, int c, const std::vector<TaskId>& ready,
                                  rt::TaskTags tags);

  std::vector<TaskId> moe_combine(int l, int c, const std::vector<TaskId>& ready,
                                  rt::TaskTags tags);

  // --use-pipe-experts: item by item, the rows of one local expert (slice) run as soon as its
  // dispatch is in, and its combine all-to-all is launched while the next item computes.
  std::vector<TaskId> moe_experts_items(int l, int c, const std::vector<TaskId>& ready,
                                        rt::TaskTags tags);

  // The router's losses from the whole micro-batch's statistics: the slots' summed (Ampipe), and
  // over the tensor- and context-parallel ranks that hold parts of the same sequences.
  std::vector<TaskId> moe_statistics(int l, int mb, const std::vector<TaskId>& ready,
                                     rt::TaskTags tags);

  std::vector<TaskId> build_moe_forward(int l, int mb, const std::vector<TaskId>& prev,
                                        rt::TaskTags tags);

  std::vector<TaskId> build_loss(int mb, const std::vector<TaskId>& prev);

  ops::CrossEntropyOptions ce_options() const;

  // ----------------------------------------------------------------------------- backward
  // The backward of model chunk k for micro-batch mb, from the loss (the last chunk) or from the
  // gradient of its output in the set's d_recv (after `ready`); leaves the gradient of its input
  // in d_send, or ends with the embedding (chunk 0). `last`: the chunk's last backward of the
  // step, after which its gradient buckets are reduced.
  std::vector<TaskId> build_backward(int k, int mb, const std::vector<TaskId>& ready, bool last);

  std::vector<TaskId> build_layer_backward(int l, int mb, std::vector<TaskId> prev, bool last);

  // MoE backward in three phases per slot, mirroring the forward (Ampipe runs them for the
  // slots in reverse):
  //   combine:  the combine's backward; the gradient rows go back to the experts' ranks
  //   experts:  the experts' backward; the input gradient rows come home
  //   router:   un-permutation, the router's backward; the slot's input gradient rows
  std::vector<TaskId> moe_combine_backward(int l, int c, const std::vector<TaskId>& prev,
                                           rt::TaskTags tags);

  std::vector<TaskId> moe_experts_backward(int l, int c, const std::vector<TaskId>& ready,
                                           rt::TaskTags tags);

  std::vector<TaskId> moe_experts_backward_items(int l, int c, const std::vector<TaskId>& ready,
                                                 rt::TaskTags tags);

  // Leaves the slot's input gradient in its d_moe_in.
  std::vector<TaskId> moe_router_backward(int l, int c, const std::vector<TaskId>& ready,
                                          rt::TaskTags tags);

  std::vector<TaskId> build_moe_backward(int l, int mb, const std::vector<TaskId>& prev,
                                         rt::TaskTags tags);

  // ------------------------------------------------------------- gradients and the optimizer
  // After the last micro-batch's backward has filled the buckets of `point` (a layer half, the
  // final norm, the embeddings): one all-reduce per bucket — SP partials over tp first, then
  // over the data-parallel replicas (experts: over their expert-data-parallel replicas). Runs on
  // its own "grad_comm" stream, so the tensor-parallel collectives of the layers below never
  // queue behind it.
  void reduce_buckets(const std::string& point, const std::vector<TaskId>& after);

  void build_optimizer();

  void build();

  StepResult result() const;
};

}  // namespace weave::graphs
