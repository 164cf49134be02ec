#include "weave/graphs/training_step.hpp"

#include <fmt/format.h>

#include <array>
#include <cctype>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <span>

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

namespace {

// Everything a layer's forward keeps for its backward, on one device. Reused by every
// micro-batch: a micro-batch's backward finishes on a device before the next forward starts.
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

struct RankState {
  std::unique_ptr<ModelShard> shard;
  std::vector<LayerActivations> layers;
  BackwardWorkspace ws;
  Tensor emb_partial, emb_out;  // [S, B, h], [Sl, B, h]
  Tensor final_ln, final_mean, final_rstd, final_full, logits;
  Tensor row_max, partials, lse;  // cross-entropy
  Tensor norm_sq;                 // [1]: this rank's share of the squared grad norm
  std::vector<double> loss, aux;  // per micro-batch
  std::int64_t routed_picks = 0, dropped_picks = 0;  // this rank's tokens, the whole step
  std::vector<std::int32_t> tokens, targets;  // [Sc B]: this rank's positions of the micro-batch
};

std::span<float> all_of(const Tensor& t) {
  return {t.data(), static_cast<std::size_t>(t.numel())};
}

}  // namespace

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
  std::vector<std::vector<MicroBatch>> batches;  // [dp][micro-batch]
  std::vector<TaskId> last_comm;                 // per rank: the comm stream's latest task
  std::vector<TaskId> last_grad;                 // per rank: the gradient stream's latest task
  std::int64_t iteration = 1;
  double learning_rate = 0;
  bool update = true;

  // Sizes.
  int tp, t_sp, cp, M;
  // S: the sequence; Sc: this rank's part under context parallelism (two chunks of c
  // positions); Sl: its part under sequence parallelism too; T: the tokens a rank routes.
  std::int64_t S, Sc, chunk, B, Sl, h, d, Hl, f, fl, f1l, Vl, T;

  Impl(const ModelConfig& model, const ParallelPlan& p, const OptimizerConfig& o,
       devices::DeviceSet& set, devices::Communicator& c)
      : m(model), plan(p), opt(o), devices(set), comm(c), mesh(p) {
    if (static_cast<int>(set.size()) != plan.devices())
      throw ConfigError(
          fmt::format("the plan needs {} devices (tp {} x cp {} x dp {} x pp {}), "
                      "the device set has {}",
                      plan.devices(), plan.tensor_parallel, plan.context_parallel,
                      plan.data_parallel, plan.pipeline_parallel, set.size()));
    if (plan.pipeline_parallel > 1)
      throw ConfigError(
          "this build of the training step runs tensor, sequence, context, expert and data "
          "parallelism; pipeline parallelism needs --pipeline-model-parallel-size 1");
    tp = plan.tensor_parallel;
    t_sp = plan.sequence_parallel ? tp : 1;
    M = plan.micro_batches();
    cp = plan.context_parallel;
    S = m.seq_length;
    Sc = S / cp;
    chunk = cp > 1 ? Sc / 2 : Sc;
    B = plan.micro_batch_size;
    Sl = Sc / t_sp;
    h = m.hidden_size;
    d = m.head_dim();
    Hl = m.num_attention_heads / tp;
    f = m.ffn_hidden_size;
    fl = f / tp;
    f1l = m.activation == Activation::swiglu ? 2 * fl : fl;
    Vl = m.padded_vocab_size(tp) / tp;
    T = Sc / tp * B;
    if (m.num_experts > 0 && tp > 1 && Sc % tp != 0)
      throw ConfigError(fmt::format(
          "--seq-length ({}) must be divisible by --tensor-model-parallel-size x "
          "--context-parallel-size ({}) in a MoE model: each tensor-parallel rank routes its "
          "share of the positions",
          S, tp * cp));
    batches.assign(static_cast<std::size_t>(plan.data_parallel), std::vector<MicroBatch>(M));
    for (auto& per_dp : batches)
      for (auto& mb : per_dp) {
        mb.tokens.assign(static_cast<std::size_t>(S * B), 0);
        mb.targets.assign(static_cast<std::size_t>(S * B), 0);
      }
    ranks.resize(static_cast<std::size_t>(mesh.size()));
    last_comm.assign(ranks.size(), rt::kNoTask);
    last_grad.assign(ranks.size(), rt::kNoTask);
    for (int r = 0; r < mesh.size(); ++r)
      allocate(r);
    build();
  }

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
  std::int64_t slot_capacity() const {
    const std::int64_t n = T / ampipe(), k = m.moe_router_topk, E = m.num_experts;
    std::int64_t rows = ep() * n * k;
    if (m.moe_expert_capacity_factor > 0) {
      const auto per_expert = static_cast<std::int64_t>(std::ceil(
          m.moe_expert_capacity_factor * static_cast<double>(n * k) / static_cast<double>(E)));
      rows = std::min(rows, E * per_expert);
    }
    return rows;
  }

  bool pipe_experts() const { return plan.pipe_experts && ep() > 1; }

  void allocate_items(int r, MoeSlot& S) {
    const std::int64_t n = T / ampipe(), k = m.moe_router_topk, E = m.num_experts;
    const std::int64_t f1 = m.activation == Activation::swiglu ? 2 * f : f;
    // A source sends an expert at most one pick per token (and at most its capacity).
    std::int64_t per_source = n;
    if (m.moe_expert_capacity_factor > 0)
      per_source = std::min(per_source, static_cast<std::int64_t>(std::ceil(
                                            m.moe_expert_capacity_factor *
                                            static_cast<double>(n * k) / static_cast<double>(E))));
    const std::int64_t in = ep() * per_source;
    const int slices = plan.pipe_experts_slices();
    for (int e = 0; e < E / ep(); ++e)
      for (int j = 0; j < slices; ++j) {
        ExpertItem& I = S.items.emplace_back();
        I.expert = e;
        I.slice = j;
        for (auto* v : {&I.send_rows, &I.recv_rows, &I.framed_send_rows, &I.framed_recv_rows})
          v->assign(static_cast<std::size_t>(ep()), 0);
        I.send = act(r, {n * k + ep(), h});
        I.arrived = act(r, {in + ep(), h});
        I.expert_in = act(r, {in, h});
        I.hidden_pre = act(r, {in, f1});
        I.hidden = act(r, {in, f});
        I.expert_result = act(r, {in, h});
        I.back = act(r, {n * k, h});
        I.d_back = act(r, {n * k, h});
        I.d_arrived = act(r, {in, h});
        I.d_expert_in = act(r, {in, h});
        I.d_home = act(r, {n * k, h});
      }
  }

  void allocate_slot(int r, LayerActivations& A, int c) {
    MoeSlot& S = A.moe[c];
    const std::int64_t E = m.num_experts, k = m.moe_router_topk;
    const std::int64_t f1 = m.activation == Activation::swiglu ? 2 * f : f;
    const std::int64_t n = T / ampipe();
    S.tokens = n;
    S.moe_in = act(r, {n, h});
    S.router_logits = act(r, {n, E});
    S.probs = act(r, {n, E});
    S.topk_weight = act(r, {n, k});
    S.topk_index.assign(static_cast<std::size_t>(n * k), 0);
    // Under EP the dispatch sends `grouped` framed by header rows.
    S.grouped = act(r, {n * k + (ep() > 1 ? ep() * header_rows() : 0), h});
    S.expert_out = act(r, {n * k, h});
    S.stats = ampipe() == 1 ? A.stats_total : act(r, {2 * E + 2});
    // The slot's output: its rows of the layer's MLP output, or (tensor parallelism without
    // SP) this rank's tokens before the all-gather.
    S.moe_out =
        (t_sp > 1 || tp == 1) ? A.mlp_out.reshape({T, h}).slice(0, c * n, n) : act(r, {n, h});
    const std::int64_t capacity = slot_capacity();
    S.hidden_pre = act(r, {capacity, f1});
    S.hidden = act(r, {capacity, f});
    if (ep() > 1) {
      const std::int64_t local = E / ep();
      S.counts_recv = act(r, {ep() * local});
      S.send_rows.assign(static_cast<std::size_t>(ep()), 0);
      S.recv_rows.assign(static_cast<std::size_t>(ep()), 0);
      S.framed_send_rows.assign(static_cast<std::size_t>(ep()), 0);
      S.framed_recv_rows.assign(static_cast<std::size_t>(ep()), 0);
      S.arrived = act(r, {capacity + ep() * header_rows(), h});
      S.expert_in = act(r, {capacity, h});
      S.expert_result = act(r, {capacity, h});
      S.leaving = act(r, {capacity, h});
      S.d_arrived = act(r, {capacity, h});
      S.d_expert_in = act(r, {capacity, h});
      S.d_expert_result = act(r, {capacity, h});
      S.d_leaving = act(r, {capacity, h});
    }
    if (pipe_experts()) allocate_items(r, S);
    S.d_moe = act(r, {n, h});
    S.d_grouped = act(r, {n * k, h});
    S.d_expert_out = act(r, {n * k, h});
    S.d_topk = act(r, {n, k});
    S.d_router_logits = act(r, {n, E});
    S.d_moe_in = act(r, {n, h});
  }

  void allocate(int r) {
    RankState& R = ranks[r];
    R.shard = std::make_unique<ModelShard>(m, mesh, r, dev(r));
    const bool sp = t_sp > 1;
    R.emb_partial = act(r, {Sc, B, h});
    R.emb_out = sp ? act(r, {Sl, B, h}) : R.emb_partial;
    R.layers.resize(static_cast<std::size_t>(m.num_layers));
    Tensor x = R.emb_out;
    for (int l = 0; l < m.num_layers; ++l) {
      LayerActivations& A = R.layers[l];
      A.x_in = x;
      A.ln1 = act(r, {Sl, B, h});
      A.ln1_mean = act(r, {Sl * B});
      A.ln1_rstd = act(r, {Sl * B});
      A.ln1_full = sp ? act(r, {Sc, B, h}) : A.ln1;
      A.qkv = act(r, {Sc, B, Hl, 3 * d});
      A.attn = act(r, {Sc, B, Hl, d});
      // Ampipe: one [B, Hl, q] block per (chunk, piece).
      A.lse = ampipe() > 1 && R.shard->layer(l).moe ? act(r, {ampipe() * t_sp, B, Hl, piece_rows()})
                                                    : act(r, {cp > 1 ? 2 : 1, B, Hl, chunk});
      A.proj_partial = act(r, {Sc, B, h});
      if (cp > 1 && ampipe() > 1 && R.shard->layer(l).moe) {
        A.kv_store = act(r, {cp * Sc, B, Hl, 2 * d});
        A.kv_local = A.kv_store.slice(0, mesh.coordinates(r).cp * Sc, Sc);
      } else if (cp > 1) {
        A.kv_local = act(r, {Sc, B, Hl, 2 * d});
      }
      A.proj_out = sp ? act(r, {Sl, B, h}) : A.proj_partial;
      A.x_mid = act(r, {Sl, B, h});
      A.ln2 = act(r, {Sl, B, h});
      A.ln2_mean = act(r, {Sl * B});
      A.ln2_rstd = act(r, {Sl * B});
      if (R.shard->layer(l).moe) {
        const std::int64_t E = m.num_experts;
        A.stats_total = act(r, {2 * E + 2});
        A.mlp_out = sp || tp == 1 ? act(r, {Sl, B, h}) : act(r, {Sc, B, h});
        const int slots = ampipe();
        A.moe.resize(static_cast<std::size_t>(slots));
        for (int c = 0; c < slots; ++c)
          allocate_slot(r, A, c);
      } else {
        A.ln2_full = sp ? act(r, {Sc, B, h}) : A.ln2;
        A.fc1 = act(r, {Sc, B, f1l});
        A.act = act(r, {Sc, B, fl});
        A.fc2_partial = act(r, {Sc, B, h});
        A.mlp_out = sp ? act(r, {Sl, B, h}) : A.fc2_partial;
      }
      A.x_out = act(r, {Sl, B, h});
      x = A.x_out;
    }
    R.final_ln = act(r, {Sl, B, h});
    R.final_mean = act(r, {Sl * B});
    R.final_rstd = act(r, {Sl * B});
    R.final_full = sp ? act(r, {Sc, B, h}) : R.final_ln;
    R.logits = act(r, {Sc * B, Vl});
    R.row_max = act(r, {Sc * B});
    R.partials = act(r, {Sc * B, ops::kCrossEntropyPartials});
    R.lse = act(r, {Sc * B});
    R.norm_sq = act(r, {1});
    R.loss.assign(static_cast<std::size_t>(M), 0.0);
    R.aux.assign(static_cast<std::size_t>(M), 0.0);
    BackwardWorkspace& W = R.ws;
    W.d_x = act(r, {Sl, B, h});
    W.d_x_mid = act(r, {Sl, B, h});
    W.d_tmp = act(r, {Sl, B, h});
    W.d_mlp = act(r, {Sl, B, h});
    W.d_mlp_full = sp ? act(r, {Sc, B, h}) : W.d_mlp;
    W.d_act = act(r, {Sc, B, fl});
    W.d_fc1 = act(r, {Sc, B, f1l});
    W.d_norm_full = act(r, {Sc, B, h});
    W.d_norm = sp ? act(r, {Sl, B, h}) : W.d_norm_full;
    W.d_attn = act(r, {Sc, B, Hl * d});
    W.d_qkv = act(r, {Sc, B, Hl, 3 * d});
    if (cp > 1) {
      for (int i = 0; i < 2; ++i) {
        W.ring[i] = act(r, {Sc, B, Hl, 2 * d});
        W.dring[i] = act(r, {Sc, B, Hl, 2 * d});
      }
      if (ampipe() > 1) {
        W.dkv_send = act(r, {cp * Sc, B, Hl, 2 * d});
        W.dkv_recv = act(r, {cp * Sc, B, Hl, 2 * d});
      }
      W.o_part = act(r, {chunk, B, Hl, d});
      W.dq_part = act(r, {chunk, B, Hl, d});
      W.lse_part = act(r, {B, Hl, chunk});
      const int me = mesh.coordinates(r).cp;
      W.ring_send.assign(static_cast<std::size_t>(cp), 0);
      W.ring_send[(me + 1) % cp] = Sc;
      W.ring_recv.assign(static_cast<std::size_t>(cp), 0);
    }
    W.d_logits = act(r, {Sc * B, Vl});
    W.d_final_full = act(r, {Sc, B, h});
  }

  // ---------------------------------------------------------------------------- graph helpers

  // Adds one compute task per rank; fn(rank) is the work.
  std::vector<TaskId> each(const std::string& name, rt::TaskTags tags,
                           std::function<void(int)> fn) {
    auto shared = std::make_shared<std::function<void(int)>>(std::move(fn));
    std::vector<TaskId> ids;
    for (int r = 0; r < mesh.size(); ++r)
      ids.push_back(b.add({.device = static_cast<rt::DeviceId>(r),
                           .stream = compute_stream,
                           .kind = rt::TaskKind::compute,
                           .name = name,
                           .tags = tags,
                           .cost = {.flops = flops_of(name)}},
                          [shared, r](rt::TaskContext&) { (*shared)(r); }));
    return ids;
  }

  // The multiply-adds (x2) of a task, by its kind, for the virtual clock: the matrix products
  // and attention; the element-wise work is small beside them.
  double flops_of(const std::string& name) const {
    // Names are "kind", "L<layer>.kind", for an Ampipe chunk "L<layer>.c<chunk>.kind", and for a
    // pipe-experts item "L<layer>[.c<chunk>].i<item>.kind".
    std::string kind = name;
    if (kind.size() > 1 && kind[0] == 'L' && kind.find('.') != std::string::npos)
      kind = kind.substr(kind.find('.') + 1);
    // Strips a "<letter><number>." prefix, returning the number (or -1).
    auto strip = [&kind](char letter) {
      if (kind.size() < 2 || kind[0] != letter ||
          !std::isdigit(static_cast<unsigned char>(kind[1])) || kind.find('.') == std::string::npos)
        return -1;
      const int index = std::stoi(kind.substr(1, kind.find('.') - 1));
      kind = kind.substr(kind.find('.') + 1);
      return index;
    };
    const int chunk_index = strip('c');
    if (strip('i') >= 0) {
      // One item: its share of its slot's expert work (balanced routing).
      const double items = static_cast<double>(m.num_experts / ep() * plan.pipe_experts_slices());
      const double k = m.moe_router_topk, hd = static_cast<double>(h);
      const double f1 = m.activation == Activation::swiglu ? 2.0 * f : f;
      const double experts = 2 * static_cast<double>(T) * k * hd * (f1 + f) / ampipe() / items;
      if (kind == "experts") return experts;
      if (kind == "experts_backward") return 2 * experts;
      return 0;
    }
    if (chunk_index >= 0) {
      // One Ampipe chunk: 1/N of the per-token work; a piece of q queries from row `first`
      // sees q (2 first + q) / Sc^2 of the causal attention's keys ((2c+1)/N^2 of them for a
      // chunk in one piece).
      const double N = ampipe();
      double causal = 0;
      for (int j = 0; j < t_sp; ++j) {
        const double q = static_cast<double>(piece_rows());
        const double first = static_cast<double>(piece_start(chunk_index, j));
        causal += q * (2 * first + q) / (static_cast<double>(Sc) * static_cast<double>(Sc));
      }
      const double share = 1.0 / N;
      const double rows = static_cast<double>(Sc * B), hd = static_cast<double>(h);
      const double proj = 2 * rows * Hl * d * hd;
      // This rank's causal attention: its Sc queries against half of the S keys on average.
      const double attention =
          2 * 2 * static_cast<double>(B * Hl * Sc) * static_cast<double>(S) * d * 0.5;
      if (cp > 1) {
        // Under CP a chunk is one of the two balanced halves: a half against one block is
        // 1/(2 cp) of the attention; chunk 1 attends to all cp blocks in one task.
        const double per_block = attention / (2.0 * cp);
        const double blocks = chunk_index == 1 ? cp : 1;
        if (kind == "attention_step") return per_block;
        if (kind == "attention") return blocks * per_block + proj / 2;
        if (kind == "attention_backward") return 2.5 * attention / 2 + proj;
      }
      const double k = m.moe_router_topk;
      const double f1 = m.activation == Activation::swiglu ? 2.0 * f : f;
      const double experts = 2 * static_cast<double>(T) * k * hd * (f1 + f);
      const double router = 2 * static_cast<double>(T) * hd * m.num_experts;
      if (kind == "attention") return causal * attention + share * proj;
      if (kind == "router") return share * router;
      if (kind == "experts") return share * experts;
      if (kind == "attention_backward") return 2.5 * causal * attention + 2 * share * proj;
      if (kind == "experts_backward") return 2 * share * experts;
      if (kind == "router_backward") return 2 * share * router;
      return 0;
    }
    const double rows = static_cast<double>(Sc * B), hd = static_cast<double>(h);
    const double qkv = 2 * rows * hd * 3 * Hl * d, proj = 2 * rows * Hl * d * hd;
    // Causal attention: half of the (local queries x all keys) scores, two products.
    const double attention =
        2 * 2 * static_cast<double>(B * Hl * Sc) * static_cast<double>(S / cp * cp) * d * 0.5;
    const double mlp = 2 * rows * hd * (f1l + fl);
    const double logits = 2 * rows * hd * Vl;
    const double k = m.moe_router_topk;
    const double f1 = m.activation == Activation::swiglu ? 2.0 * f : f;
    const double experts = 2 * static_cast<double>(T) * k * hd * (f1 + f);
    if (kind == "qkv") return qkv;
    if (kind == "attention") return attention / cp + proj;
    if (kind == "attention_step") return attention / cp;
    if (kind == "attention_backward_step") return 2.5 * attention / cp;
    if (kind == "mlp") return mlp;
    if (kind == "logits") return logits;
    if (kind == "experts") return experts;
    if (kind == "router") return 2 * static_cast<double>(T) * hd * m.num_experts;
    if (kind == "attention_backward") return 2 * proj + (cp == 1 ? 2.5 * attention : 0);
    if (kind == "qkv_backward" || kind == "qkv_weight_grad") return qkv;
    if (kind == "mlp_backward") return 2 * rows * hd * fl * 2 + 2 * rows * hd * f1l;
    if (kind == "mlp_weight_grad") return 2 * rows * hd * f1l;
    if (kind == "loss_backward" || kind == "logits_weight_grad") return logits;
    if (kind == "experts_backward") return 2 * experts;
    if (kind == "router_backward") return 4 * static_cast<double>(T) * hd * m.num_experts;
    return 0;
  }

  void link(const std::vector<TaskId>& before, const std::vector<TaskId>& after) {
    for (std::size_t r = 0; r < before.size(); ++r)
      if (before[r] != rt::kNoTask && after[r] != rt::kNoTask) b.precede(before[r], after[r]);
  }

  // Runs `collective` once per group of `kind` (skipped for groups of one), after `producers`,
  // and returns the member task of each rank (kNoTask where skipped).
  using GroupCall = std::function<std::vector<TaskId>(const devices::ProcessGroup&)>;
  std::vector<TaskId> per_group(GroupKind kind, const std::vector<TaskId>& producers,
                                const GroupCall& call, bool gradient_stream = false) {
    std::vector<TaskId> members(ranks.size(), rt::kNoTask);
    for (const auto& g : mesh.groups(kind)) {
      if (g.size() == 1) continue;
      const auto ids = call(g);
      for (int i = 0; i < g.size(); ++i) {
        const int r = static_cast<int>(g.device(i));
        members[r] = ids[i];
        if (producers[r] != rt::kNoTask) b.precede(producers[r], ids[i]);
        (gradient_stream ? last_grad : last_comm)[r] = ids[i];
      }
    }
    return members;
  }

  // Sum (or max) `buffer(rank)` in place over each group of `kind`; on the "grad_comm" stream
  // when `gradient_stream`.
  std::vector<TaskId> all_reduce_over(GroupKind kind, const std::vector<TaskId>& producers,
                                      std::function<Tensor(int)> buffer, devices::ReduceOp op,
                                      const std::string& name, rt::TaskTags tags,
                                      bool gradient_stream = false) {
    return per_group(
        kind, producers,
        [&](const devices::ProcessGroup& g) {
          std::vector<std::span<float>> bufs;
          for (rt::DeviceId dv : g.devices())
            bufs.push_back(all_of(buffer(static_cast<int>(dv))));
          return comm.all_reduce(
              b, g, bufs, op,
              {.name = name, .tags = tags, .stream = gradient_stream ? "grad_comm" : "comm"});
        },
        gradient_stream);
  }

  std::vector<TaskId> tp_all_reduce(const std::vector<TaskId>& producers,
                                    std::function<Tensor(int)> buffer, devices::ReduceOp op,
                                    const std::string& name, rt::TaskTags tags) {
    return all_reduce_over(GroupKind::tensor, producers, std::move(buffer), op, name, tags);
  }

  // Sequence parallelism's g: all-gather [Sl, B, ...] shards into [S, B, ...].
  std::vector<TaskId> tp_all_gather(const std::vector<TaskId>& producers,
                                    std::function<Tensor(int)> shard,
                                    std::function<Tensor(int)> full, const std::string& name,
                                    rt::TaskTags tags) {
    return per_group(GroupKind::tensor, producers, [&](const devices::ProcessGroup& g) {
      std::vector<std::span<const float>> in;
      std::vector<std::span<float>> out;
      for (rt::DeviceId dv : g.devices()) {
        const Tensor s = shard(static_cast<int>(dv));
        in.emplace_back(s.data(), static_cast<std::size_t>(s.numel()));
        out.push_back(all_of(full(static_cast<int>(dv))));
      }
      return comm.all_gather(b, g, in, out, {.name = name, .tags = tags});
    });
  }

  // Sequence parallelism's g-bar: reduce-scatter [S, B, ...] partial sums into [Sl, B, ...].
  std::vector<TaskId> tp_reduce_scatter(const std::vector<TaskId>& producers,
                                        std::function<Tensor(int)> full,
                                        std::function<Tensor(int)> shard, const std::string& name,
                                        rt::TaskTags tags) {
    return per_group(GroupKind::tensor, producers, [&](const devices::ProcessGroup& g) {
      std::vector<std::span<const float>> in;
      std::vector<std::span<float>> out;
      for (rt::DeviceId dv : g.devices()) {
        const Tensor s = full(static_cast<int>(dv));
        in.emplace_back(s.data(), static_cast<std::size_t>(s.numel()));
        out.push_back(all_of(shard(static_cast<int>(dv))));
      }
      return comm.reduce_scatter(b, g, in, out, devices::ReduceOp::sum,
                                 {.name = name, .tags = tags});
    });
  }

  // g-bar in forward: reduce-scatter under SP, all-reduce otherwise (the shard is the buffer).
  std::vector<TaskId> reduce_partial(const std::vector<TaskId>& producers,
                                     std::function<Tensor(int)> full,
                                     std::function<Tensor(int)> shard, const std::string& name,
                                     rt::TaskTags tags) {
    if (t_sp > 1) return tp_reduce_scatter(producers, full, shard, name, tags);
    return tp_all_reduce(producers, full, devices::ReduceOp::sum, name, tags);
  }

  // ------------------------------------------------------------------------------ the model

  // The global position of a context-parallel rank's local position s in [0, Sc): it holds
  // chunks cp_rank and 2 cp - 1 - cp_rank of the 2 cp chunks, so causal work is even.
  std::int64_t context_position(int cp_rank, std::int64_t s) const {
    if (cp == 1) return s;
    const std::int64_t which = s / chunk == 0 ? cp_rank : 2 * cp - 1 - cp_rank;
    return which * chunk + s % chunk;
  }
  // The global position of row s of rank r's [Sl, B, ...] activations.
  std::int64_t position(int r, std::int64_t s) const {
    const MeshCoordinates at = mesh.coordinates(r);
    return context_position(at.cp, (t_sp > 1 ? at.tp * Sl : 0) + s);
  }

  // This rank's positions of the micro-batch's tokens and targets.
  void load_tokens(int r, int mb) {
    RankState& R = ranks[r];
    const MicroBatch& data = batches[mesh.coordinates(r).dp][mb];
    R.tokens.resize(static_cast<std::size_t>(Sc * B));
    R.targets.resize(static_cast<std::size_t>(Sc * B));
    const int at_cp = mesh.coordinates(r).cp;
    for (std::int64_t s = 0; s < Sc; ++s) {
      const std::int64_t g = context_position(at_cp, s);
      for (std::int64_t bi = 0; bi < B; ++bi) {
        R.tokens[s * B + bi] = data.tokens[g * B + bi];
        R.targets[s * B + bi] = data.targets[g * B + bi];
      }
    }
  }

  // Dropout on rank r's [Sl, B, h] activations (out may be in): masks keyed by global token, so
  // any split of the sequence draws the one-device masks. Runs of contiguous positions go to the
  // kernel one at a time. Without dropout, a copy.
  void apply_dropout(bool backward, int r, int mb, int layer, int site, const Tensor& in,
                     const Tensor& out, std::int64_t first_row = 0) {
    if (m.hidden_dropout <= 0) {
      if (out.data() != in.data()) out.copy_from(in);
      return;
    }
    const MeshCoordinates at = mesh.coordinates(r);
    ops::DropoutSpec spec{
        .probability = m.hidden_dropout,
        .key = {.seed = m.seed ^ (0x9E3779B97F4A7C15ull * static_cast<std::uint64_t>(iteration)),
                .layer = static_cast<std::uint32_t>(layer),
                .site = static_cast<std::uint32_t>(site)},
        .sequence_length = S,
        .batch_offset = (static_cast<std::int64_t>(at.dp) * M + mb) * B};
    // in and out hold rows [first_row, first_row + rows) of the rank's [Sl, B, h] layout.
    const std::int64_t rows = in.dim(0);
    for (std::int64_t s0 = 0; s0 < rows;) {
      std::int64_t s1 = s0 + 1;
      while (s1 < rows && position(r, first_row + s1) == position(r, first_row + s0) + (s1 - s0))
        ++s1;
      spec.sequence_offset = position(r, first_row + s0);
      const Tensor x = in.slice(0, s0, s1 - s0).transpose(0, 1);
      const Tensor y = out.slice(0, s0, s1 - s0).transpose(0, 1);
      if (backward)
        ops::dropout_backward(spec, x, y);
      else
        ops::dropout_forward(spec, x, y);
      s0 = s1;
    }
  }

  // x_out = x_in + dropout(y + bias): the residual branch's end, on [Sl, B, h].
  void bias_dropout_add(int r, int mb, int layer, int site, const Tensor& y, const Tensor& bias,
                        const Tensor& x_in, const Tensor& x_out, std::int64_t first_row = 0) {
    const std::int64_t rows = y.rows();
    for (std::int64_t i = 0; i < rows; ++i) {
      float* row = y.row(i);
      for (std::int64_t c = 0; c < h; ++c)
        row[c] += bias.data()[c];
    }
    apply_dropout(false, r, mb, layer, site, y, y, first_row);
    ops::add(x_in, y, x_out);
  }

  // The backward of bias_dropout_add: d_y = dropout'(d_out); d_bias += rows of d_y.
  void bias_dropout_add_backward(int r, int mb, int layer, int site, const Tensor& d_out,
                                 const Tensor& d_y, const Tensor& d_bias,
                                 std::int64_t first_row = 0) {
    apply_dropout(true, r, mb, layer, site, d_out, d_y, first_row);
    for (std::int64_t i = 0; i < d_y.rows(); ++i) {
      const float* row = d_y.row(i);
      for (std::int64_t c = 0; c < h; ++c)
        d_bias.data()[c] += row[c];
    }
  }

  void build_forward(int mb) {
    const rt::TaskTags tags{.micro_batch = static_cast<std::uint16_t>(mb),
                            .phase = rt::Phase::forward};
    // Embedding: each rank looks up its vocabulary shard; the group sums (or reduce-scatters).
    auto emb = each("embedding", tags, [this, mb](int r) {
      RankState& R = ranks[r];
      load_tokens(r, mb);
      ops::embedding_forward<float>(R.tokens, R.shard->embedding().value,
                                    {R.shard->vocab_start(), m.padded_vocab_size(tp)},
                                    R.emb_partial);
    });
    auto emb_comm = reduce_partial(
        emb, [this](int r) { return ranks[r].emb_partial; },
        [this](int r) { return ranks[r].emb_out; }, "embedding_reduce", tags);
    auto pos = each("positions", tags, [this, mb](int r) {
      RankState& R = ranks[r];
      for (std::int64_t s = 0; s < Sl; ++s)
        for (std::int64_t bi = 0; bi < B; ++bi) {
          float* row = R.emb_out.data() + (s * B + bi) * h;
          const float* p = R.shard->positions().value.row(position(r, s));
          for (std::int64_t c = 0; c < h; ++c)
            row[c] += p[c];
        }
      apply_dropout(false, r, mb, m.num_layers, 2, R.emb_out, R.emb_out);
    });
    link(emb_comm, pos);
    std::vector<TaskId> prev = pos;
    for (int l = 0; l < m.num_layers; ++l)
      prev = build_layer_forward(l, mb, prev);
    build_loss(mb, prev);
  }

  std::vector<TaskId> build_layer_forward(int l, int mb, std::vector<TaskId> prev) {
    if (ampipe() > 1 && ranks[0].shard->layer(l).moe)
      return build_ampipe_layer_forward(l, mb, prev);
    rt::TaskTags tags{.layer = static_cast<std::uint16_t>(l),
                      .micro_batch = static_cast<std::uint16_t>(mb),
                      .phase = rt::Phase::forward};
    auto L = [this, l](int r) -> LayerActivations& { return ranks[r].layers[l]; };
    auto P = [this, l](int r) -> const LayerShard& { return ranks[r].shard->layer(l); };
    const std::string at = fmt::format("L{}.", l);
    auto qkv = build_attention_input(l, prev, tags);
    std::vector<TaskId> attn;
    if (cp == 1) {
      attn = each(at + "attention", tags, [=, this](int r) {
        LayerActivations& A = L(r);
        ops::attention_forward({}, head_view(A.qkv, 0), head_view(A.qkv, 1), head_view(A.qkv, 2),
                               A.attn.transpose(0, 1), A.lse.reshape({B, Hl, Sc}));
        ops::linear_forward(A.attn.reshape({Sc, B, Hl * d}), P(r).proj_weight->value, Tensor{},
                            A.proj_partial);
      });
      link(qkv, attn);
    } else {
      attn = build_ring_attention_forward(l, qkv, tags);
    }
    auto gbar1 = reduce_partial(
        attn, [=](int r) { return L(r).proj_partial; }, [=](int r) { return L(r).proj_out; },
        at + "attention_reduce", tags);
    auto res1 = each(at + "attention_residual", tags, [=, this](int r) {
      LayerActivations& A = L(r);
      bias_dropout_add(r, mb, l, 0, A.proj_out, P(r).proj_bias->value, A.x_in, A.x_mid);
      ops::layer_norm_forward(A.x_mid, P(r).ln2_weight->value, P(r).ln2_bias->value,
                              m.layernorm_epsilon, A.ln2, A.ln2_mean, A.ln2_rstd);
    });
    link(gbar1, res1);
    std::vector<TaskId> mlp_done;
    if (ranks[0].shard->layer(l).moe) {
      mlp_done = build_moe_forward(l, mb, res1, tags);
    } else {
      std::vector<TaskId> g2(ranks.size(), rt::kNoTask);
      if (t_sp > 1)
        g2 = tp_all_gather(
            res1, [=](int r) { return L(r).ln2; }, [=](int r) { return L(r).ln2_full; },
            at + "sp_gather_mlp", tags);
      auto mlp = each(at + "mlp", tags, [=, this](int r) {
        LayerActivations& A = L(r);
        ops::linear_forward(A.ln2_full, P(r).fc1_weight->value, P(r).fc1_bias->value, A.fc1);
        activation_forward(A.fc1, A.act);
        ops::linear_forward(A.act, P(r).fc2_weight->value, Tensor{}, A.fc2_partial);
      });
      link(g2, mlp);
      mlp_done = reduce_partial(
          mlp, [=](int r) { return L(r).fc2_partial; }, [=](int r) { return L(r).mlp_out; },
          at + "mlp_reduce", tags);
      for (std::size_t r = 0; r < mlp_done.size(); ++r)
        if (mlp_done[r] == rt::kNoTask) mlp_done[r] = mlp[r];
    }
    auto res2 = each(at + "mlp_residual", tags, [=, this](int r) {
      LayerActivations& A = L(r);
      const Tensor bias = P(r).moe ? Tensor{} : P(r).fc2_bias->value;
      if (bias.defined()) {
        bias_dropout_add(r, mb, l, 1, A.mlp_out, bias, A.x_mid, A.x_out);
      } else {
        apply_dropout(false, r, mb, l, 1, A.mlp_out, A.mlp_out);
        ops::add(A.x_mid, A.mlp_out, A.x_out);
      }
    });
    link(mlp_done, res2);
    return res2;
  }

  // The input norm, sequence parallelism's gather and the QKV projection, on the whole local
  // sequence (also under Ampipe, whose chunks split only the queries).
  std::vector<TaskId> build_attention_input(int l, const std::vector<TaskId>& prev,
                                            rt::TaskTags tags) {
    auto L = [this, l](int r) -> LayerActivations& { return ranks[r].layers[l]; };
    auto P = [this, l](int r) -> const LayerShard& { return ranks[r].shard->layer(l); };
    const std::string at = fmt::format("L{}.", l);
    auto ln1 = each(at + "input_norm", tags, [=, this](int r) {
      LayerActivations& A = L(r);
      ops::layer_norm_forward(A.x_in, P(r).ln1_weight->value, P(r).ln1_bias->value,
                              m.layernorm_epsilon, A.ln1, A.ln1_mean, A.ln1_rstd);
    });
    link(prev, ln1);
    std::vector<TaskId> g1(ranks.size(), rt::kNoTask);
    if (t_sp > 1)
      g1 = tp_all_gather(
          ln1, [=](int r) { return L(r).ln1; }, [=](int r) { return L(r).ln1_full; },
          at + "sp_gather", tags);
    auto qkv = each(at + "qkv", tags, [=, this](int r) {
      LayerActivations& A = L(r);
      ops::linear_forward(A.ln1_full, P(r).qkv_weight->value, P(r).qkv_bias->value,
                          A.qkv.reshape({Sc, B, 3 * Hl * d}));
      if (cp > 1) {  // keys and values, contiguous: the block this rank sends round the ring
        A.kv_local.slice(3, 0, d).copy_from(A.qkv.slice(3, d, d));
        A.kv_local.slice(3, d, d).copy_from(A.qkv.slice(3, 2 * d, d));
      }
    });
    link(g1, qkv);
    return qkv;
  }

  // The backward of build_attention_input: QKV input gradient (with the ring's key/value
  // gradients under CP), its reduction over tp, the weight gradient overlapping that reduction,
  // and the input norm; then the attention half's gradient buckets.
  std::vector<TaskId> build_attention_input_backward(int l, const std::vector<TaskId>& ready_in,
                                                     bool last, rt::TaskTags tags) {
    auto L = [this, l](int r) -> LayerActivations& { return ranks[r].layers[l]; };
    auto P = [this, l](int r) -> const LayerShard& { return ranks[r].shard->layer(l); };
    auto W = [this](int r) -> BackwardWorkspace& { return ranks[r].ws; };
    const std::string at = fmt::format("L{}.", l);
    auto qkv_in = each(at + "qkv_backward", tags, [=, this](int r) {
      BackwardWorkspace& w = W(r);
      if (cp > 1) {  // the block's gradients came home with the last turn of the ring
        const Tensor& home = w.dring[cp % 2];
        w.d_qkv.slice(3, d, d).copy_from(home.slice(3, 0, d));
        w.d_qkv.slice(3, 2 * d, d).copy_from(home.slice(3, d, d));
      }
      ops::linear_backward_input(w.d_qkv.reshape({Sc, B, 3 * Hl * d}), P(r).qkv_weight->value,
                                 w.d_norm_full);
    });
    link(ready_in, qkv_in);
    auto red = reduce_partial(
        qkv_in, [=](int r) { return W(r).d_norm_full; }, [=](int r) { return W(r).d_norm; },
        at + "attention_grad_reduce", tags);
    auto wg = each(at + "qkv_weight_grad", tags, [=, this](int r) {
      ops::linear_backward_weight(L(r).ln1_full, W(r).d_qkv.reshape({Sc, B, 3 * Hl * d}),
                                  P(r).qkv_weight->grad, P(r).qkv_bias->grad);
    });
    std::vector<TaskId> ready = red;
    for (std::size_t r = 0; r < red.size(); ++r)
      if (red[r] == rt::kNoTask) ready[r] = wg[r];
    auto ln1 = each(at + "input_norm_backward", tags, [=, this](int r) {
      LayerActivations& A = L(r);
      BackwardWorkspace& w = W(r);
      ops::layer_norm_backward(A.x_in, P(r).ln1_weight->value, A.ln1_mean, A.ln1_rstd, w.d_norm,
                               w.d_tmp, P(r).ln1_weight->grad, P(r).ln1_bias->grad);
      ops::accumulate(w.d_tmp, w.d_x);
    });
    link(ready, ln1);
    if (last) reduce_buckets(fmt::format("layers.{}.attention", l), ln1);
    return ln1;
  }

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

  std::vector<TaskId> build_ampipe_layer_forward(int l, int mb, std::vector<TaskId> prev) {
    const rt::TaskTags tags{.layer = static_cast<std::uint16_t>(l),
                            .micro_batch = static_cast<std::uint16_t>(mb),
                            .phase = rt::Phase::forward};
    auto L = [this, l](int r) -> LayerActivations& { return ranks[r].layers[l]; };
    auto P = [this, l](int r) -> const LayerShard& { return ranks[r].shard->layer(l); };
    const std::string at = fmt::format("L{}.", l);
    const std::int64_t q = piece_rows(), n = t_sp * q;  // n: the chunk's rows of the sequence
    auto qkv = build_attention_input(l, prev, tags);
    // Residual and norm of this rank's rows of chunk c, from the out-projection's sum `proj`.
    auto residual_norm = [=, this](int r, int c, const Tensor& proj) {
      LayerActivations& A = L(r);
      const std::int64_t first = c * q;
      bias_dropout_add(r, mb, l, 0, proj, P(r).proj_bias->value, A.x_in.slice(0, first, q),
                       A.x_mid.slice(0, first, q), first);
      ops::layer_norm_forward(A.x_mid.slice(0, first, q), P(r).ln2_weight->value,
                              P(r).ln2_bias->value, m.layernorm_epsilon, A.ln2.slice(0, first, q),
                              A.ln2_mean.slice(0, first * B, q * B),
                              A.ln2_rstd.slice(0, first * B, q * B));
    };
    std::vector<std::vector<TaskId>> routed(static_cast<std::size_t>(ampipe()));
    for (int c = 0; c < ampipe(); ++c) {
      const std::string chunk = at + fmt::format("c{}.", c);
      // The out-projection's partial sums of the chunk's rows, piece after piece.
      auto partial = [=](int r) { return L(r).proj_partial.slice(0, c * n, n); };
      if (cp > 1) {
        routed[c] = moe_route(
            l, c,
            ampipe_ring_attention(l, c, qkv, tags,
                                  [=, this](int r) {
                                    ops::linear_forward(
                                        L(r).attn.slice(0, c * q, q).reshape({q, B, Hl * d}),
                                        P(r).proj_weight->value, Tensor{}, partial(r));
                                    residual_norm(r, c, partial(r));
                                  }),
            tags);
        continue;
      }
      auto side = each(chunk + "attention", tags, [=, this](int r) {
        LayerActivations& A = L(r);
        for (int j = 0; j < t_sp; ++j) {
          const std::int64_t first = piece_start(c, j);
          ops::attention_forward({.q_offset = first}, head_view(A.qkv.slice(0, first, q), 0),
                                 head_view(A.qkv, 1), head_view(A.qkv, 2),
                                 A.attn.slice(0, first, q).transpose(0, 1),
                                 A.lse.slice(0, c * t_sp + j, 1).reshape({B, Hl, q}));
          ops::linear_forward(A.attn.slice(0, first, q).reshape({q, B, Hl * d}),
                              P(r).proj_weight->value, Tensor{}, partial(r).slice(0, j * q, q));
        }
        if (t_sp == 1) residual_norm(r, c, partial(r));
      });
      // After the previous chunk's router by the compute stream's order only: its dispatch may
      // still be running, and that is the overlap.
      link(qkv, side);
      if (t_sp > 1) {
        // Each rank's piece of the summed projection comes home, on the comm stream.
        auto reduced = tp_reduce_scatter(
            side, partial, [=](int r) { return L(r).proj_out.slice(0, c * q, q); },
            chunk + "attention_reduce", tags);
        side = each(chunk + "attention_residual", tags,
                    [=, this](int r) { residual_norm(r, c, L(r).proj_out.slice(0, c * q, q)); });
        link(reduced, side);
      }
      routed[c] = moe_route(l, c, side, tags);
    }
    std::vector<std::vector<TaskId>> computed(static_cast<std::size_t>(ampipe()));
    for (int c = 0; c < ampipe(); ++c)
      computed[c] = moe_experts(l, c, routed[c], tags);
    // The chunks' routers ran earlier on this compute stream; the statistics need nothing else.
    auto stats = moe_statistics(l, mb, std::vector<TaskId>(ranks.size(), rt::kNoTask), tags);
    std::vector<TaskId> last;
    for (int c = 0; c < ampipe(); ++c) {
      auto combine = moe_combine(l, c, computed[c], tags);
      auto residual = each(at + fmt::format("c{}.mlp_residual", c), tags, [=, this](int r) {
        LayerActivations& A = L(r);
        const std::int64_t first = c * q;
        const Tensor y = A.mlp_out.slice(0, first, q);
        apply_dropout(false, r, mb, l, 1, y, y, first);
        ops::add(A.x_mid.slice(0, first, q), y, A.x_out.slice(0, first, q));
      });
      link(combine, residual);
      link(stats, residual);
      last = residual;
    }
    return last;
  }

  std::vector<TaskId> build_ampipe_layer_backward(int l, int mb, std::vector<TaskId> prev,
                                                  bool last_micro_batch) {
    const rt::TaskTags tags{.layer = static_cast<std::uint16_t>(l),
                            .micro_batch = static_cast<std::uint16_t>(mb),
                            .phase = rt::Phase::backward};
    auto L = [this, l](int r) -> LayerActivations& { return ranks[r].layers[l]; };
    auto P = [this, l](int r) -> const LayerShard& { return ranks[r].shard->layer(l); };
    auto W = [this](int r) -> BackwardWorkspace& { return ranks[r].ws; };
    const std::string at = fmt::format("L{}.", l);
    const std::int64_t q = piece_rows(), n = t_sp * q;
    auto start = each(at + "mlp_residual_backward", tags, [=, this](int r) {
      BackwardWorkspace& w = W(r);
      w.d_x_mid.copy_from(w.d_x);
      apply_dropout(true, r, mb, l, 1, w.d_x, w.d_mlp);
      w.d_qkv.fill(0.f);                 // the chunks' attention accumulates dk and dv
      if (cp > 1) w.dkv_send.fill(0.f);  // ... or, under CP, every block's
    });
    link(prev, start);
    const int N = ampipe();
    std::vector<std::vector<TaskId>> combined(static_cast<std::size_t>(N)),
        experts(static_cast<std::size_t>(N));
    for (int c = N - 1; c >= 0; --c)
      combined[c] = moe_combine_backward(l, c, start, tags);
    for (int c = N - 1; c >= 0; --c)
      experts[c] = moe_experts_backward(l, c, combined[c], tags);
    std::vector<TaskId> side;
    for (int c = N - 1; c >= 0; --c) {
      const std::string chunk = at + fmt::format("c{}.", c);
      auto router = moe_router_backward(l, c, experts[c], tags);
      // The norm, residual and bias of this rank's rows of the chunk: d_proj in d_mlp's rows.
      auto residual_backward = [=, this](int r) {
        LayerActivations& A = L(r);
        BackwardWorkspace& w = W(r);
        const std::int64_t first = c * q;
        const Tensor d_norm = w.d_norm.slice(0, first, q), d_tmp = w.d_tmp.slice(0, first, q);
        const Tensor d_mid = w.d_x_mid.slice(0, first, q), d_proj = w.d_mlp.slice(0, first, q);
        d_norm.reshape({q * B, h}).copy_from(slot(r, l, c).d_moe_in);
        ops::layer_norm_backward(A.x_mid.slice(0, first, q), P(r).ln2_weight->value,
                                 A.ln2_mean.slice(0, first * B, q * B),
                                 A.ln2_rstd.slice(0, first * B, q * B), d_norm, d_tmp,
                                 P(r).ln2_weight->grad, P(r).ln2_bias->grad);
        ops::accumulate(d_tmp, d_mid);
        w.d_x.slice(0, first, q).copy_from(d_mid);  // the residual path to the layer input
        bias_dropout_add_backward(r, mb, l, 0, d_mid, d_proj, P(r).proj_bias->grad, first);
      };
      // The projection's gradient of the chunk's rows of the sequence, piece after piece (under
      // SP gathered from every rank's piece).
      auto d_proj_rows = [=, this](int r) {
        return t_sp > 1 ? W(r).d_mlp_full.slice(0, c * n, n) : W(r).d_mlp.slice(0, c * q, q);
      };
      std::vector<TaskId> ready = router;
      if (t_sp > 1) {
        auto res = each(chunk + "attention_residual_backward", tags, residual_backward);
        link(router, res);
        ready = tp_all_gather(
            res, [=, this](int r) { return W(r).d_mlp.slice(0, c * q, q); }, d_proj_rows,
            chunk + "attention_grad_gather", tags);
      }
      auto attn = each(chunk + "attention_backward", tags, [=, this](int r) {
        LayerActivations& A = L(r);
        BackwardWorkspace& w = W(r);
        if (t_sp == 1) residual_backward(r);
        if (cp > 1) {
          ampipe_ring_attention_backward(r, l, c);
          return;
        }
        for (int j = 0; j < t_sp; ++j) {
          const std::int64_t first = piece_start(c, j);
          const Tensor d_proj = d_proj_rows(r).slice(0, j * q, q);
          const Tensor d_attn = w.d_attn.reshape({Sc, B, Hl * d}).slice(0, first, q);
          ops::linear_backward_input(d_proj, P(r).proj_weight->value, d_attn);
          ops::linear_backward_weight(A.attn.slice(0, first, q).reshape({q, B, Hl * d}), d_proj,
                                      P(r).proj_weight->grad, Tensor{});
          ops::attention_backward({.q_offset = first}, head_view(A.qkv.slice(0, first, q), 0),
                                  head_view(A.qkv, 1), head_view(A.qkv, 2),
                                  A.attn.slice(0, first, q).transpose(0, 1),
                                  A.lse.slice(0, c * t_sp + j, 1).reshape({B, Hl, q}),
                                  d_attn.reshape({q, B, Hl, d}).transpose(0, 1),
                                  head_view(w.d_qkv.slice(0, first, q), 0), head_view(w.d_qkv, 1),
                                  head_view(w.d_qkv, 2));
        }
      });
      link(ready, attn);
      side = attn;
    }
    if (cp > 1) side = send_block_gradients_home(l, side, tags);
    if (last_micro_batch) reduce_buckets(fmt::format("layers.{}.mlp", l), side);
    return build_attention_input_backward(l, side, last_micro_batch, tags);
  }

  // Ampipe under context parallelism (degree 2): the chunks are the two load-balanced halves a
  // rank holds. Chunk 0's attention runs the ring and keeps every key/value block it brings in
  // kv_store (by owner), so chunk 1 attends to them all without communication, while chunk 0's
  // dispatch runs. In backward both chunks add their key/value gradients to per-owner blocks,
  // which one all-to-all sends home.
  Tensor kv_block(int r, int l, int owner) {
    return ranks[r].layers[l].kv_store.slice(0, owner * Sc, Sc);
  }

  // Attends half c of this rank's queries to `owner`'s block, folding it into the half's output.
  void attend_block(int r, int l, int c, int owner) {
    LayerActivations& A = ranks[r].layers[l];
    BackwardWorkspace& w = ranks[r].ws;
    const int me = mesh.coordinates(r).cp;
    const Tensor block = kv_block(r, l, owner);
    for (std::int64_t kc = 0; kc < 2; ++kc) {
      const Tensor keys = block.slice(0, kc * chunk, chunk);
      ops::attention_forward({.q_offset = context_position(me, c * chunk),
                              .k_offset = context_position(owner, kc * chunk)},
                             head_view(A.qkv.slice(0, c * chunk, chunk), 0), head_view(keys, 0),
                             head_view(keys, 1), w.o_part.transpose(0, 1), w.lse_part);
      merge_partial(A.attn.slice(0, c * chunk, chunk), A.lse.slice(0, c, 1).reshape({B, Hl, chunk}),
                    w.o_part, w.lse_part);
    }
  }

  // Chunk c's attention; `finish(r)` (its projection, residual and norm) ends the last task.
  std::vector<TaskId> ampipe_ring_attention(int l, int c, const std::vector<TaskId>& qkv,
                                            rt::TaskTags tags, std::function<void(int)> finish) {
    const std::string at = fmt::format("L{}.c{}.", l, c);
    auto begin_half = [=, this](int r) {
      LayerActivations& A = ranks[r].layers[l];
      A.attn.slice(0, c * chunk, chunk).fill(0.f);
      A.lse.slice(0, c, 1).fill(-std::numeric_limits<float>::infinity());
    };
    if (c == 1) {  // every block is here: chunk 0's ring brought them
      auto task = each(at + "attention", tags, [=, this](int r) {
        begin_half(r);
        for (int owner = 0; owner < cp; ++owner)
          attend_block(r, l, 1, owner);
        finish(r);
      });
      link(qkv, task);
      return task;
    }
    std::vector<TaskId> arrived = qkv, step;
    for (int t = 0; t < cp; ++t) {
      if (t > 0) {
        // Each block lands in its owner's slot of kv_store: nothing is overwritten.
        auto shift = ring_shift(
            arrived, [=, this](int r) { return kv_block(r, l, ring_owner(r, t - 1)); },
            [=, this](int r) { return kv_block(r, l, ring_owner(r, t)); },
            at + fmt::format("cp_ring{}", t), tags);
        link(qkv, shift);
        arrived = shift;
      }
      const bool last = t == cp - 1;
      step = each(at + (last ? "attention" : "attention_step"), tags, [=, this](int r) {
        if (t == 0) begin_half(r);
        attend_block(r, l, 0, ring_owner(r, t));
        if (last) finish(r);
      });
      link(arrived, step);
    }
    return step;
  }

  // Chunk c's attention backward against every stored block (after its projection's backward
  // into d_attn): dq into d_qkv, each block's dk and dv into dkv_send at its owner.
  void ampipe_ring_attention_backward(int r, int l, int c) {
    LayerActivations& A = ranks[r].layers[l];
    BackwardWorkspace& w = ranks[r].ws;
    const LayerShard& P = ranks[r].shard->layer(l);
    const int me = mesh.coordinates(r).cp;
    const Tensor d_proj = w.d_mlp.slice(0, c * chunk, chunk);
    const Tensor d_attn = w.d_attn.reshape({Sc, B, Hl * d}).slice(0, c * chunk, chunk);
    const Tensor attn = A.attn.slice(0, c * chunk, chunk);
    ops::linear_backward_input(d_proj, P.proj_weight->value, d_attn);
    ops::linear_backward_weight(attn.reshape({chunk, B, Hl * d}), d_proj, P.proj_weight->grad,
                                Tensor{});
    for (int owner = 0; owner < cp; ++owner) {
      const Tensor block = kv_block(r, l, owner), grads = w.dkv_send.slice(0, owner * Sc, Sc);
      for (std::int64_t kc = 0; kc < 2; ++kc) {
        const Tensor keys = block.slice(0, kc * chunk, chunk);
        const Tensor key_grads = grads.slice(0, kc * chunk, chunk);
        ops::attention_backward(
            {.q_offset = context_position(me, c * chunk),
             .k_offset = context_position(owner, kc * chunk)},
            head_view(A.qkv.slice(0, c * chunk, chunk), 0), head_view(keys, 0), head_view(keys, 1),
            attn.transpose(0, 1), A.lse.slice(0, c, 1).reshape({B, Hl, chunk}),
            d_attn.reshape({chunk, B, Hl, d}).transpose(0, 1), w.dq_part.transpose(0, 1),
            head_view(key_grads, 0), head_view(key_grads, 1));
        ops::accumulate(w.dq_part, w.d_qkv.slice(0, c * chunk, chunk).slice(3, 0, d));
      }
    }
  }

  // Every rank's gradient of block o goes to rank o in one all-to-all over the cp group; each
  // rank sums what came into dring[cp % 2], where the QKV backward takes its block's gradient.
  std::vector<TaskId> send_block_gradients_home(int l, const std::vector<TaskId>& ready,
                                                rt::TaskTags tags) {
    const std::string at = fmt::format("L{}.", l);
    auto sent = per_group(GroupKind::context, ready, [&](const devices::ProcessGroup& g) {
      std::vector<std::span<const float>> in;
      std::vector<std::span<float>> out;
      for (rt::DeviceId dv : g.devices()) {
        const BackwardWorkspace& w = ranks[static_cast<int>(dv)].ws;
        in.emplace_back(w.dkv_send.data(), static_cast<std::size_t>(w.dkv_send.numel()));
        out.push_back(all_of(w.dkv_recv));
      }
      return comm.all_to_all(b, g, in, out, {.name = at + "cp_kv_grad", .tags = tags});
    });
    auto home = each(at + "cp_kv_grad_sum", tags, [=, this](int r) {
      BackwardWorkspace& w = ranks[r].ws;
      const Tensor& sum = w.dring[cp % 2];
      sum.copy_from(w.dkv_recv.slice(0, 0, Sc));
      for (int source = 1; source < cp; ++source)
        ops::accumulate(w.dkv_recv.slice(0, source * Sc, Sc), sum);
    });
    link(sent, home);
    return home;
  }

  void activation_forward(const Tensor& pre, const Tensor& out) {
    if (m.activation == Activation::swiglu)
      swiglu_local(pre, out);
    else
      ops::gelu_forward(ops::GeluForm::tanh, pre, out);
  }
  void activation_backward(const Tensor& pre, const Tensor& d_out, const Tensor& d_pre) {
    if (m.activation == Activation::swiglu)
      ops::swiglu_backward(pre, d_out, d_pre);
    else
      ops::gelu_backward(ops::GeluForm::tanh, pre, d_out, d_pre);
  }
  static void swiglu_local(const Tensor& pre, const Tensor& out) { ops::swiglu_forward(pre, out); }

  ops::ExpertActivation expert_activation() const {
    return m.activation == Activation::swiglu ? ops::ExpertActivation::swiglu
                                              : ops::ExpertActivation::gelu_tanh;
  }

  ops::RouterOptions router_options() const {
    return {.top_k = m.moe_router_topk,
            .renormalize = m.moe_router_renormalize,
            .aux_loss_coeff = m.moe_aux_loss_coeff,
            .z_loss_coeff = m.moe_z_loss_coeff};
  }

  // This rank's tokens for the MoE layer: [T, h] (under SP its shard; otherwise its 1/tp of the
  // replicated sequence).
  Tensor moe_tokens(int r, const Tensor& sbh) const {
    if (t_sp > 1 || tp == 1) return sbh.reshape({T, h});
    return sbh.slice(0, mesh.coordinates(r).tp * (Sc / tp), Sc / tp).reshape({T, h});
  }

  static ops::RouterStatistics unpack_stats(const Tensor& stats, std::int64_t E) {
    ops::RouterStatistics s;
    const float* p = stats.data();
    s.assignments.assign(p, p + E);
    s.probability.assign(p + E, p + 2 * E);
    s.squared_lse = p[2 * E];
    s.tokens = static_cast<std::int64_t>(std::llround(p[2 * E + 1]));
    return s;
  }

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
                                 const std::string& name, rt::TaskTags tags) {
    return per_group(GroupKind::context, producers, [&](const devices::ProcessGroup& g) {
      std::vector<devices::VariableAllToAllBuffers> bufs;
      for (rt::DeviceId dv : g.devices()) {
        const int r = static_cast<int>(dv);
        BackwardWorkspace& w = ranks[r].ws;
        const Tensor in = from(r), out = into(r);
        bufs.push_back({{in.data(), static_cast<std::size_t>(in.numel())},
                        &w.ring_send,
                        {out.data(), static_cast<std::size_t>(out.numel())},
                        std::span<std::int64_t>(w.ring_recv)});
      }
      return comm.all_to_all_v(b, g, bufs, B * Hl * 2 * d, {.name = name, .tags = tags});
    });
  }

  // Folds one key block's partial attention (o_part, lse_part) into the running result of a
  // chunk of queries: L = log(e^L1 + e^L2), O = e^(L1 - L) O1 + e^(L2 - L) O2.
  void merge_partial(const Tensor& o, const Tensor& lse, const Tensor& o_part,
                     const Tensor& lse_part) const {
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    for (std::int64_t bi = 0; bi < B; ++bi)
      for (std::int64_t hh = 0; hh < Hl; ++hh)
        for (std::int64_t i = 0; i < chunk; ++i) {
          float& l1 = lse(bi, hh, i);
          const float l2 = lse_part(bi, hh, i);
          if (l2 == kNegInf) continue;
          const float top = std::max(l1, l2);
          const float merged = top + std::log(std::exp(l1 - top) + std::exp(l2 - top));
          const float w1 = l1 == kNegInf ? 0.f : std::exp(l1 - merged), w2 = std::exp(l2 - merged);
          float* acc = &o(i, bi, hh, 0);
          const float* part = &o_part(i, bi, hh, 0);
          for (std::int64_t x = 0; x < d; ++x)
            acc[x] = w1 * acc[x] + w2 * part[x];
          l1 = merged;
        }
  }

  // The block held at ring step t: where it lives and whose positions it has.
  Tensor ring_block(int r, int layer, int t) {
    return t == 0 ? ranks[r].layers[layer].kv_local : ranks[r].ws.ring[t % 2];
  }
  int ring_owner(int r, int t) const {
    const int me = mesh.coordinates(r).cp;
    return ((me - t) % cp + cp) % cp;
  }

  // Ring attention forward: cp steps; at step t each rank attends its two query chunks to the
  // key/value block of rank (me - t), while the comm stream already passes that block on.
  std::vector<TaskId> build_ring_attention_forward(int l, const std::vector<TaskId>& qkv,
                                                   rt::TaskTags tags) {
    const std::string at = fmt::format("L{}.", l);
    std::vector<TaskId> compute_prev, compute_prev2;
    std::vector<TaskId> arrived = qkv;
    for (int t = 0; t < cp; ++t) {
      if (t > 0) {
        // Pass the block on while step t - 1 computes with it; the receiver's buffer is free
        // once its step t - 2 is done.
        auto shift = ring_shift(
            arrived, [=, this](int r) { return ring_block(r, l, t - 1); },
            [=, this](int r) { return ranks[r].ws.ring[t % 2]; }, at + fmt::format("cp_ring{}", t),
            tags);
        if (t >= 2) link(compute_prev2, shift);
        link(qkv, shift);
        arrived = shift;
      }
      const bool last = t == cp - 1;
      auto step = each(at + (last ? "attention" : "attention_step"), tags, [=, this](int r) {
        LayerActivations& A = ranks[r].layers[l];
        BackwardWorkspace& w = ranks[r].ws;
        const LayerShard& P = ranks[r].shard->layer(l);
        if (t == 0) {
          A.attn.fill(0.f);
          A.lse.fill(-std::numeric_limits<float>::infinity());
        }
        const Tensor block = ring_block(r, l, t);
        const int me = mesh.coordinates(r).cp, owner = ring_owner(r, t);
        for (std::int64_t qc = 0; qc < 2; ++qc)
          for (std::int64_t kc = 0; kc < 2; ++kc) {
            const Tensor keys = block.slice(0, kc * chunk, chunk);
            ops::attention_forward({.q_offset = context_position(me, qc * chunk),
                                    .k_offset = context_position(owner, kc * chunk)},
                                   head_view(A.qkv.slice(0, qc * chunk, chunk), 0),
                                   head_view(keys, 0), head_view(keys, 1), w.o_part.transpose(0, 1),
                                   w.lse_part);
            merge_partial(A.attn.slice(0, qc * chunk, chunk),
                          A.lse.slice(0, qc, 1).reshape({B, Hl, chunk}), w.o_part, w.lse_part);
          }
        if (last)
          ops::linear_forward(A.attn.reshape({Sc, B, Hl * d}), P.proj_weight->value, Tensor{},
                              A.proj_partial);
      });
      link(arrived, step);
      compute_prev2 = compute_prev;
      compute_prev = step;
    }
    return compute_prev;
  }

  // Ring attention backward: the key/value blocks go round again; each rank adds its queries'
  // contribution to the travelling gradient of the block in hand and passes it on, so after cp
  // steps and one more turn every block's gradient is home (in dring[cp % 2]).
  std::vector<TaskId> build_ring_attention_backward(int l, const std::vector<TaskId>& start,
                                                    rt::TaskTags tags) {
    const std::string at = fmt::format("L{}.", l);
    std::vector<TaskId> compute_prev = start, compute_prev2;
    std::vector<TaskId> kv_arrived = start, grad_arrived = start;
    for (int t = 0; t <= cp; ++t) {
      if (t > 0) {
        // The gradient of the block computed at step t - 1 moves on.
        auto dshift = ring_shift(
            compute_prev, [=, this](int r) { return ranks[r].ws.dring[(t - 1) % 2]; },
            [=, this](int r) { return ranks[r].ws.dring[t % 2]; },
            at + fmt::format("cp_ring_grad{}", t), tags);
        if (t >= 2) link(compute_prev2, dshift);
        grad_arrived = dshift;
      }
      if (t == cp) break;
      if (t > 0) {
        auto shift = ring_shift(
            kv_arrived, [=, this](int r) { return ring_block(r, l, t - 1); },
            [=, this](int r) { return ranks[r].ws.ring[t % 2]; },
            at + fmt::format("cp_ring_kv{}", t), tags);
        if (t >= 2) link(compute_prev2, shift);
        kv_arrived = shift;
      }
      auto step = each(at + "attention_backward_step", tags, [=, this](int r) {
        LayerActivations& A = ranks[r].layers[l];
        BackwardWorkspace& w = ranks[r].ws;
        if (t == 0) w.dring[0].fill(0.f);
        const Tensor block = ring_block(r, l, t), grads = w.dring[t % 2];
        const int me = mesh.coordinates(r).cp, owner = ring_owner(r, t);
        const Tensor d_attn = w.d_attn.reshape({Sc, B, Hl, d});
        for (std::int64_t qc = 0; qc < 2; ++qc)
          for (std::int64_t kc = 0; kc < 2; ++kc) {
            const Tensor keys = block.slice(0, kc * chunk, chunk);
            const Tensor key_grads = grads.slice(0, kc * chunk, chunk);
            // With the full (merged) output and log-sum-exp, each block's probabilities are the
            // final ones, so its gradients are exact parts of the whole.
            ops::attention_backward(
                {.q_offset = context_position(me, qc * chunk),
                 .k_offset = context_position(owner, kc * chunk)},
                head_view(A.qkv.slice(0, qc * chunk, chunk), 0), head_view(keys, 0),
                head_view(keys, 1), A.attn.slice(0, qc * chunk, chunk).transpose(0, 1),
                A.lse.slice(0, qc, 1).reshape({B, Hl, chunk}),
                d_attn.slice(0, qc * chunk, chunk).transpose(0, 1), w.dq_part.transpose(0, 1),
                head_view(key_grads, 0), head_view(key_grads, 1));
            ops::accumulate(w.dq_part, w.d_qkv.slice(0, qc * chunk, chunk).slice(3, 0, d));
          }
      });
      link(kv_arrived, step);
      link(grad_arrived, step);
      compute_prev2 = compute_prev;
      compute_prev = step;
    }
    return grad_arrived;
  }

  // Expert-parallel all-to-all of rows over each expert-parallel group.
  std::vector<TaskId> ep_exchange(const std::vector<TaskId>& producers,
                                  std::function<Tensor(int)> send,
                                  std::function<std::vector<std::int64_t>*(int)> send_rows,
                                  std::function<Tensor(int)> recv,
                                  std::function<std::vector<std::int64_t>*(int)> recv_rows,
                                  std::int64_t expected_rows, const std::string& name,
                                  rt::TaskTags tags) {
    return per_group(GroupKind::expert, producers, [&](const devices::ProcessGroup& g) {
      std::vector<devices::VariableAllToAllBuffers> bufs;
      for (rt::DeviceId dv : g.devices()) {
        const int r = static_cast<int>(dv);
        const Tensor in = send(r), out = recv(r);
        bufs.push_back({{in.data(), static_cast<std::size_t>(in.numel())},
                        send_rows(r),
                        {out.data(), static_cast<std::size_t>(out.numel())},
                        std::span<std::int64_t>(*recv_rows(r)),
                        expected_rows});
      }
      return comm.all_to_all_v(b, g, bufs, h, {.name = name, .tags = tags});
    });
  }

  // Regroups rows that arrived grouped by source (each source's rows by local expert) into rows
  // grouped by local expert, recording where each came from.
  // Reads the per-expert counts from each source's header rows first.
  void regroup_by_expert(MoeSlot& A) {
    const std::int64_t local = m.num_experts / ep(), H = header_rows();
    float* counts = A.counts_recv.data();  // [source][local expert]
    std::vector<std::int64_t> source_begin(static_cast<std::size_t>(ep()) + 1, 0);
    std::int64_t framed_begin = 0;
    for (int j = 0; j < ep(); ++j) {
      std::copy_n(A.arrived.row(framed_begin), local, counts + j * local);
      A.recv_rows[j] = A.framed_recv_rows[j] - H;
      source_begin[j + 1] = source_begin[j] + A.recv_rows[j];
      framed_begin += A.framed_recv_rows[j];
    }
    A.local_begin.assign(static_cast<std::size_t>(local) + 1, 0);
    A.source_row.clear();
    A.arrived_row.clear();
    for (std::int64_t e = 0; e < local; ++e) {
      for (int j = 0; j < ep(); ++j) {
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
      throw std::logic_error(
          fmt::format("expert-parallel regrouping: {} rows arrived, counts say {}",
                      source_begin.back(), A.local_begin.back()));
  }

  MoeSlot& slot(int r, int l, int c) { return ranks[r].layers[l].moe[c]; }

  // Task names of MoE slot c of layer l: "L<l>." or, for an Ampipe chunk, "L<l>.c<c>.".
  std::string slot_prefix(int l, int c) const {
    return fmt::format("L{}.", l) + (ampipe() > 1 ? fmt::format("c{}.", c) : "");
  }

  // The expert-parallel all-to-all of a slot's rows: outbound (to the experts' ranks: the
  // slot's send_rows leave `from`, recv_rows arrive in `into`) or back (the counts reversed).
  std::vector<TaskId> slot_exchange(int l, int c, const std::vector<TaskId>& ready,
                                    Tensor MoeSlot::*from, Tensor MoeSlot::*into, bool outbound,
                                    const std::string& name, rt::TaskTags tags,
                                    bool framed = false) {
    auto rows = [this, l, c, framed](int r, bool sent) {
      MoeSlot& S = slot(r, l, c);
      if (framed) return sent ? &S.framed_send_rows : &S.framed_recv_rows;
      return sent ? &S.send_rows : &S.recv_rows;
    };
    // Balanced routing, for the cost hint: every kept pick of the slot's tokens, plus headers.
    const std::int64_t expected_rows = std::min(T / ampipe() * m.moe_router_topk, slot_capacity()) +
                                       (framed ? ep() * header_rows() : 0);
    return ep_exchange(
        ready, [=, this](int r) { return slot(r, l, c).*from; },
        [=](int r) { return rows(r, outbound); }, [=, this](int r) { return slot(r, l, c).*into; },
        [=](int r) { return rows(r, !outbound); }, expected_rows, slot_prefix(l, c) + name, tags);
  }

  // This rank's tokens of MoE slot c: [n, h] rows of the layer's [S, B, h] activations (its
  // SP shard, its 1/tp slice of a replicated sequence, and within that the Ampipe chunk).
  Tensor slot_tokens(int r, int c, const Tensor& sbh) const {
    const std::int64_t n = T / ampipe();
    return moe_tokens(r, sbh).slice(0, c * n, n);
  }

  // MoE forward in three phases per slot, so Ampipe can interleave slots:
  //   route:   router, dispatch plan, permutation; per-expert counts and the dispatch all-to-all
  //   experts: the local experts; the combine all-to-all
  //   combine: the weighted combine into the slot's output rows
  std::vector<TaskId> moe_route(int l, int c, const std::vector<TaskId>& prev, rt::TaskTags tags) {
    const std::string at = slot_prefix(l, c);
    const std::int64_t E = m.num_experts;
    auto route = each(at + "router", tags, [=, this](int r) {
      MoeSlot& A = slot(r, l, c);
      A.moe_in.copy_from(slot_tokens(r, c, ranks[r].layers[l].ln2));
      const LayerShard& P = ranks[r].shard->layer(l);
      ops::linear_forward(A.moe_in, P.router_weight->value, Tensor{}, A.router_logits);
      const ops::RouterStatistics st = ops::router_forward(
          router_options(), A.router_logits, A.probs, std::span(A.topk_index), A.topk_weight);
      float* p = A.stats.data();
      for (std::int64_t e = 0; e < E; ++e) {
        p[e] = static_cast<float>(st.assignments[e]);
        p[E + e] = static_cast<float>(st.probability[e]);
      }
      p[2 * E] = static_cast<float>(st.squared_lse);
      p[2 * E + 1] = static_cast<float>(st.tokens);
      // Capacity applies per slot (per Ampipe chunk, as MindSpeed does).
      A.dispatch = ops::plan_dispatch(A.topk_index, A.tokens, m.moe_router_topk, E,
                                      {.capacity_factor = m.moe_expert_capacity_factor});
      // Every rank routes different tokens (its SP shard, tp slice, cp chunks, dp batch).
      ranks[r].routed_picks += A.tokens * m.moe_router_topk;
      ranks[r].dropped_picks += A.dispatch.dropped;
      if (ep() == 1) {
        ops::permute_tokens(A.dispatch, A.moe_in, A.grouped.slice(0, 0, A.dispatch.rows()));
        return;
      }
      if (pipe_experts())
        frame_items(A);
      else
        frame_dispatch(A);
    });
    link(prev, route);
    if (ep() == 1) return route;
    if (pipe_experts()) {
      // Every item's dispatch is launched now; the routes are what the statistics wait for.
      auto& dispatched = item_tasks[{l, c}];
      dispatched.clear();
      for (std::size_t i = 0; i < slot(0, l, c).items.size(); ++i)
        dispatched.push_back(item_exchange(l, c, static_cast<int>(i), route, &ExpertItem::send,
                                           &ExpertItem::arrived, true, true, "dispatch", tags));
      return route;
    }
    return slot_exchange(l, c, route, &MoeSlot::grouped, &MoeSlot::arrived, true, "dispatch", tags,
                         /*framed=*/true);
  }

  // --use-pipe-experts: the per-item exchanges of each (layer, slot) between the phases that
  // build them.
  std::map<std::pair<int, int>, std::vector<std::vector<TaskId>>> item_tasks;

  // Lays out each item's rows for its dispatch: for each destination rank, a header row with
  // the count, then the item's slice of the rows for that rank's local expert.
  void frame_items(MoeSlot& A) {
    const std::int64_t local = m.num_experts / ep();
    const std::int64_t slices = plan.pipe_experts_slices();
    const ops::DispatchPlan& D = A.dispatch;
    for (ExpertItem& I : A.items) {
      I.rows.clear();
      std::int64_t at = 0;
      for (int p = 0; p < ep(); ++p) {
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

  // Item i's all-to-all over each expert-parallel group: outbound (to the experts' ranks) or
  // back, framed or not; on its own stream per direction with --pipe-experts-multi-stream.
  std::vector<TaskId> item_exchange(int l, int c, int i, const std::vector<TaskId>& ready,
                                    Tensor ExpertItem::*from, Tensor ExpertItem::*into,
                                    bool outbound, bool framed, const std::string& name,
                                    rt::TaskTags tags) {
    const std::string stream = !plan.pipe_experts_multi_stream ? "comm"
                               : outbound                      ? "ep_dispatch"
                                                               : "ep_combine";
    // Balanced routing, for the cost hint: an item carries 1/(local experts x slices) of the picks.
    const std::int64_t expected_rows =
        T / ampipe() * m.moe_router_topk / (m.num_experts / ep() * plan.pipe_experts_slices()) +
        (framed ? ep() : 0);
    const std::string task = slot_prefix(l, c) + fmt::format("i{}.", i) + name;
    return per_group(GroupKind::expert, ready, [&](const devices::ProcessGroup& g) {
      std::vector<devices::VariableAllToAllBuffers> bufs;
      for (rt::DeviceId dv : g.devices()) {
        ExpertItem& I = slot(static_cast<int>(dv), l, c).items[static_cast<std::size_t>(i)];
        const Tensor in = I.*from, out = I.*into;
        auto* sent = framed ? &I.framed_send_rows : outbound ? &I.send_rows : &I.recv_rows;
        auto* received = framed ? &I.framed_recv_rows : outbound ? &I.recv_rows : &I.send_rows;
        bufs.push_back({{in.data(), static_cast<std::size_t>(in.numel())},
                        sent,
                        {out.data(), static_cast<std::size_t>(out.numel())},
                        std::span<std::int64_t>(*received),
                        expected_rows});
      }
      return comm.all_to_all_v(b, g, bufs, h, {.name = task, .tags = tags, .stream = stream});
    });
  }

  // Lays out a slot's rows for the dispatch all-to-all: for each destination rank, header rows
  // with the row counts of its local experts, then the rows themselves in expert order.
  void frame_dispatch(MoeSlot& A) {
    const std::int64_t local = m.num_experts / ep(), H = header_rows();
    const ops::DispatchPlan& D = A.dispatch;
    std::int64_t at = 0;
    for (int j = 0; j < ep(); ++j) {
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

  std::vector<TaskId> moe_experts(int l, int c, const std::vector<TaskId>& ready,
                                  rt::TaskTags tags) {
    if (pipe_experts()) return moe_experts_items(l, c, ready, tags);
    const std::string at = slot_prefix(l, c);
    auto experts = each(at + "experts", tags, [=, this](int r) {
      MoeSlot& A = slot(r, l, c);
      const LayerShard& P = ranks[r].shard->layer(l);
      if (ep() == 1) {
        const std::int64_t rows = A.dispatch.rows();
        ops::experts_forward(expert_activation(), A.grouped.slice(0, 0, rows),
                             A.dispatch.expert_begin, P.expert_fc1->value, P.expert_fc2->value,
                             A.hidden_pre.slice(0, 0, rows), A.hidden.slice(0, 0, rows),
                             A.expert_out.slice(0, 0, rows));
        return;
      }
      regroup_by_expert(A);
      const auto rows = static_cast<std::int64_t>(A.source_row.size());
      for (std::int64_t i = 0; i < rows; ++i)
        std::copy_n(A.arrived.row(A.arrived_row[i]), h, A.expert_in.row(i));
      ops::experts_forward(expert_activation(), A.expert_in.slice(0, 0, rows), A.local_begin,
                           P.expert_fc1->value, P.expert_fc2->value, A.hidden_pre.slice(0, 0, rows),
                           A.hidden.slice(0, 0, rows), A.expert_result.slice(0, 0, rows));
      for (std::int64_t i = 0; i < rows; ++i)
        std::copy_n(A.expert_result.row(i), h, A.leaving.row(A.source_row[i]));
    });
    link(ready, experts);
    if (ep() == 1) return experts;
    return slot_exchange(l, c, experts, &MoeSlot::leaving, &MoeSlot::expert_out, false, "combine",
                         tags);
  }

  std::vector<TaskId> moe_combine(int l, int c, const std::vector<TaskId>& ready,
                                  rt::TaskTags tags) {
    const std::string at = slot_prefix(l, c);
    auto combine = each(at + "combine", tags, [=, this](int r) {
      MoeSlot& A = slot(r, l, c);
      for (const ExpertItem& I : A.items)  // the items' results back into the slot's rows
        for (std::size_t x = 0; x < I.rows.size(); ++x)
          std::copy_n(I.back.row(static_cast<std::int64_t>(x)), h, A.expert_out.row(I.rows[x]));
      ops::combine_tokens(A.dispatch, A.expert_out.slice(0, 0, A.dispatch.rows()), A.topk_weight,
                          A.moe_out);
    });
    link(ready, combine);
    if (pipe_experts()) {
      for (const auto& returned : item_tasks[{l, c}])
        link(returned, combine);
      item_tasks.erase({l, c});
    }
    return combine;
  }

  // --use-pipe-experts: item by item, the rows of one local expert (slice) run as soon as its
  // dispatch is in, and its combine all-to-all is launched while the next item computes.
  std::vector<TaskId> moe_experts_items(int l, int c, const std::vector<TaskId>& ready,
                                        rt::TaskTags tags) {
    const std::vector<std::vector<TaskId>> dispatched = std::move(item_tasks[{l, c}]);
    auto& returned = item_tasks[{l, c}];
    returned.clear();
    for (std::size_t i = 0; i < dispatched.size(); ++i) {
      auto experts =
          each(slot_prefix(l, c) + fmt::format("i{}.experts", i), tags, [=, this](int r) {
            ExpertItem& I = slot(r, l, c).items[i];
            const LayerShard& P = ranks[r].shard->layer(l);
            std::int64_t at = 0, rows = 0;
            for (int p = 0; p < ep(); ++p) {
              const std::int64_t count = I.framed_recv_rows[p] - 1;
              const auto announced = static_cast<std::int64_t>(I.arrived.row(at)[0]);
              if (announced != count)
                throw std::logic_error(fmt::format(
                    "pipe experts: expert-parallel rank {} announced {} rows and sent {}", p,
                    announced, count));
              I.recv_rows[p] = count;
              for (std::int64_t x = 0; x < count; ++x)
                std::copy_n(I.arrived.row(at + 1 + x), h, I.expert_in.row(rows + x));
              at += 1 + count;
              rows += count;
            }
            const std::array<std::int64_t, 2> begin{0, rows};
            ops::experts_forward(expert_activation(), I.expert_in.slice(0, 0, rows), begin,
                                 P.expert_fc1->value.slice(0, I.expert, 1),
                                 P.expert_fc2->value.slice(0, I.expert, 1),
                                 I.hidden_pre.slice(0, 0, rows), I.hidden.slice(0, 0, rows),
                                 I.expert_result.slice(0, 0, rows));
          });
      link(ready, experts);
      link(dispatched[i], experts);
      returned.push_back(item_exchange(l, c, static_cast<int>(i), experts,
                                       &ExpertItem::expert_result, &ExpertItem::back, false, false,
                                       "combine", tags));
    }
    return ready;
  }

  // The router's losses from the whole micro-batch's statistics: the slots' summed (Ampipe), and
  // over the tensor- and context-parallel ranks that hold parts of the same sequences.
  std::vector<TaskId> moe_statistics(int l, int mb, const std::vector<TaskId>& ready,
                                     rt::TaskTags tags) {
    const std::string at = fmt::format("L{}.", l);
    std::vector<TaskId> summed = ready;
    if (ampipe() > 1) {
      summed = each(at + "router_statistics", tags, [=, this](int r) {
        LayerActivations& A = ranks[r].layers[l];
        A.stats_total.fill(0.f);
        for (const MoeSlot& S : A.moe)
          ops::accumulate(S.stats, A.stats_total);
      });
      link(ready, summed);
    }
    auto reduced = all_reduce_over(
        GroupKind::tensor_context, summed,
        [this, l](int r) { return ranks[r].layers[l].stats_total; }, devices::ReduceOp::sum,
        at + "router_stats", tags);
    auto aux = each(at + "router_losses", tags, [=, this](int r) {
      const ops::RouterStatistics st = unpack_stats(ranks[r].layers[l].stats_total, m.num_experts);
      ranks[r].aux[mb] += ops::aux_loss(router_options(), st) + ops::z_loss(router_options(), st);
    });
    link(reduced, aux);
    link(summed, aux);
    return aux;
  }

  std::vector<TaskId> build_moe_forward(int l, int mb, const std::vector<TaskId>& prev,
                                        rt::TaskTags tags) {
    auto routed = moe_route(l, 0, prev, tags);
    auto stats = moe_statistics(l, mb, routed, tags);
    auto experts = moe_experts(l, 0, routed, tags);
    auto combine = moe_combine(l, 0, experts, tags);
    link(stats, combine);
    if (t_sp > 1 || tp == 1) return combine;
    // Without SP the layer's output is replicated: gather the ranks' slices.
    return tp_all_gather(
        combine, [=, this](int r) { return slot(r, l, 0).moe_out; },
        [=, this](int r) { return ranks[r].layers[l].mlp_out; }, fmt::format("L{}.moe_gather", l),
        tags);
  }

  void build_loss(int mb, const std::vector<TaskId>& prev) {
    const rt::TaskTags tags{.micro_batch = static_cast<std::uint16_t>(mb),
                            .phase = rt::Phase::forward};
    auto fn = each("final_norm", tags, [this](int r) {
      RankState& R = ranks[r];
      ops::layer_norm_forward(R.layers.back().x_out, R.shard->final_ln_weight().value,
                              R.shard->final_ln_bias().value, m.layernorm_epsilon, R.final_ln,
                              R.final_mean, R.final_rstd);
    });
    link(prev, fn);
    std::vector<TaskId> g(ranks.size(), rt::kNoTask);
    if (t_sp > 1)
      g = tp_all_gather(
          fn, [this](int r) { return ranks[r].final_ln; },
          [this](int r) { return ranks[r].final_full; }, "final_gather", tags);
    auto logits = each("logits", tags, [this](int r) {
      RankState& R = ranks[r];
      ops::linear_forward(R.final_full.reshape({Sc * B, h}), R.shard->embedding().value, Tensor{},
                          R.logits);
      ops::cross_entropy_row_max(R.logits, R.row_max);
    });
    link(g, logits);
    auto maxima = tp_all_reduce(
        logits, [this](int r) { return ranks[r].row_max; }, devices::ReduceOp::max, "loss_max",
        tags);
    auto sums = each("loss_partials", tags, [this, mb](int r) {
      RankState& R = ranks[r];
      ops::cross_entropy_partial_sums<float>(R.logits, R.targets,
                                             {R.shard->vocab_start(), m.padded_vocab_size(tp)},
                                             R.row_max, R.partials);
    });
    link(maxima, sums);
    auto reduced = tp_all_reduce(
        sums, [this](int r) { return ranks[r].partials; }, devices::ReduceOp::sum, "loss_sum",
        tags);
    auto loss = each("loss", tags, [this, mb](int r) {
      RankState& R = ranks[r];
      R.loss[mb] = ops::cross_entropy_loss<float>(
          R.row_max, R.partials, R.targets, m.padded_vocab_size(tp), ce_options(), R.lse, Tensor{});
    });
    link(reduced, loss);
  }

  ops::CrossEntropyOptions ce_options() const {
    // The mean over the global batch: micro-batches and data-parallel ranks add up to it.
    return {.ignore_index = -100,
            .denominator = static_cast<double>(S * B * M * plan.data_parallel)};
  }

  // ----------------------------------------------------------------------------- backward

  void build_backward(int mb) {
    const rt::TaskTags tags{.micro_batch = static_cast<std::uint16_t>(mb),
                            .phase = rt::Phase::backward};
    const bool last = mb == M - 1;
    // Loss -> final norm input gradient.
    auto dlogits = each("loss_backward", tags, [this, mb](int r) {
      RankState& R = ranks[r];
      ops::cross_entropy_backward<float>(R.logits, R.targets,
                                         {R.shard->vocab_start(), m.padded_vocab_size(tp)}, R.lse,
                                         ce_options(), 1.0, R.ws.d_logits);
      ops::linear_backward_input(R.ws.d_logits, R.shard->embedding().value,
                                 R.ws.d_final_full.reshape({Sc * B, h}));
    });
    auto reduce = reduce_partial(
        dlogits, [this](int r) { return ranks[r].ws.d_final_full; },
        [this](int r) { return t_sp > 1 ? ranks[r].ws.d_norm : ranks[r].ws.d_final_full; },
        "final_grad_reduce", tags);
    // The output layer's weight gradient overlaps the reduction above.
    each("logits_weight_grad", tags, [this](int r) {
      RankState& R = ranks[r];
      ops::linear_backward_weight(R.final_full.reshape({Sc * B, h}), R.ws.d_logits,
                                  R.shard->embedding().grad, Tensor{});
    });
    auto fn = each("final_norm_backward", tags, [this](int r) {
      RankState& R = ranks[r];
      const Tensor d_in = t_sp > 1 ? R.ws.d_norm : R.ws.d_final_full;
      ops::layer_norm_backward(R.layers.back().x_out, R.shard->final_ln_weight().value,
                               R.final_mean, R.final_rstd, d_in, R.ws.d_x,
                               R.shard->final_ln_weight().grad, R.shard->final_ln_bias().grad);
    });
    link(reduce, fn);
    std::vector<TaskId> prev = fn;
    if (last) reduce_buckets("final_norm", prev);
    for (int l = m.num_layers - 1; l >= 0; --l)
      prev = build_layer_backward(l, mb, prev, last);
    // Embedding.
    auto pos = each("positions_backward", tags, [this, mb](int r) {
      RankState& R = ranks[r];
      apply_dropout(true, r, mb, m.num_layers, 2, R.ws.d_x, R.ws.d_x);
      for (std::int64_t s = 0; s < Sl; ++s)
        for (std::int64_t bi = 0; bi < B; ++bi) {
          const float* g = R.ws.d_x.data() + (s * B + bi) * h;
          float* p = R.shard->positions().grad.row(position(r, s));
          for (std::int64_t c = 0; c < h; ++c)
            p[c] += g[c];
        }
    });
    link(prev, pos);
    std::vector<TaskId> g(ranks.size(), rt::kNoTask);
    if (t_sp > 1)
      g = tp_all_gather(
          pos, [this](int r) { return ranks[r].ws.d_x; },
          [this](int r) { return ranks[r].ws.d_norm_full; }, "embedding_grad_gather", tags);
    auto emb = each("embedding_backward", tags, [this, mb](int r) {
      RankState& R = ranks[r];
      const Tensor d = t_sp > 1 ? R.ws.d_norm_full : R.ws.d_x;
      ops::embedding_backward<float>(R.tokens, d, {R.shard->vocab_start(), m.padded_vocab_size(tp)},
                                     R.shard->embedding().grad);
    });
    link(g, emb);
    if (last) reduce_buckets("embedding", emb);
  }

  std::vector<TaskId> build_layer_backward(int l, int mb, std::vector<TaskId> prev, bool last) {
    if (ampipe() > 1 && ranks[0].shard->layer(l).moe)
      return build_ampipe_layer_backward(l, mb, prev, last);
    rt::TaskTags tags{.layer = static_cast<std::uint16_t>(l),
                      .micro_batch = static_cast<std::uint16_t>(mb),
                      .phase = rt::Phase::backward};
    auto L = [this, l](int r) -> LayerActivations& { return ranks[r].layers[l]; };
    auto P = [this, l](int r) -> const LayerShard& { return ranks[r].shard->layer(l); };
    auto W = [this](int r) -> BackwardWorkspace& { return ranks[r].ws; };
    const std::string at = fmt::format("L{}.", l);
    const bool moe = ranks[0].shard->layer(l).moe;
    // d_x (the layer output's gradient) -> d_mlp; d_x_mid starts as d_x (the residual).
    auto res2 = each(at + "mlp_residual_backward", tags, [=, this](int r) {
      BackwardWorkspace& w = W(r);
      w.d_x_mid.copy_from(w.d_x);
      if (moe) {
        apply_dropout(true, r, mb, l, 1, w.d_x, w.d_mlp);
      } else {
        bias_dropout_add_backward(r, mb, l, 1, w.d_x, w.d_mlp, P(r).fc2_bias->grad);
      }
    });
    link(prev, res2);
    std::vector<TaskId> norm_grad_ready;
    if (moe) {
      norm_grad_ready = build_moe_backward(l, mb, res2, tags);
    } else {
      std::vector<TaskId> g(ranks.size(), rt::kNoTask);
      if (t_sp > 1)
        g = tp_all_gather(
            res2, [=](int r) { return W(r).d_mlp; }, [=](int r) { return W(r).d_mlp_full; },
            at + "mlp_grad_gather", tags);
      auto mlp = each(at + "mlp_backward", tags, [=, this](int r) {
        LayerActivations& A = L(r);
        BackwardWorkspace& w = W(r);
        ops::linear_backward_input(w.d_mlp_full, P(r).fc2_weight->value, w.d_act);
        ops::linear_backward_weight(A.act, w.d_mlp_full, P(r).fc2_weight->grad, Tensor{});
        activation_backward(A.fc1, w.d_act, w.d_fc1);
        ops::linear_backward_input(w.d_fc1, P(r).fc1_weight->value, w.d_norm_full);
      });
      link(g, mlp);
      auto red = reduce_partial(
          mlp, [=](int r) { return W(r).d_norm_full; }, [=](int r) { return W(r).d_norm; },
          at + "mlp_grad_reduce", tags);
      // fc1's weight gradient overlaps the reduction of its input gradient.
      auto wg = each(at + "mlp_weight_grad", tags, [=, this](int r) {
        ops::linear_backward_weight(L(r).ln2_full, W(r).d_fc1, P(r).fc1_weight->grad,
                                    P(r).fc1_bias->grad);
      });
      norm_grad_ready = red;
      for (std::size_t r = 0; r < red.size(); ++r)
        if (red[r] == rt::kNoTask) norm_grad_ready[r] = wg[r];
    }
    auto ln2 = each(at + "mlp_norm_backward", tags, [=, this](int r) {
      LayerActivations& A = L(r);
      BackwardWorkspace& w = W(r);
      ops::layer_norm_backward(A.x_mid, P(r).ln2_weight->value, A.ln2_mean, A.ln2_rstd, w.d_norm,
                               w.d_tmp, P(r).ln2_weight->grad, P(r).ln2_bias->grad);
      ops::accumulate(w.d_tmp, w.d_x_mid);
      // Attention half: d_x_mid -> d_proj_out (in d_mlp), and the residual's d_x.
      w.d_x.copy_from(w.d_x_mid);
      bias_dropout_add_backward(r, mb, l, 0, w.d_x_mid, w.d_mlp, P(r).proj_bias->grad);
    });
    link(norm_grad_ready, ln2);
    if (last) reduce_buckets(fmt::format("layers.{}.mlp", l), ln2);
    std::vector<TaskId> g(ranks.size(), rt::kNoTask);
    if (t_sp > 1)
      g = tp_all_gather(
          ln2, [=](int r) { return W(r).d_mlp; }, [=](int r) { return W(r).d_mlp_full; },
          at + "attention_grad_gather", tags);
    auto attn = each(at + "attention_backward", tags, [=, this](int r) {
      LayerActivations& A = L(r);
      BackwardWorkspace& w = W(r);
      const Tensor d_proj = t_sp > 1 ? w.d_mlp_full : w.d_mlp;
      ops::linear_backward_input(d_proj, P(r).proj_weight->value, w.d_attn);
      ops::linear_backward_weight(A.attn.reshape({Sc, B, Hl * d}), d_proj, P(r).proj_weight->grad,
                                  Tensor{});
      w.d_qkv.fill(0.f);  // attention accumulates dk and dv
      if (cp == 1)
        ops::attention_backward({}, head_view(A.qkv, 0), head_view(A.qkv, 1), head_view(A.qkv, 2),
                                A.attn.transpose(0, 1), A.lse.reshape({B, Hl, Sc}),
                                w.d_attn.reshape({Sc, B, Hl, d}).transpose(0, 1),
                                head_view(w.d_qkv, 0), head_view(w.d_qkv, 1),
                                head_view(w.d_qkv, 2));
    });
    link(g, attn);
    std::vector<TaskId> dkv_ready = attn;
    if (cp > 1) dkv_ready = build_ring_attention_backward(l, attn, tags);
    return build_attention_input_backward(l, dkv_ready, last, tags);
  }

  // MoE backward in three phases per slot, mirroring the forward (Ampipe runs them for the
  // slots in reverse):
  //   combine:  the combine's backward; the gradient rows go back to the experts' ranks
  //   experts:  the experts' backward; the input gradient rows come home
  //   router:   un-permutation, the router's backward; the slot's input gradient rows
  std::vector<TaskId> moe_combine_backward(int l, int c, const std::vector<TaskId>& prev,
                                           rt::TaskTags tags) {
    const std::string at = slot_prefix(l, c);
    auto combine = each(at + "combine_backward", tags, [=, this](int r) {
      MoeSlot& A = slot(r, l, c);
      // This slot's tokens' output gradient.
      A.d_moe.copy_from(slot_tokens(r, c, ranks[r].ws.d_mlp));
      const std::int64_t rows = A.dispatch.rows();
      ops::combine_tokens_backward(A.dispatch, A.expert_out.slice(0, 0, rows), A.topk_weight,
                                   A.d_moe, A.d_expert_out.slice(0, 0, rows), A.d_topk);
      for (ExpertItem& I : A.items)  // each item's rows, by destination
        for (std::size_t x = 0; x < I.rows.size(); ++x)
          std::copy_n(A.d_expert_out.row(I.rows[x]), h, I.d_back.row(static_cast<std::int64_t>(x)));
    });
    link(prev, combine);
    if (ep() == 1) return combine;
    if (pipe_experts()) {
      auto& sent = item_tasks[{l, c}];
      sent.clear();
      for (std::size_t i = 0; i < slot(0, l, c).items.size(); ++i)
        sent.push_back(item_exchange(l, c, static_cast<int>(i), combine, &ExpertItem::d_back,
                                     &ExpertItem::d_arrived, true, false, "combine_backward",
                                     tags));
      return combine;
    }
    return slot_exchange(l, c, combine, &MoeSlot::d_expert_out, &MoeSlot::d_arrived, true,
                         "combine_backward", tags);
  }

  std::vector<TaskId> moe_experts_backward(int l, int c, const std::vector<TaskId>& ready,
                                           rt::TaskTags tags) {
    if (pipe_experts()) return moe_experts_backward_items(l, c, ready, tags);
    const std::string at = slot_prefix(l, c);
    auto experts = each(at + "experts_backward", tags, [=, this](int r) {
      MoeSlot& A = slot(r, l, c);
      const LayerShard& P = ranks[r].shard->layer(l);
      if (ep() == 1) {
        const std::int64_t rows = A.dispatch.rows();
        ops::experts_backward(expert_activation(), A.grouped.slice(0, 0, rows),
                              A.dispatch.expert_begin, P.expert_fc1->value, P.expert_fc2->value,
                              A.hidden_pre.slice(0, 0, rows), A.hidden.slice(0, 0, rows),
                              A.d_expert_out.slice(0, 0, rows), A.d_grouped.slice(0, 0, rows),
                              P.expert_fc1->grad, P.expert_fc2->grad);
        return;
      }
      const auto rows = static_cast<std::int64_t>(A.source_row.size());
      for (std::int64_t i = 0; i < rows; ++i)
        std::copy_n(A.d_arrived.row(A.source_row[i]), h, A.d_expert_result.row(i));
      ops::experts_backward(expert_activation(), A.expert_in.slice(0, 0, rows), A.local_begin,
                            P.expert_fc1->value, P.expert_fc2->value,
                            A.hidden_pre.slice(0, 0, rows), A.hidden.slice(0, 0, rows),
                            A.d_expert_result.slice(0, 0, rows), A.d_expert_in.slice(0, 0, rows),
                            P.expert_fc1->grad, P.expert_fc2->grad);
      for (std::int64_t i = 0; i < rows; ++i)
        std::copy_n(A.d_expert_in.row(i), h, A.d_leaving.row(A.source_row[i]));
    });
    link(ready, experts);
    if (ep() == 1) return experts;
    return slot_exchange(l, c, experts, &MoeSlot::d_leaving, &MoeSlot::d_grouped, false,
                         "dispatch_backward", tags);
  }

  std::vector<TaskId> moe_experts_backward_items(int l, int c, const std::vector<TaskId>& ready,
                                                 rt::TaskTags tags) {
    const std::vector<std::vector<TaskId>> arrived = std::move(item_tasks[{l, c}]);
    auto& home = item_tasks[{l, c}];
    home.clear();
    for (std::size_t i = 0; i < arrived.size(); ++i) {
      auto experts =
          each(slot_prefix(l, c) + fmt::format("i{}.experts_backward", i), tags, [=, this](int r) {
            ExpertItem& I = slot(r, l, c).items[i];
            const LayerShard& P = ranks[r].shard->layer(l);
            std::int64_t rows = 0;
            for (int p = 0; p < ep(); ++p)
              rows += I.recv_rows[p];
            const std::array<std::int64_t, 2> begin{0, rows};
            ops::experts_backward(expert_activation(), I.expert_in.slice(0, 0, rows), begin,
                                  P.expert_fc1->value.slice(0, I.expert, 1),
                                  P.expert_fc2->value.slice(0, I.expert, 1),
                                  I.hidden_pre.slice(0, 0, rows), I.hidden.slice(0, 0, rows),
                                  I.d_arrived.slice(0, 0, rows), I.d_expert_in.slice(0, 0, rows),
                                  P.expert_fc1->grad.slice(0, I.expert, 1),
                                  P.expert_fc2->grad.slice(0, I.expert, 1));
          });
      link(ready, experts);
      link(arrived[i], experts);
      home.push_back(item_exchange(l, c, static_cast<int>(i), experts, &ExpertItem::d_expert_in,
                                   &ExpertItem::d_home, false, false, "dispatch_backward", tags));
    }
    return ready;
  }

  // Leaves the slot's input gradient in its d_moe_in.
  std::vector<TaskId> moe_router_backward(int l, int c, const std::vector<TaskId>& ready,
                                          rt::TaskTags tags) {
    const std::string at = slot_prefix(l, c);
    auto router = each(at + "router_backward", tags, [=, this](int r) {
      MoeSlot& A = slot(r, l, c);
      const LayerShard& P = ranks[r].shard->layer(l);
      for (const ExpertItem& I : A.items)  // each item's input gradients into the slot's rows
        for (std::size_t x = 0; x < I.rows.size(); ++x)
          std::copy_n(I.d_home.row(static_cast<std::int64_t>(x)), h, A.d_grouped.row(I.rows[x]));
      ops::permute_tokens_backward(A.dispatch, A.d_grouped.slice(0, 0, A.dispatch.rows()),
                                   A.d_moe_in);
      const ops::RouterStatistics st = unpack_stats(ranks[r].layers[l].stats_total, m.num_experts);
      const double scale = 1.0 / (M * plan.data_parallel);
      ops::router_backward<float>(router_options(), A.router_logits, A.probs, A.topk_index,
                                  A.topk_weight, A.d_topk, st, scale, A.d_router_logits);
      ops::linear_backward_weight(A.moe_in, A.d_router_logits, P.router_weight->grad, Tensor{});
      // d_moe_in += d_logits W_router (d_moe is free again and holds the product).
      ops::linear_backward_input(A.d_router_logits, P.router_weight->value, A.d_moe);
      ops::accumulate(A.d_moe, A.d_moe_in);
    });
    link(ready, router);
    if (pipe_experts()) {
      for (const auto& home : item_tasks[{l, c}])
        link(home, router);
      item_tasks.erase({l, c});
    }
    return router;
  }

  std::vector<TaskId> build_moe_backward(int l, int mb, const std::vector<TaskId>& prev,
                                         rt::TaskTags tags) {
    (void)mb;
    auto back = moe_experts_backward(l, 0, moe_combine_backward(l, 0, prev, tags), tags);
    auto router = moe_router_backward(l, 0, back, tags);
    auto W = [this](int r) -> BackwardWorkspace& { return ranks[r].ws; };
    auto place = each(fmt::format("L{}.moe_input_grad", l), tags, [=, this](int r) {
      if (t_sp > 1 || tp == 1) W(r).d_norm.reshape({T, h}).copy_from(slot(r, l, 0).d_moe_in);
    });
    link(router, place);
    if (t_sp > 1 || tp == 1) return place;
    // Replicated layout: every rank needs the whole sequence's input gradient.
    return tp_all_gather(
        router, [=, this](int r) { return slot(r, l, 0).d_moe_in; },
        [=](int r) { return W(r).d_norm; }, fmt::format("L{}.moe_grad_gather", l), tags);
  }

  // ------------------------------------------------------------- gradients and the optimizer

  // After the last micro-batch's backward has filled the buckets of `point` (a layer half, the
  // final norm, the embeddings): one all-reduce per bucket — SP partials over tp first, then
  // over the data-parallel replicas (experts: over their expert-data-parallel replicas). Runs on
  // its own "grad_comm" stream, so the tensor-parallel collectives of the layers below never
  // queue behind it.
  void reduce_buckets(const std::string& point, const std::vector<TaskId>& after) {
    const rt::TaskTags tags{.phase = rt::Phase::backward};
    const auto& buckets = ranks[0].shard->buckets();
    for (std::size_t i = 0; i < buckets.size(); ++i) {
      const GradientBucket& b0 = buckets[i];
      if (b0.name.rfind(point + "/", 0) != 0) continue;
      auto grads = [this, i](int r) { return ranks[r].shard->buckets()[i].grads; };
      std::vector<TaskId> ready = after;
      auto reduce = [&](GroupKind kind, const std::string& suffix) {
        auto ids = all_reduce_over(kind, ready, grads, devices::ReduceOp::sum, b0.name + suffix,
                                   tags, true);
        for (std::size_t r = 0; r < ids.size(); ++r)
          if (ids[r] != rt::kNoTask) ready[r] = ids[r];
      };
      if (b0.reduction == GradientReduction::tensor_partial) reduce(GroupKind::tensor, ".tp");
      const GroupKind replicas = b0.expert ? GroupKind::expert_data : GroupKind::data_context;
      if (!b0.sharded) {
        reduce(replicas, ".dp");
        continue;
      }
      // Distributed optimizer: each replica receives only its shard, reduced.
      per_group(
          replicas, ready,
          [&](const devices::ProcessGroup& g) {
            std::vector<std::span<const float>> in;
            std::vector<std::span<float>> out;
            for (rt::DeviceId dv : g.devices()) {
              const GradientBucket& bk = ranks[dv].shard->buckets()[i];
              in.emplace_back(bk.grads.data(), static_cast<std::size_t>(bk.grads.numel()));
              out.emplace_back(bk.grads.data() + bk.shard_begin,
                               static_cast<std::size_t>(bk.shard_size));
            }
            return comm.reduce_scatter(
                b, g, in, out, devices::ReduceOp::sum,
                {.name = b0.name + ".dp", .tags = tags, .stream = "grad_comm"});
          },
          true);
    }
  }

  void build_optimizer() {
    const rt::TaskTags tags{.phase = rt::Phase::weight};
    auto norm = each("grad_norm", tags, [this](int r) {
      // Each distinct gradient element once: tensor-parallel copies on tp rank 0 only, data-
      // parallel copies on the replica that owns the element (its shard, or replica 0).
      const bool tp_first = mesh.coordinates(r).tp == 0;
      double sum = 0;
      for (const GradientBucket& bucket : ranks[r].shard->buckets()) {
        if (!bucket.sharded && bucket.replica != 0) continue;
        const std::int64_t lo = bucket.shard_begin, hi = lo + bucket.shard_size;
        std::int64_t at = 0;
        for (const Parameter* p : bucket.params) {
          const std::int64_t n = p->grad.numel();
          const std::int64_t from = std::max(at, lo), to = std::min(at + n, hi);
          if (from < to && (!p->tensor_replicated || tp_first)) {
            const float* g = bucket.grads.data();
            for (std::int64_t e = from; e < to; ++e)
              sum += static_cast<double>(g[e]) * g[e];
          }
          at += n;
        }
      }
      ranks[r].norm_sq.data()[0] = static_cast<float>(sum);
    });
    // Everything the comm streams reduced must be in before the norm is taken.
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      if (last_comm[r] != rt::kNoTask) b.precede(last_comm[r], norm[r]);
      if (last_grad[r] != rt::kNoTask) b.precede(last_grad[r], norm[r]);
    }
    std::vector<TaskId> summed(ranks.size(), rt::kNoTask);
    if (ranks.size() > 1) {
      std::vector<rt::DeviceId> all(ranks.size());
      std::iota(all.begin(), all.end(), 0u);
      const devices::ProcessGroup world("world", all);
      std::vector<std::span<float>> bufs;
      for (auto& R : ranks)
        bufs.push_back(all_of(R.norm_sq));
      summed = comm.all_reduce(b, world, bufs, devices::ReduceOp::sum,
                               {.name = "grad_norm_sum", .tags = tags});
      link(norm, summed);
    }
    auto step = each("optimizer", tags, [this](int r) {
      if (!update) return;
      const double norm = std::sqrt(static_cast<double>(ranks[r].norm_sq.data()[0]));
      const double coef = opt.clip_grad > 0 ? ops::clip_coefficient(norm, opt.clip_grad) : 1.0;
      ops::AdamWOptions o = opt.adamw;
      o.lr = learning_rate;
      for (GradientBucket& bucket : ranks[r].shard->buckets()) {
        // The elements this device updates: its shard, or the whole bucket.
        const Tensor grads = bucket.grads.slice(0, bucket.shard_begin, bucket.shard_size);
        if (coef < 1.0) {
          float* g = grads.data();
          for (std::int64_t i = 0; i < grads.numel(); ++i)
            g[i] *= static_cast<float>(coef);
        }
        ops::adamw_step(o, iteration, bucket.values.slice(0, bucket.shard_begin, bucket.shard_size),
                        grads, bucket.exp_avg, bucket.exp_avg_sq);
      }
    });
    link(summed, step);
    // Distributed optimizer: each replica updated its shard; gather the whole values back.
    if (!plan.distributed_optimizer) return;
    const auto& buckets = ranks[0].shard->buckets();
    for (std::size_t i = 0; i < buckets.size(); ++i) {
      if (!buckets[i].sharded) continue;
      per_group(buckets[i].expert ? GroupKind::expert_data : GroupKind::data_context, step,
                [&](const devices::ProcessGroup& g) {
                  std::vector<std::span<const float>> in;
                  std::vector<std::span<float>> out;
                  for (rt::DeviceId dv : g.devices()) {
                    const GradientBucket& bk = ranks[dv].shard->buckets()[i];
                    in.emplace_back(bk.values.data() + bk.shard_begin,
                                    static_cast<std::size_t>(bk.shard_size));
                    out.push_back(all_of(bk.values));
                  }
                  return comm.all_gather(b, g, in, out,
                                         {.name = buckets[i].name + ".gather", .tags = tags});
                });
    }
  }

  void build() {
    const rt::TaskTags tags{};
    each("zero_grads", tags, [this](int r) {
      ranks[r].shard->zero_grads();
      std::fill(ranks[r].loss.begin(), ranks[r].loss.end(), 0.0);
      std::fill(ranks[r].aux.begin(), ranks[r].aux.end(), 0.0);
      ranks[r].routed_picks = ranks[r].dropped_picks = 0;
    });
    for (int mb = 0; mb < M; ++mb) {
      build_forward(mb);
      build_backward(mb);
    }
    build_optimizer();
    graph = b.build();
  }

  StepResult result() const {
    StepResult out;
    for (int r = 0; r < mesh.size(); ++r) {
      out.routed_picks += ranks[r].routed_picks;
      out.dropped_picks += ranks[r].dropped_picks;
      const MeshCoordinates at = mesh.coordinates(r);
      if (at.tp != 0) continue;  // tensor-parallel ranks hold the same losses
      for (int mb = 0; mb < M; ++mb) {
        out.loss += ranks[r].loss[mb];  // context-parallel ranks hold different tokens' losses
        // The MoE losses are statistics of whole micro-batches, the same on every cp rank.
        if (at.cp == 0) out.aux_loss += ranks[r].aux[mb] / (M * plan.data_parallel);
      }
    }
    out.grad_norm = std::sqrt(static_cast<double>(ranks[0].norm_sq.data()[0]));
    return out;
  }
};

TrainingStep::TrainingStep(const ModelConfig& model, const ParallelPlan& plan,
                           const OptimizerConfig& optimizer, devices::DeviceSet& devices,
                           devices::Communicator& comm)
    : impl_(std::make_unique<Impl>(model, plan, optimizer, devices, comm)) {}
TrainingStep::~TrainingStep() = default;
const rt::Graph& TrainingStep::graph() const {
  return impl_->graph;
}
const Mesh& TrainingStep::mesh() const {
  return impl_->mesh;
}
MicroBatch& TrainingStep::micro_batch(int dp, int m) {
  return impl_->batches.at(static_cast<std::size_t>(dp)).at(static_cast<std::size_t>(m));
}
void TrainingStep::prepare(std::int64_t iteration, double learning_rate) {
  if (iteration < 1) throw std::invalid_argument("iterations count from 1");
  impl_->iteration = iteration;
  impl_->learning_rate = learning_rate;
}
StepResult TrainingStep::result() const {
  return impl_->result();
}
ModelShard& TrainingStep::shard(int rank) {
  return *impl_->ranks.at(static_cast<std::size_t>(rank)).shard;
}
void TrainingStep::set_update_parameters(bool update) {
  impl_->update = update;
}

}  // namespace weave::graphs
