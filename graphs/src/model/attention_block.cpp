#include "model/attention_block.hpp"

#include <algorithm>

#include "model/half_norm.hpp"
#include "model/half_precision.hpp"
#include "model/norm.hpp"
#include "model/recomputed_norm.hpp"

#include "model/ring_attention.hpp"
#include "model/sequence_parallel.hpp"
#include "model/tp_comm_overlap.hpp"
#include "step/gradient_buckets.hpp"
#include "step/step_costs.hpp"
#include "step/working_set.hpp"
#include "weave/ops/attention.hpp"
#include "weave/ops/elementwise.hpp"
#include "weave/ops/linear.hpp"
#include "weave/ops/normalization.hpp"
#include "weave/ops/rotary.hpp"

namespace weave::graphs {

namespace {

// Rotary embeddings of the queries and the key of every group, in place; the values pass
// unchanged. `backward` rotates a gradient back.
void rotate_queries_and_keys(const ModelConfig& m, const Tensor& qkv,
                             std::span<const std::int64_t> positions, bool backward) {
  const std::int64_t d = m.head_dim(), qpg = qkv.dim(3) / d - 2;
  const ops::RotarySpec spec{.head_dim = d, .rotary_dims = m.rotary_dims(), .base = m.rotary_base};
  const Tensor rotated = qkv.slice(3, 0, (qpg + 1) * d);
  if (backward)
    ops::rotary_backward<float>(spec, rotated, positions);
  else
    ops::rotary_forward<float>(spec, rotated, positions);
}

// A bf16 run's QKV product: bf16 from the norm's bf16 output; the query/key stages (the
// --qk-layernorm norms, on the heads' widened values, as the other norms compute) and RoPE in
// fp32 on the widened queries and keys, rounded back once.
void project_qkv_bf16(const LayerSpec& spec, const ModelConfig& m, const AttentionParameters& W,
                      const ops::Bf16Tensor& x, const ops::Bf16Tensor& qkv16, const Tensor& qkv32,
                      std::span<const std::int64_t> positions,
                      const std::vector<StageState>& state) {
  half_linear_forward(m.precision, x, W.qkv_weight->value16, value16_of(W.qkv_bias),
                      qkv16.reshape(x.shape().with(-1, qkv16.numel() / x.rows())));
  if (m.position_embedding != PositionEmbedding::rope && spec.query_key.empty()) return;
  widen_to_fp32(m.precision, qkv16, qkv32);
  for (std::size_t i = 0; i < spec.query_key.size(); ++i)
    spec.query_key[i]->forward(m, W.query_key[i], qkv32, state[i]);
  if (m.position_embedding == PositionEmbedding::rope)
    rotate_queries_and_keys(m, qkv32, positions, false);
  round_to_half(m.precision, qkv32, qkv16);
}

// Whether layer l is the first of a model chunk after the first: its input came from another
// stage (or chunk) as bf16 values.
bool takes_stage_input(const PipelineLayout& layout, int l) {
  return l > 0 && std::binary_search(layout.chunk_begin.begin(), layout.chunk_begin.end() - 1, l);
}

}  // namespace

std::vector<StageState> allocate_query_key_stages(
    const LayerSpec& spec, const std::function<Tensor(const ops::Shape&)>& allocate,
    const QkvRows& at) {
  std::vector<StageState> state;
  for (const QueryKeyStage* stage : spec.query_key)
    state.push_back(stage->allocate(allocate, at));
  return state;
}

rt::CostHint query_key_stages_cost(const LayerSpec& spec, const StepShape& z, bool backward) {
  rt::CostHint total;
  for (const QueryKeyStage* stage : spec.query_key)
    total = total + stage->cost(z, backward);
  return total;
}

AttentionDecodeState allocate_attention_decoding(
    const LayerSpec& spec, const std::function<Tensor(const ops::Shape&)>& allocate,
    std::int64_t Gl, std::int64_t qpg, std::int64_t d) {
  return {.query_key = allocate_query_key_stages(
              spec, allocate, {.rows = 1, .groups = Gl, .queries_per_group = qpg, .head_dim = d})};
}

std::vector<std::int64_t> context_positions(const RankProgram& rank) {
  const StepShape& z = rank.shape;
  std::vector<std::int64_t> positions(static_cast<std::size_t>(z.Sc));
  for (std::int64_t s = 0; s < z.Sc; ++s)
    positions[static_cast<std::size_t>(s)] = z.context_position(rank.at.cp, s);
  return positions;
}

void project_qkv(const LayerSpec& spec, const ModelConfig& m, const AttentionParameters& W,
                 const Tensor& x, const Tensor& qkv, std::span<const std::int64_t> positions,
                 const std::vector<StageState>& state) {
  ops::linear_forward(x, W.qkv_weight->value, value_of(W.qkv_bias),
                      qkv.reshape(x.shape().with(-1, qkv.numel() / x.rows())));
  for (std::size_t i = 0; i < spec.query_key.size(); ++i)
    spec.query_key[i]->forward(m, W.query_key[i], qkv, state[i]);
  if (m.position_embedding == PositionEmbedding::rope)
    rotate_queries_and_keys(m, qkv, positions, false);
}

void project_qkv_backward(const LayerSpec& spec, const ModelConfig& m, const AttentionParameters& W,
                          const Tensor& d_qkv, std::span<const std::int64_t> positions,
                          const std::vector<StageState>& state) {
  if (m.position_embedding == PositionEmbedding::rope)
    rotate_queries_and_keys(m, d_qkv, positions, true);
  for (std::size_t i = spec.query_key.size(); i-- > 0;)
    spec.query_key[i]->backward(m, W.query_key[i], d_qkv, state[i]);
}

ops::AttentionDropout attention_dropout(const RankProgram& rank, int layer, int mb) {
  const StepShape& z = rank.shape;
  const ModelConfig& m = z.model;
  if (m.attention_dropout <= 0) return {};
  // Keyed like the hidden dropout, on a site of its own (0, 1: the residuals; 2: the input).
  return {.probability = m.attention_dropout,
          .key = rank.dropout_key(layer, 3),
          .sequence_length = z.S,
          .batch_offset = rank.batch_offset(mb),
          .head_offset = static_cast<std::int64_t>(rank.at.tp) * z.Hl};
}

void AttentionBlock::declare_parameters(ParameterDeclarer& declare, const LayerSpec& spec,
                                        int layer, AttentionParameters& L) {
  const ModelConfig& m = declare.model;
  const std::int64_t h = m.hidden_size, d = m.head_dim(), heads = m.num_attention_heads;
  const std::int64_t t = declare.at.tp, heads_local = heads / declare.tp;
  // Grouped-query attention: each tp rank holds whole key/value groups with their query heads.
  const std::int64_t groups = m.query_groups(), groups_local = groups / declare.tp;
  const std::int64_t per_group = heads / groups;
  const std::string prefix = fmt::format("layers.{}.", layer);
  L.ln1_weight = declare.norm(prefix + "input_norm.weight", 1);
  if (spec.norm == Normalization::layer_norm)
    L.ln1_bias = declare.norm(prefix + "input_norm.bias", 0);
  // QKV: local rows (group, which, dim) for this rank's key/value groups, which running over the
  // group's query heads, then its key, then its value (one query head per group without
  // grouped-query attention); logical rows: every query head, then every key, then every value
  // head, d rows each.
  RowMap qkv_rows;
  for (std::int64_t gl = 0; gl < groups_local; ++gl) {
    const std::int64_t g = t * groups_local + gl;
    for (std::int64_t which = 0; which < per_group + 2; ++which) {
      const std::int64_t first = which < per_group ? (g * per_group + which) * d
                                                   : (heads + (which - per_group) * groups + g) * d;
      qkv_rows.append(first, d);
    }
  }
  const std::int64_t qkv_local = (heads_local + 2 * groups_local) * d;
  const std::int64_t qkv_logical = (heads + 2 * groups) * d;
  L.qkv_weight = &declare.add(prefix + "attention.qkv.weight", {qkv_local, h}, qkv_logical, h,
                              qkv_rows, 0, declare.std, 0);
  if (m.add_bias_linear)
    L.qkv_bias =
        &declare.add(prefix + "attention.qkv.bias", {qkv_local}, qkv_logical, 1, qkv_rows, 0, 0, 0);
  for (const QueryKeyStage* stage : spec.query_key)
    L.query_key.push_back(stage->declare_parameters(declare, spec, prefix + "attention."));
  // [h, heads d]: the context (every head's values side by side, Megatron-Core's
  // query_projection_size wide) back to h, split over tp by its columns, whole heads each.
  L.proj_weight = &declare.add(prefix + "attention.proj.weight", {h, heads_local * d}, h, heads * d,
                               RowMap::range(0, h), t * heads_local * d, declare.out_std, 0);
  if (m.add_bias_linear)
    L.proj_bias = &declare.replicated(
        declare.add(prefix + "attention.proj.bias", {h}, h, 1, RowMap::range(0, h), 0, 0, 0),
        declare.mesh.plan().sequence_parallel);
}

void AttentionBlock::allocate(LayerActivations& A) const {
  const StepShape& z = P->shape;
  const std::int64_t Sl = z.Sl, Sc = z.Sc, B = z.B, h = z.h, Hl = z.Hl, d = z.d, cp = z.cp;
  const bool ampipe = z.spec(l).mlp == MlpModule::ampipe;
  const bool ring = z.spec(l).attention == AttentionCore::ring;
  // Recomputed (--recompute-modules layernorm), the norm's output (its gather under SP) and
  // statistics are the rank's working set.
  const bool again = z.model.recompute.recomputes(kRecomputeLayerNorm);
  RecomputedNorm& shared = P->state.recomputed_input_norm;
  A.attention.ln1_mean =
      kept_or_shared(again, shared.mean, [&] { return P->activation32({Sl * B}); });
  A.attention.ln1_rstd =
      kept_or_shared(again, shared.rstd, [&] { return P->activation32({Sl * B}); });
  if (P->half()) {
    A.attention.ln1_16 = kept_or_shared(again, shared.out16, [&] {
      return P->activation16({Sc, B, h});
    });
    A.attention.qkv16 = P->activation16({Sc, B, z.Gl, z.qkv_group_width()});
    A.attention.attn16 = P->activation16({Sc, B, Hl, d});
  } else {
    A.attention.ln1 = kept_or_shared(again, shared.out, [&] { return P->activation({Sl, B, h}); });
    A.attention.ln1_full = z.sp() ? kept_or_shared(again, shared.full,
                                                   [&] {
                                                     return P->activation({Sc, B, h});
                                                   })
                                  : A.attention.ln1;
    A.attention.qkv = P->activation({Sc, B, z.Gl, z.qkv_group_width()});
    A.attention.attn = P->activation({Sc, B, Hl, d});
  }
  // Ampipe without CP: one [B, Hl, q] block per (chunk, piece); under CP one per half.
  A.attention.lse = ampipe && !ring ? P->activation32({z.ampipe * z.t_sp, B, Hl, z.piece_rows()})
                                    : P->activation32({ring ? 2 : 1, B, Hl, z.chunk});
  A.attention.proj_partial = P->activation({Sc, B, h});
  if (ring && ampipe && !z.plan.ampipe_cp_resend_kv) {
    A.attention.kv_store = P->activation({cp * Sc, B, z.Gl, 2 * d});
    A.attention.kv_local = A.attention.kv_store.slice(0, P->at.cp * Sc, Sc);
  } else if (ring) {
    A.attention.kv_local = P->activation({Sc, B, z.Gl, 2 * d});
  }
  A.attention.proj_out = z.sp() ? P->activation({Sl, B, h}) : A.attention.proj_partial;
  // Materialised scores kept for the backward (Korthikanti et al. 2022's 5as^2b with dropout):
  // the softmax's output, and with attention dropout its one-byte mask and its output; none
  // when selective recomputation recomputes the core attention.
  if (z.model.materialised_scores() && !z.model.recompute.recomputes(kRecomputeCoreAttention)) {
    const std::int64_t S = z.S;
    A.attention.probabilities = P->activation({B, Hl, Sc, S});
    if (z.model.attention_dropout > 0) {
      A.attention.dropped_probabilities = P->activation({B, Hl, Sc, S});
      // One byte a score, in elements of the activations' size.
      const std::int64_t a = z.model.activation_bytes();
      A.attention.dropout_mask = P->activation({B, Hl, Sc, (S + a - 1) / a});
    }
  }
  A.attention.query_key = allocate_query_key_stages(
      z.spec(l), [this](const ops::Shape& s) { return P->activation(s); },
      {.rows = Sc * B, .groups = z.Gl, .queries_per_group = z.qpg, .head_dim = d});
  if (z.splits_backward && P->half()) {
    A.attention.saved_d_proj16 = P->activation16({Sc, B, h});
    A.attention.saved_d_qkv16 = P->activation16({Sc, B, z.qkv_width()});
  } else if (z.splits_backward) {
    A.attention.saved_d_proj = P->activation({Sc, B, h});
    A.attention.saved_d_qkv = P->activation({Sc, B, z.qkv_width()});
  }
}

namespace {

// The input norm of layer `layer` for set `set`: into ln1 (fp32), or a bf16 run's ln1_16, or
// under SP the bf16 run's workspace (norm_out) that the gather reads.
void input_norm_forward(RankProgram& P, int set, int layer) {
  RankProgram* p = &P;
  LayerActivations& A = p->acts(set, layer);
  const AttentionParameters& W = p->attention_parameters(layer);
  if (p->half()) {  // in fp32, rounded once into the bf16 input of the QKV product
    // A stage's input arrives as the bf16 values Megatron-LM's bf16 pipeline sends
    // (pipeline_dtype, the parameters' dtype; the stream's values already, so rounding
    // again, or again under recomputation, keeps them); with --fp32-residual-connection
    // it sends fp32.
    if (p->rounds_residual_stream() && takes_stage_input(p->layout, layer))
      round_in_place(p->precision(), A.x_in);
    if (!p->shape.sp()) {
      norm_forward_to_half(p->shape.model, A.x_in, *W.ln1_weight, W.ln1_bias, A.attention.ln1_16,
                           A.attention.ln1_mean, A.attention.ln1_rstd);
      return;
    }
    // Under SP the bf16 values are gathered (in fp32 buffers) before QKV keeps them.
    const Tensor& y = p->ws().half.norm_out;
    norm_forward(p->shape.model, A.x_in, *W.ln1_weight, W.ln1_bias, y, A.attention.ln1_mean,
                 A.attention.ln1_rstd);
    round_in_place(p->precision(), y);
    return;
  }
  norm_forward(p->shape.model, A.x_in, *W.ln1_weight, W.ln1_bias, A.attention.ln1,
               A.attention.ln1_mean, A.attention.ln1_rstd);
}

}  // namespace

TaskId AttentionBlock::input_norm_again(const BuildPosition& pos, TaskId ready) const {
  if (!P->shape.model.recompute.recomputes(kRecomputeLayerNorm)) return rt::kNoTask;
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const rt::TaskTags tags = pos.tags(rt::Phase::backward, l);
  const std::string at = fmt::format("L{}.", l);
  const double rows = static_cast<double>(z.Sl * z.B * z.h);
  const TaskId norm = P->compute(at + "input_norm_again", tags, cost::streamed(z, 2 * rows),
                                 [p, layer, set] { input_norm_forward(*p, set, layer); });
  P->after(ready, norm);
  const AttentionActivations& A = P->acts(set, l).attention;
  return gather_recomputed_norm(*P, norm, tags, at + "sp_gather_again",
                                at + "input_norm_again_round", A.ln1, A.ln1_full, A.ln1_16);
}

TaskId AttentionBlock::forward_input(const BuildPosition& pos, TaskId ready) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const std::int64_t B = z.B, d = z.d;
  const bool ring = z.spec(l).attention == AttentionCore::ring;
  const rt::TaskTags tags = pos.tags(rt::Phase::forward, l);
  const std::string at = fmt::format("L{}.", l);
  const double rows = static_cast<double>(z.Sl * B * z.h);
  const TaskId ln1 = P->compute(at + "input_norm", tags, cost::streamed(z, 2 * rows),
                                [p, layer, set] { input_norm_forward(*p, set, layer); });
  P->after(ready, ln1);
  LayerActivations& A = P->acts(set, layer);
  if (!ring && tp_overlaps(z)) return qkv_in_pieces(pos, ln1);
  TaskId gathered = rt::kNoTask;
  if (z.sp() && P->half())
    gathered =
        sp_gather(*P, ln1, P->ws().half.norm_out, P->ws().half.gathered, at + "sp_gather", tags);
  else if (z.sp())
    gathered = sp_gather(*P, ln1, A.attention.ln1, A.attention.ln1_full, at + "sp_gather", tags);
  const rt::CostHint cost = cost::qkv(z) + query_key_stages_cost(z.spec(l), z, false);
  const TaskId qkv = P->compute(at + "qkv", tags, cost, [=] {
    LayerActivations& A = p->acts(set, layer);
    const StepShape& z = p->shape;
    if (p->half()) {
      if (z.sp()) round_to_half(p->precision(), p->ws().half.gathered, A.attention.ln1_16);
      project_qkv_bf16(z.spec(layer), z.model, p->attention_parameters(layer), A.attention.ln1_16,
                       A.attention.qkv16, p->ws().half.qkv32, context_positions(*p),
                       A.attention.query_key);
      if (ring) {  // the bf16 keys and values, contiguous, in the fp32 block the ring carries
        const Tensor& wide = p->ws().half.qkv32;
        widen_to_fp32(p->precision(), A.attention.qkv16, wide);
        const std::int64_t keys = z.qpg * d;
        A.attention.kv_local.slice(3, 0, d).copy_from(wide.slice(3, keys, d));
        A.attention.kv_local.slice(3, d, d).copy_from(wide.slice(3, keys + d, d));
      }
      return;
    }
    project_qkv(z.spec(layer), z.model, p->attention_parameters(layer), A.attention.ln1_full,
                A.attention.qkv, context_positions(*p), A.attention.query_key);
    if (ring) {  // keys and values, contiguous: the block this rank sends round the ring
      const std::int64_t keys = p->shape.qpg * d;
      A.attention.kv_local.slice(3, 0, d).copy_from(A.attention.qkv.slice(3, keys, d));
      A.attention.kv_local.slice(3, d, d).copy_from(A.attention.qkv.slice(3, keys + d, d));
    }
  });
  P->after(gathered, qkv);
  return qkv;
}

TaskId AttentionBlock::forward(const BuildPosition& pos, TaskId ready) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const std::int64_t Sc = z.Sc, B = z.B, Hl = z.Hl, d = z.d;
  const rt::TaskTags tags = pos.tags(rt::Phase::forward, l);
  const std::string at = fmt::format("L{}.", l);
  const int mb = pos.micro_batch;
  const TaskId qkv = forward_input(pos, ready);
  TaskId attention;
  if (z.spec(l).attention == AttentionCore::local && tp_overlaps(z))
    return forward_in_pieces(pos, qkv);
  if (z.spec(l).attention == AttentionCore::local) {
    attention =
        P->compute(at + "attention", tags, cost::core_attention(z) + cost::projection(z), [=] {
          LayerActivations& A = p->acts(set, layer);
          const StepShape& z = p->shape;
          if (p->half()) {
            const HalfWorkspace& half = p->ws().half;
            const AttentionActivations& S = A.attention;
            half_attention_forward(p->precision(), {.dropout = attention_dropout(*p, layer, mb)},
                                   query_view(S.qkv16, z), key_view(S.qkv16, z),
                                   value_view(S.qkv16, z), output_view(S.attn16, z),
                                   S.lse.reshape({B, Hl, Sc}));
            // The projection's bf16 output joins the fp32 residual stream.
            half_linear_forward(p->precision(), S.attn16.reshape({Sc, B, Hl * d}),
                                p->attention_parameters(layer).proj_weight->value16,
                                ops::Bf16Tensor{}, half.out16);
            widen_to_fp32(p->precision(), half.out16, S.proj_partial);
            return;
          }
          ops::attention_forward({.dropout = attention_dropout(*p, layer, mb)},
                                 query_view(A.attention.qkv, z), key_view(A.attention.qkv, z),
                                 value_view(A.attention.qkv, z), output_view(A.attention.attn, z),
                                 A.attention.lse.reshape({B, Hl, Sc}));
          ops::linear_forward(A.attention.attn.reshape({Sc, B, Hl * d}),
                              p->attention_parameters(layer).proj_weight->value, Tensor{},
                              A.attention.proj_partial);
        });
    P->after(qkv, attention);
  } else {
    attention = RingAttention(*P, l).forward(pos, qkv);
  }
  LayerActivations& A = P->acts(set, layer);
  const TaskId reduced = reduce_partial(*P, attention, A.attention.proj_partial,
                                        A.attention.proj_out, at + "attention_reduce", tags);
  return reduced != rt::kNoTask ? reduced : attention;
}

TaskId AttentionBlock::qkv_in_pieces(const BuildPosition& pos, TaskId ln1) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const rt::TaskTags tags = pos.tags(rt::Phase::forward, l);
  const std::string at = fmt::format("L{}.", l);
  LayerActivations& A = P->acts(set, layer);
  const bool half = P->half();
  const Tensor shard = half ? P->ws().half.norm_out : A.attention.ln1;
  const Tensor full = half ? P->ws().half.gathered : A.attention.ln1_full;
  const std::int64_t B = z.B, h = z.h, width = z.qkv_width();
  // The product piece by piece (each row's QKV is the whole product's); the query/key stages and
  // RoPE once over every row after the last, as project_qkv runs them.
  return gather_in_pieces(
      *P, ln1, P->ws().tp_overlap.gather, shard, full, at + "sp_gather", at + "qkv", tags,
      [=](std::int64_t rows) { return cost::matmul(rows * B, h, width); },
      [=](std::int64_t first, std::int64_t rows) {
        LayerActivations& A = p->acts(set, layer);
        const AttentionParameters& W = p->attention_parameters(layer);
        if (p->half()) {
          const ops::Bf16Tensor x = A.attention.ln1_16.slice(0, first, rows),
                                qkv = A.attention.qkv16.slice(0, first, rows);
          round_to_half(p->precision(), p->ws().half.gathered.slice(0, first, rows), x);
          half_linear_forward(p->precision(), x, W.qkv_weight->value16, value16_of(W.qkv_bias),
                              qkv.reshape(x.shape().with(-1, qkv.numel() / x.rows())));
          return;
        }
        const Tensor x = A.attention.ln1_full.slice(0, first, rows),
                     qkv = A.attention.qkv.slice(0, first, rows);
        ops::linear_forward(x, W.qkv_weight->value, value_of(W.qkv_bias),
                            qkv.reshape(x.shape().with(-1, qkv.numel() / x.rows())));
      },
      query_key_stages_cost(z.spec(l), z, false),
      [=] {
        LayerActivations& A = p->acts(set, layer);
        const StepShape& z = p->shape;
        const ModelConfig& m = z.model;
        const LayerSpec& spec = z.spec(layer);
        const AttentionParameters& W = p->attention_parameters(layer);
        const std::vector<std::int64_t> positions = context_positions(*p);
        if (p->half()) {
          if (m.position_embedding != PositionEmbedding::rope && spec.query_key.empty()) return;
          const Tensor& wide = p->ws().half.qkv32;
          widen_to_fp32(p->precision(), A.attention.qkv16, wide);
          for (std::size_t i = 0; i < spec.query_key.size(); ++i)
            spec.query_key[i]->forward(m, W.query_key[i], wide, A.attention.query_key[i]);
          if (m.position_embedding == PositionEmbedding::rope)
            rotate_queries_and_keys(m, wide, positions, false);
          round_to_half(p->precision(), wide, A.attention.qkv16);
          return;
        }
        for (std::size_t i = 0; i < spec.query_key.size(); ++i)
          spec.query_key[i]->forward(m, W.query_key[i], A.attention.qkv, A.attention.query_key[i]);
        if (m.position_embedding == PositionEmbedding::rope)
          rotate_queries_and_keys(m, A.attention.qkv, positions, false);
      });
}

TaskId AttentionBlock::forward_in_pieces(const BuildPosition& pos, TaskId qkv) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set, mb = pos.micro_batch;
  const StepShape& z = P->shape;
  const std::int64_t Sc = z.Sc, B = z.B, Hl = z.Hl, d = z.d;
  const rt::TaskTags tags = pos.tags(rt::Phase::forward, l);
  const std::string at = fmt::format("L{}.", l);
  const TaskId core = P->compute(at + "attention", tags, cost::core_attention(z), [=] {
    const AttentionActivations& S = p->acts(set, layer).attention;
    const StepShape& z = p->shape;
    const ops::AttentionDropout dropout = attention_dropout(*p, layer, mb);
    if (p->half()) {
      half_attention_forward(p->precision(), {.dropout = dropout}, query_view(S.qkv16, z),
                             key_view(S.qkv16, z), value_view(S.qkv16, z), output_view(S.attn16, z),
                             S.lse.reshape({B, Hl, Sc}));
      return;
    }
    ops::attention_forward({.dropout = dropout}, query_view(S.qkv, z), key_view(S.qkv, z),
                           value_view(S.qkv, z), output_view(S.attn, z),
                           S.lse.reshape({B, Hl, Sc}));
  });
  P->after(qkv, core);
  // The projection piece by piece, each piece's partial sums reduce-scattered while the next is
  // computed (tp_comm_overlap.hpp).
  LayerActivations& A = P->acts(set, layer);
  const std::int64_t h = z.h;
  return scatter_in_pieces(
      *P, core, P->ws().tp_overlap.scatter, A.attention.proj_partial, A.attention.proj_out,
      at + "attention_projection", at + "attention_reduce", tags,
      [=](std::int64_t rows) { return cost::matmul(rows * B, Hl * d, h); },
      [=](std::int64_t first, std::int64_t rows) {
        const AttentionActivations& S = p->acts(set, layer).attention;
        const AttentionParameters& W = p->attention_parameters(layer);
        const Tensor out = S.proj_partial.slice(0, first, rows);
        if (p->half()) {
          const ops::Bf16Tensor out16 = p->ws().half.out16.slice(0, first, rows);
          half_linear_forward(p->precision(),
                              S.attn16.reshape({Sc, B, Hl * d}).slice(0, first, rows),
                              W.proj_weight->value16, ops::Bf16Tensor{}, out16);
          widen_to_fp32(p->precision(), out16, out);
          return;
        }
        ops::linear_forward(S.attn.reshape({Sc, B, Hl * d}).slice(0, first, rows),
                            W.proj_weight->value, Tensor{}, out);
      });
}

namespace {

// A bf16 run's attention backward (local attention, the projection's weight half folded in, or
// with `keep` its output gradient kept for W):
// the output gradient rounded to bf16 for the projection's products, then the bf16 attention
// backward into d_qkv: dq in bf16 (widened), dk and dv accumulated in fp32.
void attention_backward_bf16(RankProgram& p, const AttentionActivations& S,
                             const AttentionParameters& W, const ops::AttentionDropout& dropout,
                             const Tensor& d_proj, bool keep) {
  const StepShape& z = p.shape;
  const std::int64_t Sc = z.Sc, B = z.B, Hl = z.Hl, d = z.d;
  BackwardWorkspace& w = p.ws();
  const HalfWorkspace& half = w.half;
  round_to_half(p.precision(), d_proj, half.d_out16);
  half_linear_backward_input(p.precision(), half.d_out16, W.proj_weight->value16, half.d_attn16);
  if (keep)
    S.saved_d_proj16.copy_from(half.d_out16);
  else
    half_linear_backward_weight(p.precision(), S.attn16.reshape({Sc, B, Hl * d}), half.d_out16,
                                W.proj_weight->grad, Tensor{});
  w.attention.d_qkv.fill(0.f);  // attention accumulates dk and dv
  half_attention_backward(p.precision(), {.dropout = dropout}, query_view(S.qkv16, z),
                          key_view(S.qkv16, z), value_view(S.qkv16, z), output_view(S.attn16, z),
                          S.lse.reshape({B, Hl, Sc}), output_view(half.d_attn16, z),
                          query_view(half.d_qkv16, z), key_view(w.attention.d_qkv, z),
                          value_view(w.attention.d_qkv, z));
  widen_to_fp32(p.precision(), query_view(half.d_qkv16, z), query_view(w.attention.d_qkv, z));
}

}  // namespace

TaskId AttentionBlock::backward_in_pieces(const BuildPosition& pos, TaskId ready, bool keep) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set, mb = pos.micro_batch;
  const StepShape& z = P->shape;
  const std::int64_t Sc = z.Sc, B = z.B, Hl = z.Hl, d = z.d;
  const rt::TaskTags tags = pos.tags(rt::Phase::backward, l);
  const std::string at = fmt::format("L{}.", l);
  BackwardWorkspace& w = P->ws();
  const std::int64_t h = z.h;
  // The projection's input gradient piece by piece as the output gradient's gather arrives.
  const TaskId projected = gather_in_pieces(
      *P, ready, w.tp_overlap.grad_gather, w.d_mlp, w.d_mlp_full, at + "attention_grad_gather",
      at + "attention_projection_backward", tags,
      [=](std::int64_t rows) { return cost::matmul(rows * B, h, Hl * d); },
      [=](std::int64_t first, std::int64_t rows) {
        const AttentionActivations& S = p->acts(set, layer).attention;
        BackwardWorkspace& w = p->ws();
        const AttentionParameters& W = p->attention_parameters(layer);
        const Tensor d_proj = w.d_mlp_full.slice(0, first, rows);
        if (p->half()) {
          const ops::Bf16Tensor d_out16 = w.half.d_out16.slice(0, first, rows);
          round_to_half(p->precision(), d_proj, d_out16);
          half_linear_backward_input(p->precision(), d_out16, W.proj_weight->value16,
                                     w.half.d_attn16.slice(0, first, rows));
          if (keep) S.saved_d_proj16.slice(0, first, rows).copy_from(d_out16);
          return;
        }
        ops::linear_backward_input(d_proj, W.proj_weight->value,
                                   w.attention.d_attn.slice(0, first, rows));
        if (keep) S.saved_d_proj.slice(0, first, rows).copy_from(d_proj);
      });
  // The projection's weight half over every row (unless kept for W), then the core attention's
  // backward, as the unsplit task runs them.
  const rt::CostHint weight = keep ? rt::CostHint{} : cost::projection(z);
  const TaskId attention =
      P->compute(at + "attention_backward", tags, weight + cost::core_attention_backward(z), [=] {
        const AttentionActivations& S = p->acts(set, layer).attention;
        BackwardWorkspace& w = p->ws();
        const AttentionParameters& W = p->attention_parameters(layer);
        const StepShape& z = p->shape;
        const ops::AttentionDropout dropout = attention_dropout(*p, layer, mb);
        if (p->half()) {
          const HalfWorkspace& half = w.half;
          if (!keep)
            half_linear_backward_weight(p->precision(), S.attn16.reshape({Sc, B, Hl * d}),
                                        half.d_out16, W.proj_weight->grad, Tensor{});
          w.attention.d_qkv.fill(0.f);  // attention accumulates dk and dv
          half_attention_backward(p->precision(), {.dropout = dropout}, query_view(S.qkv16, z),
                                  key_view(S.qkv16, z), value_view(S.qkv16, z),
                                  output_view(S.attn16, z), S.lse.reshape({B, Hl, Sc}),
                                  output_view(half.d_attn16, z), query_view(half.d_qkv16, z),
                                  key_view(w.attention.d_qkv, z), value_view(w.attention.d_qkv, z));
          widen_to_fp32(p->precision(), query_view(half.d_qkv16, z),
                        query_view(w.attention.d_qkv, z));
          return;
        }
        if (!keep)
          ops::linear_backward_weight(S.attn.reshape({Sc, B, Hl * d}), w.d_mlp_full,
                                      W.proj_weight->grad, Tensor{});
        w.attention.d_qkv.fill(0.f);  // attention accumulates dk and dv
        ops::attention_backward({.dropout = dropout}, query_view(S.qkv, z), key_view(S.qkv, z),
                                value_view(S.qkv, z), output_view(S.attn, z),
                                S.lse.reshape({B, Hl, Sc}), output_view(w.attention.d_attn, z),
                                query_view(w.attention.d_qkv, z), key_view(w.attention.d_qkv, z),
                                value_view(w.attention.d_qkv, z));
      });
  P->after(projected, attention);
  return attention;
}

TaskId AttentionBlock::backward(const BuildPosition& pos, TaskId ready, WeightHalves& halves,
                                bool last, WeightPlacement qkv_weights) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set, mb = pos.micro_batch;
  const StepShape& z = P->shape;
  const std::int64_t Sc = z.Sc, B = z.B, Hl = z.Hl, d = z.d;
  const bool sp = z.sp(), ring = z.spec(l).attention == AttentionCore::ring;
  const rt::TaskTags tags = pos.tags(rt::Phase::backward, l);
  const std::string at = fmt::format("L{}.", l);
  BackwardWorkspace& w = P->ws();
  const bool keep = halves.zero_bubble();
  const bool overlapped = !ring && tp_overlaps(z);
  const TaskId norm_again = input_norm_again(pos, ready);
  TaskId gathered = rt::kNoTask;
  if (sp && !overlapped)
    gathered = sp_gather(*P, ready, w.d_mlp, w.d_mlp_full, at + "attention_grad_gather", tags);
  const rt::CostHint projection = cost::projection(z);
  const rt::CostHint flops = (keep ? projection : projection + projection) +
                             (ring ? rt::CostHint{} : cost::core_attention_backward(z));
  const TaskId attention =
      overlapped
          ? backward_in_pieces(pos, ready, keep)
          : P->compute(at + "attention_backward", tags, flops, [=] {
              LayerActivations& A = p->acts(set, layer);
              BackwardWorkspace& w = p->ws();
              const AttentionParameters& W = p->attention_parameters(layer);
              const Tensor d_proj = sp ? w.d_mlp_full : w.d_mlp;
              if (p->half() &&
                  ring) {  // the projection's backward; the ring's steps run the attention's
                const HalfWorkspace& half = w.half;
                round_to_half(p->precision(), d_proj, half.d_out16);
                half_linear_backward_input(p->precision(), half.d_out16, W.proj_weight->value16,
                                           half.d_attn16);
                half_linear_backward_weight(p->precision(),
                                            A.attention.attn16.reshape({Sc, B, Hl * d}),
                                            half.d_out16, W.proj_weight->grad, Tensor{});
                w.attention.d_qkv.fill(0.f);
                return;
              }
              if (p->half()) {
                attention_backward_bf16(*p, A.attention, W, attention_dropout(*p, layer, mb),
                                        d_proj, keep);
                return;
              }
              ops::linear_backward_input(d_proj, W.proj_weight->value, w.attention.d_attn);
              if (keep)
                A.attention.saved_d_proj.copy_from(d_proj);
              else  // the projection's weight half, folded in: nothing would overlap it
                ops::linear_backward_weight(A.attention.attn.reshape({Sc, B, Hl * d}), d_proj,
                                            W.proj_weight->grad, Tensor{});
              w.attention.d_qkv.fill(0.f);  // attention accumulates dk and dv
              const StepShape& z = p->shape;
              if (!ring)
                ops::attention_backward(
                    {.dropout = attention_dropout(*p, layer, mb)}, query_view(A.attention.qkv, z),
                    key_view(A.attention.qkv, z), value_view(A.attention.qkv, z),
                    output_view(A.attention.attn, z), A.attention.lse.reshape({B, Hl, Sc}),
                    output_view(w.attention.d_attn, z), query_view(w.attention.d_qkv, z),
                    key_view(w.attention.d_qkv, z), value_view(w.attention.d_qkv, z));
            });
  P->after(gathered, attention);
  if (keep)
    halves.place(WeightPlacement::zero_bubble, [=] {
      return p->compute(at + "attention_weight_grad", pos.tags(rt::Phase::weight, layer),
                        cost::projection(z), [=] {
                          LayerActivations& A = p->acts(set, layer);
                          if (p->half()) {
                            half_linear_backward_weight(
                                p->precision(), A.attention.attn16.reshape({Sc, B, Hl * d}),
                                A.attention.saved_d_proj16,
                                p->attention_parameters(layer).proj_weight->grad, Tensor{});
                            return;
                          }
                          ops::linear_backward_weight(
                              A.attention.attn.reshape({Sc, B, Hl * d}), A.attention.saved_d_proj,
                              p->attention_parameters(layer).proj_weight->grad, Tensor{});
                        });
    });
  TaskId kv_grads = attention;
  if (ring) kv_grads = RingAttention(*P, l).backward(pos, attention);
  return backward_input(pos, kv_grads, halves, last, qkv_weights, norm_again);
}

namespace {

// The QKV product's input gradient into d_norm_full from d_qkv (with, under CP, the keys' and
// values' gradients the ring brought home), kept for the weight half when it waits for W.
void qkv_input_gradient(RankProgram& P, int set, int layer, bool ring, bool keep) {
  const StepShape& z = P.shape;
  BackwardWorkspace& w = P.ws();
  AttentionActivations& A = P.acts(set, layer).attention;
  const std::int64_t d = z.d, keys = z.qpg * d, width = z.qkv_width();
  if (ring) {  // the block's gradients came home with the last turn of the ring
    const Tensor& home = w.cp_ring.dring[z.cp % 2];
    w.attention.d_qkv.slice(3, keys, d).copy_from(home.slice(3, 0, d));
    w.attention.d_qkv.slice(3, keys + d, d).copy_from(home.slice(3, d, d));
  }
  project_qkv_backward(z.spec(layer), z.model, P.attention_parameters(layer), w.attention.d_qkv,
                       context_positions(P), A.query_key);
  if (P.half()) {  // the gradients the QKV product takes, in bf16
    const HalfWorkspace& half = w.half;
    round_to_half(P.precision(), w.attention.d_qkv, half.d_qkv16);
    if (keep) A.saved_d_qkv16.copy_from(half.d_qkv16.reshape({z.Sc, z.B, width}));
    half_linear_backward_input(P.precision(), half.d_qkv16.reshape({z.Sc, z.B, width}),
                               P.attention_parameters(layer).qkv_weight->value16, half.out16);
    widen_to_fp32(P.precision(), half.out16, w.d_norm_full);
    return;
  }
  const Tensor d_out = w.attention.d_qkv.reshape({z.Sc, z.B, width});
  ops::linear_backward_input(d_out, P.attention_parameters(layer).qkv_weight->value, w.d_norm_full);
  if (keep) A.saved_d_qkv.copy_from(d_out);
}

}  // namespace

TaskId AttentionBlock::backward_input(const BuildPosition& pos, TaskId ready, WeightHalves& halves,
                                      bool last, WeightPlacement qkv_weights,
                                      TaskId norm_again) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const std::int64_t Sc = z.Sc, B = z.B;
  const bool ring = z.spec(l).attention == AttentionCore::ring;
  const rt::TaskTags tags = pos.tags(rt::Phase::backward, l);
  const std::string at = fmt::format("L{}.", l);
  const bool keep = halves.zero_bubble();
  const rt::CostHint cost = cost::qkv(z) + query_key_stages_cost(z.spec(l), z, true);
  const TaskId qkv_in = P->compute(at + "qkv_backward", tags, cost,
                                   [=] { qkv_input_gradient(*p, set, layer, ring, keep); });
  P->after(ready, qkv_in);
  BackwardWorkspace& w = P->ws();
  const TaskId reduced =
      reduce_partial(*P, qkv_in, w.d_norm_full, w.d_norm, at + "attention_grad_reduce", tags);
  // The QKV weight half: from the saved output gradient when it waits for W, from the
  // workspace otherwise (it runs before the layer below reuses it).
  const WeightHalf weight_half = [=] {
    const rt::TaskTags t = pos.tags(keep ? rt::Phase::weight : rt::Phase::backward, layer);
    const TaskId weights = p->compute(at + "qkv_weight_grad", t, cost::qkv(z), [=] {
      LayerActivations& A = p->acts(set, layer);
      const AttentionParameters& W = p->attention_parameters(layer);
      if (p->half()) {
        const ops::Bf16Tensor d_out16 =
            keep ? A.attention.saved_d_qkv16
                 : p->ws().half.d_qkv16.reshape({Sc, B, p->shape.qkv_width()});
        half_linear_backward_weight(p->precision(), A.attention.ln1_16, d_out16, W.qkv_weight->grad,
                                    grad_of(W.qkv_bias));
        return;
      }
      const Tensor d_out = keep ? A.attention.saved_d_qkv
                                : p->ws().attention.d_qkv.reshape({Sc, B, p->shape.qkv_width()});
      ops::linear_backward_weight(A.attention.ln1_full, d_out, W.qkv_weight->grad,
                                  grad_of(W.qkv_bias));
    });
    p->after(norm_again, weights);  // the recomputed norm's output, gathered
    return weights;
  };
  TaskId norm_ready = reduced;
  switch (qkv_weights) {
    case WeightPlacement::zero_bubble:
      halves.place(qkv_weights, weight_half);
      if (reduced == rt::kNoTask) norm_ready = qkv_in;
      break;
    case WeightPlacement::immediate: {
      // Runs while the input gradient is reduced over tp.
      const TaskId weights = halves.place(qkv_weights, weight_half);
      if (reduced == rt::kNoTask) norm_ready = weights;
      break;
    }
    case WeightPlacement::deferred:
      norm_ready = qkv_in;
      break;
  }
  // The norm's backward (read 2, write 1) and the residual's sum (read 2, write 1).
  const TaskId ln1 =
      P->compute(at + "input_norm_backward", tags, cost::streamed(z, 6.0 * z.Sl * z.B * z.h), [=] {
        LayerActivations& A = p->acts(set, layer);
        BackwardWorkspace& w = p->ws();
        const AttentionParameters& W = p->attention_parameters(layer);
        // The reduced gradient is a bf16 value, as the bf16 collective would leave it.
        if (p->half() && p->shape.tp > 1) round_in_place(p->precision(), w.d_norm);
        norm_backward(p->shape.model, A.x_in, *W.ln1_weight, W.ln1_bias, A.attention.ln1_mean,
                      A.attention.ln1_rstd, w.d_norm, w.d_tmp);
        ops::accumulate(w.d_tmp, w.d_x);
        // The gradient of a 16-bit stream value, summed over its two readers, is 16-bit too.
        if (p->rounds_residual_stream()) round_in_place(p->precision(), w.d_x);
      });
  P->after(norm_ready, ln1);
  const std::string bucket = fmt::format("layers.{}.attention", l);
  if (qkv_weights != WeightPlacement::deferred) {
    // A zero-bubble I action leaves the bucket to its W action, which writes the rest of it.
    if (qkv_weights != WeightPlacement::zero_bubble) reduce_buckets(*P, bucket, ln1, last);
    return ln1;
  }
  // After ln1 on the compute stream, so the bucket's every gradient is in once it is done.
  halves.place(WeightPlacement::deferred, [=] {
    const TaskId weights = weight_half();
    reduce_buckets(*p, bucket, weights, last);
    return weights;
  });
  return ln1;
}

}  // namespace weave::graphs
