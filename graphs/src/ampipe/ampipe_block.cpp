#include "ampipe/ampipe_block.hpp"
#include "model/half_precision.hpp"
#include "model/norm.hpp"

#include <numeric>

#include "model/attention_block.hpp"
#include "moe/moe_mlp.hpp"
#include "step/gradient_buckets.hpp"
#include "step/step_costs.hpp"
#include "weave/ops/attention.hpp"
#include "weave/ops/elementwise.hpp"
#include "weave/ops/linear.hpp"
#include "weave/ops/normalization.hpp"

namespace weave::graphs {

namespace {

// Tensor parallelism without SP: every tp rank holds the whole sequence, so each chunk's
// projection is all-reduced before its residual and norm. Megatron-Core's router: the tp ranks
// route their own slices of the chunk (StepShape::routes_tp_slices), and the chunk's MoE output
// and input gradient are all-gathered back; MindSpeed's gate routes the whole chunk on every tp
// rank, its output and input gradient whole there already.
bool replicated_over_tp(const StepShape& z) {
  return !z.sp() && z.tp > 1;
}

// Residual and norm of this rank's rows of chunk c, from the out-projection's sum `proj`.
void chunk_residual_norm(RankProgram& p, int set, int layer, int mb, int c, const Tensor& proj) {
  LayerActivations& A = p.acts(set, layer);
  const LayerShard& W = p.layer(layer);
  const std::int64_t q = p.shape.piece_rows(), B = p.shape.B, first = c * q;
  // A bf16 run: the reduced projection is a bf16 value, as the bf16 collective leaves it; the
  // bias is read from its bf16 copy (widened) and the norm's output rounded once (the router's
  // and the experts' bf16 input).
  if (p.half() && p.shape.tp > 1) round_in_place(p.precision(), proj);
  p.bias_dropout_add(mb, layer, 0, proj, compute_value_of(W.attention.proj_bias),
                     A.x_in.slice(0, first, q), A.x_mid.slice(0, first, q), first);
  norm_forward(p.shape.model, A.x_mid.slice(0, first, q), *W.ln2_weight, W.ln2_bias,
               A.ln2.slice(0, first, q), A.ln2_mean.slice(0, first * B, q * B),
               A.ln2_rstd.slice(0, first * B, q * B));
  if (p.half()) round_in_place(p.precision(), A.ln2.slice(0, first, q));
}

// The out-projection's partial sums of chunk c's rows of the sequence, piece after piece.
Tensor chunk_partial(RankProgram& p, int set, int layer, int c) {
  const std::int64_t n = p.shape.t_sp * p.shape.piece_rows();
  return p.acts(set, layer).attention.proj_partial.slice(0, c * n, n);
}

// Without CP: chunk c's attention and out-projection, piece after piece (one piece per tp rank
// under SP), and without SP or TP its residual and norm.
void chunk_attention_forward(RankProgram& p, int set, int layer, int mb, int c) {
  AttentionActivations& A = p.acts(set, layer).attention;
  const StepShape& z = p.shape;
  const std::int64_t q = z.piece_rows(), B = z.B, Hl = z.Hl, d = z.d;
  for (int j = 0; j < z.t_sp; ++j) {
    const std::int64_t first = z.piece_start(c, j);
    if (p.half()) {  // the bf16 attention kernel and a bf16 projection into bf16 partial sums
      half_attention_forward(p.precision(),
                             {.q_offset = first, .dropout = attention_dropout(p, layer, mb)},
                             query_view(A.qkv16.slice(0, first, q), z), key_view(A.qkv16, z),
                             value_view(A.qkv16, z), output_view(A.attn16.slice(0, first, q), z),
                             A.lse.slice(0, c * z.t_sp + j, 1).reshape({B, Hl, q}));
      const ops::Bf16Tensor out16 = ops::Bf16Tensor::empty({q, B, z.h});
      half_linear_forward(p.precision(), A.attn16.slice(0, first, q).reshape({q, B, Hl * d}),
                          p.attention_parameters(layer).proj_weight->value16, ops::Bf16Tensor{},
                          out16);
      widen_to_fp32(p.precision(), out16, chunk_partial(p, set, layer, c).slice(0, j * q, q));
      continue;
    }
    ops::attention_forward({.q_offset = first, .dropout = attention_dropout(p, layer, mb)},
                           query_view(A.qkv.slice(0, first, q), z), key_view(A.qkv, z),
                           value_view(A.qkv, z), output_view(A.attn.slice(0, first, q), z),
                           A.lse.slice(0, c * z.t_sp + j, 1).reshape({B, Hl, q}));
    ops::linear_forward(A.attn.slice(0, first, q).reshape({q, B, Hl * d}),
                        p.attention_parameters(layer).proj_weight->value, Tensor{},
                        chunk_partial(p, set, layer, c).slice(0, j * q, q));
  }
  if (z.tp == 1) chunk_residual_norm(p, set, layer, mb, c, chunk_partial(p, set, layer, c));
}

// The norm, residual and bias backward of this rank's rows of chunk c: d_proj in d_mlp's rows.
void chunk_residual_backward(RankProgram& p, int set, int layer, int mb, int c) {
  LayerActivations& A = p.acts(set, layer);
  BackwardWorkspace& w = p.ws();
  const LayerShard& W = p.layer(layer);
  const std::int64_t q = p.shape.piece_rows(), B = p.shape.B, first = c * q;
  const Tensor d_norm = w.d_norm.slice(0, first, q), d_tmp = w.d_tmp.slice(0, first, q);
  const Tensor d_mid = w.d_x_mid.slice(0, first, q), d_proj = w.d_mlp.slice(0, first, q);
  // (Routed in slices over tp, the slices' gradients are gathered into d_norm's rows already.)
  if (!p.shape.routes_tp_slices())
    d_norm.reshape({q * B, p.shape.h}).copy_from(p.slot(set, layer, c).d_moe_in);
  norm_backward(p.shape.model, A.x_mid.slice(0, first, q), *W.ln2_weight, W.ln2_bias,
                A.ln2_mean.slice(0, first * B, q * B), A.ln2_rstd.slice(0, first * B, q * B),
                d_norm, d_tmp);
  ops::accumulate(d_tmp, d_mid);
  if (p.rounds_residual_stream()) round_in_place(p.precision(), d_mid);  // a 16-bit stream's
  w.d_x.slice(0, first, q).copy_from(d_mid);  // the residual path to the layer input
  p.bias_dropout_add_backward(mb, layer, 0, d_mid, d_proj, grad_of(W.attention.proj_bias), first);
}

// The projection's gradient of chunk c's rows of the sequence, piece after piece (under SP
// gathered from every rank's piece).
Tensor chunk_d_proj_rows(RankProgram& p, int c) {
  const std::int64_t q = p.shape.piece_rows(), n = p.shape.t_sp * q;
  BackwardWorkspace& w = p.ws();
  return p.shape.sp() ? w.d_mlp_full.slice(0, c * n, n) : w.d_mlp.slice(0, c * q, q);
}

// Under CP: chunk c's half, its projection's backward into d_attn (without SP after its
// residual's).
void chunk_projection_backward(RankProgram& p, int set, int layer, int mb, int c) {
  const StepShape& z = p.shape;
  const std::int64_t n = z.t_sp * z.piece_rows(), B = z.B, Hl = z.Hl, d = z.d;
  LayerActivations& A = p.acts(set, layer);
  BackwardWorkspace& w = p.ws();
  const LayerShard& W = p.layer(layer);
  if (z.t_sp == 1) chunk_residual_backward(p, set, layer, mb, c);
  const Tensor d_proj = chunk_d_proj_rows(p, c);
  if (p.half()) {
    // As the ring's whole projection backward, on the half's rows: the output gradient rounded
    // to 16 bits, the attention's output gradient in 16 bits where the half's products read it.
    const HalfWorkspace& half = w.half;
    const ops::Bf16Tensor d_out16 = half.d_out16.slice(0, c * n, n);
    round_to_half(p.precision(), d_proj, d_out16);
    half_linear_backward_input(p.precision(), d_out16, W.attention.proj_weight->value16,
                               half.d_attn16.slice(0, c * n, n));
    half_linear_backward_weight(p.precision(),
                                A.attention.attn16.slice(0, c * n, n).reshape({n, B, Hl * d}),
                                d_out16, W.attention.proj_weight->grad, Tensor{});
    return;
  }
  ops::linear_backward_input(d_proj, W.attention.proj_weight->value,
                             w.attention.d_attn.reshape({z.Sc, B, Hl * d}).slice(0, c * n, n));
  ops::linear_backward_weight(A.attention.attn.slice(0, c * n, n).reshape({n, B, Hl * d}), d_proj,
                              W.attention.proj_weight->grad, Tensor{});
}

// Without CP: chunk c's projection and attention backward, piece after piece (without SP after
// its residual's), dq into its rows of d_qkv and dk, dv accumulated.
void chunk_attention_backward(RankProgram& p, int set, int layer, int mb, int c) {
  const StepShape& z = p.shape;
  const std::int64_t q = z.piece_rows(), B = z.B, Hl = z.Hl, d = z.d;
  AttentionActivations& A = p.acts(set, layer).attention;
  BackwardWorkspace& w = p.ws();
  // The chunks' attention accumulates dk and dv; zeroed here, not earlier, as the layer above's
  // deferred weight half reads d_qkv until this layer's combines are launched.
  if (c == z.ampipe - 1) w.attention.d_qkv.fill(0.f);
  if (z.t_sp == 1) chunk_residual_backward(p, set, layer, mb, c);
  const LayerShard& W = p.layer(layer);
  for (int j = 0; j < z.t_sp; ++j) {
    const std::int64_t first = z.piece_start(c, j);
    const Tensor d_proj = chunk_d_proj_rows(p, c).slice(0, j * q, q);
    if (p.half()) {
      // As a bf16 run's whole attention backward: the output gradient rounded to bf16 for the
      // projection's products, then the bf16 attention backward: dq in bf16 (widened into
      // d_qkv's rows), dk and dv accumulated in fp32.
      const ops::Bf16Tensor d_out16 = ops::Bf16Tensor::empty({q, B, z.h});
      const ops::Bf16Tensor d_attn16 = ops::Bf16Tensor::empty({q, B, Hl * d});
      const ops::Bf16Tensor attn16 = A.attn16.slice(0, first, q).reshape({q, B, Hl * d});
      round_to_half(p.precision(), d_proj, d_out16);
      half_linear_backward_input(p.precision(), d_out16, W.attention.proj_weight->value16,
                                 d_attn16);
      half_linear_backward_weight(p.precision(), attn16, d_out16, W.attention.proj_weight->grad,
                                  Tensor{});
      const ops::Bf16Tensor dq16 = p.ws().half.d_qkv16.slice(0, first, q);
      half_attention_backward(
          p.precision(), {.q_offset = first, .dropout = attention_dropout(p, layer, mb)},
          query_view(A.qkv16.slice(0, first, q), z), key_view(A.qkv16, z), value_view(A.qkv16, z),
          output_view(A.attn16.slice(0, first, q), z),
          A.lse.slice(0, c * z.t_sp + j, 1).reshape({B, Hl, q}), output_view(d_attn16, z),
          query_view(dq16, z), key_view(w.attention.d_qkv, z), value_view(w.attention.d_qkv, z));
      widen_to_fp32(p.precision(), query_view(dq16, z),
                    query_view(w.attention.d_qkv.slice(0, first, q), z));
      continue;
    }
    const Tensor d_attn = w.attention.d_attn.reshape({z.Sc, B, Hl * d}).slice(0, first, q);
    ops::linear_backward_input(d_proj, W.attention.proj_weight->value, d_attn);
    ops::linear_backward_weight(A.attn.slice(0, first, q).reshape({q, B, Hl * d}), d_proj,
                                W.attention.proj_weight->grad, Tensor{});
    ops::attention_backward({.q_offset = first, .dropout = attention_dropout(p, layer, mb)},
                            query_view(A.qkv.slice(0, first, q), z), key_view(A.qkv, z),
                            value_view(A.qkv, z), output_view(A.attn.slice(0, first, q), z),
                            A.lse.slice(0, c * z.t_sp + j, 1).reshape({B, Hl, q}),
                            output_view(d_attn, z),
                            query_view(w.attention.d_qkv.slice(0, first, q), z),
                            key_view(w.attention.d_qkv, z), value_view(w.attention.d_qkv, z));
  }
}

// Split experts' items of every chunk run in one pipeline under the tp-sp overlap, and under
// pipe experts, whose items MindSpeed's PipeExpert runs expert-major across the chunks
// (pipe_experts.py).
bool items_in_one_pipeline(const StepShape& z) {
  return z.tp_sp_overlap() || (z.pipe_experts() && z.experts_split());
}

}  // namespace

TaskId AmpipeBlock::forward(const BuildPosition& pos, TaskId ready) const {
  const StepShape& z = P->shape;
  const int N = z.ampipe;
  const MoeMlp moe(*P, l);
  const TaskId qkv = AttentionBlock(*P, l).forward_input(pos, ready);
  std::vector<SlotProgress> routed(static_cast<std::size_t>(N));
  TaskId first_gathered = rt::kNoTask;
  for (int c = 0; c < N; ++c) {
    const TaskId side = chunk_attention(pos, c, qkv);
    // --ampipe-tp-sp-comm-overlap: the first item's gather goes out after the last chunk's
    // projection (behind its reduce-scatter on the tp stream), under its norm and router.
    if (z.tp_sp_overlap() && c == N - 1)
      first_gathered = moe.gather_item(pos, 0, 0, routed[0].items[0]);
    routed[c] = moe.route(pos, c, chunk_residual(pos, c, side));
  }
  return moe_forward(pos, routed, first_gathered);
}

TaskId AmpipeBlock::chunk_attention(const BuildPosition& pos, int c, TaskId qkv) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set, mb = pos.micro_batch;
  const StepShape& z = P->shape;
  const std::int64_t n = z.t_sp * z.piece_rows(), B = z.B, Hl = z.Hl, d = z.d;
  const int N = z.ampipe;
  const rt::TaskTags tags = pos.chunk_tags(rt::Phase::forward, l, c);
  const std::string chunk = fmt::format("L{}.c{}.", l, c);
  if (z.cp > 1) {
    // The chunk's half of the rank's sequence: n rows from c n.
    const TaskId attention = ring_attention(pos, c, qkv);
    const TaskId side = P->compute(chunk + "projection", tags, cost::projection(z) / N, [=] {
      const Tensor partial = chunk_partial(*p, set, layer, c);
      if (p->half()) {  // the half's merged output rounded once, its projection in 16 bits
        AttentionActivations& A = p->acts(set, layer).attention;
        const ops::Bf16Tensor attn16 = A.attn16.slice(0, c * n, n);
        round_to_half(p->precision(), p->ws().cp_ring.merged.slice(0, c * n, n), attn16);
        const ops::Bf16Tensor out16 = p->ws().half.out16.slice(0, c * n, n);
        half_linear_forward(p->precision(), attn16.reshape({n, B, Hl * d}),
                            p->attention_parameters(layer).proj_weight->value16, ops::Bf16Tensor{},
                            out16);
        widen_to_fp32(p->precision(), out16, partial);
      } else {
        ops::linear_forward(
            p->acts(set, layer).attention.attn.slice(0, c * n, n).reshape({n, B, Hl * d}),
            p->attention_parameters(layer).proj_weight->value, Tensor{}, partial);
      }
      if (p->shape.t_sp == 1) chunk_residual_norm(*p, set, layer, mb, c, partial);
    });
    P->after(attention, side);
    return side;
  }
  const rt::CostHint flops =
      cost::ampipe_causal_share(z, c) * cost::causal_attention(z) + cost::projection(z) / N;
  const TaskId side = P->compute(chunk + "attention", tags, flops,
                                 [=] { chunk_attention_forward(*p, set, layer, mb, c); });
  // After the previous chunk's router by the compute stream's order only: its dispatch may
  // still be running, and that is the overlap.
  P->after(qkv, side);
  return side;
}

TaskId AmpipeBlock::chunk_residual(const BuildPosition& pos, int c, TaskId side) const {
  const StepShape& z = P->shape;
  if (z.tp == 1) return side;
  RankProgram* p = P;
  const int layer = l, set = pos.set, mb = pos.micro_batch;
  const std::int64_t q = z.piece_rows();
  const rt::TaskTags tags = pos.chunk_tags(rt::Phase::forward, l, c);
  const std::string chunk = fmt::format("L{}.c{}.", l, c);
  if (replicated_over_tp(z)) {
    // The chunk's summed projection on every rank (the chunk's RowParallelLinear all-reduce),
    // on the tp stream; residual and norm of the whole chunk after it.
    const TaskId reduced =
        P->tensor.all_reduce(side, all_of(chunk_partial(*P, set, l, c)), devices::ReduceOp::sum,
                             chunk + "attention_reduce", tags);
    const TaskId residual = P->compute(
        chunk + "attention_residual", tags, cost::streamed(z, 5.0 * q * z.B * z.h),
        [=] { chunk_residual_norm(*p, set, layer, mb, c, chunk_partial(*p, set, layer, c)); });
    P->after(reduced, residual);
    return residual;
  }
  // Each rank's piece of the summed projection comes home, on the tp stream.
  const TaskId reduced =
      P->tensor.reduce_scatter(side, read_of(chunk_partial(*P, set, l, c)),
                               all_of(P->acts(set, l).attention.proj_out.slice(0, c * q, q)),
                               chunk + "attention_reduce", tags);
  // bias, dropout and residual (read 2, write 1), then the norm (read 1, write 1)
  const TaskId residual =
      P->compute(chunk + "attention_residual", tags, cost::streamed(z, 5.0 * q * z.B * z.h), [=] {
        chunk_residual_norm(*p, set, layer, mb, c,
                            p->acts(set, layer).attention.proj_out.slice(0, c * q, q));
      });
  P->after(reduced, residual);
  return residual;
}

TaskId AmpipeBlock::moe_forward(const BuildPosition& pos, const std::vector<SlotProgress>& routed,
                                TaskId first_gathered) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set, mb = pos.micro_batch;
  const StepShape& z = P->shape;
  const std::int64_t q = z.piece_rows();
  const int N = z.ampipe;
  const MoeMlp moe(*P, l);
  std::vector<SlotProgress> computed(static_cast<std::size_t>(N));
  if (items_in_one_pipeline(z)) {  // every chunk's items in one pipeline
    std::vector<int> chunks(static_cast<std::size_t>(N));
    std::iota(chunks.begin(), chunks.end(), 0);
    computed = moe.split_item_pipeline(pos, chunks, routed, first_gathered);
  } else {
    for (int c = 0; c < N; ++c)
      computed[c] = moe.experts(pos, c, routed[c]);
  }
  // The chunks' routers ran earlier on this compute stream; the statistics need nothing else.
  const TaskId stats = moe.statistics(pos, rt::kNoTask);
  TaskId last = rt::kNoTask;
  for (int c = 0; c < N; ++c) {
    TaskId combined = moe.combine(pos, c, computed[c]);
    if (z.routes_tp_slices())  // every tp rank's slice of the chunk's output, in its rows
      combined = P->tensor.all_gather(combined, read_of(P->slot(set, l, c).moe_out),
                                      all_of(P->acts(set, l).mlp_out.slice(0, c * q, q)),
                                      fmt::format("L{}.c{}.moe_gather", l, c),
                                      pos.chunk_tags(rt::Phase::forward, l, c));
    const TaskId residual = P->compute(
        fmt::format("L{}.c{}.mlp_residual", l, c), pos.chunk_tags(rt::Phase::forward, l, c),
        cost::streamed(z, 4.0 * q * z.B * z.h), [=] {
          LayerActivations& A = p->acts(set, layer);
          const std::int64_t first = c * q;
          const Tensor y = A.mlp_out.slice(0, first, q);
          p->apply_dropout(false, mb, layer, 1, y, y, first);
          ops::add(A.x_mid.slice(0, first, q), y, A.x_out.slice(0, first, q));
          if (p->rounds_residual_stream())
            round_in_place(p->precision(), A.x_out.slice(0, first, q));
        });
    P->after(combined, residual);
    P->after(stats, residual);
    last = residual;
  }
  return last;
}

TaskId AmpipeBlock::backward(const BuildPosition& pos, TaskId ready, WeightHalves& halves,
                             bool last) const {
  RankProgram* p = P;
  const int layer = l, mb = pos.micro_batch;
  const StepShape& z = P->shape;
  const int N = z.ampipe, cp = z.cp;
  const rt::TaskTags tags = pos.tags(rt::Phase::backward, l);
  const double cleared = cp > 1 ? static_cast<double>(z.cp * z.Sc * z.B * z.Gl * 2 * z.d) : 0.0;
  const TaskId start = P->compute(fmt::format("L{}.mlp_residual_backward", l), tags,
                                  cost::streamed(z, 4.0 * z.Sl * z.B * z.h + cleared), [=] {
                                    BackwardWorkspace& w = p->ws();
                                    w.d_x_mid.copy_from(w.d_x);
                                    p->apply_dropout(true, mb, layer, 1, w.d_x, w.d_mlp);
                                    // The chunks' attention accumulates every block's dk, dv.
                                    if (cp > 1) w.cp_ring.dkv_send.fill(0.f);
                                  });
  P->after(ready, start);
  // --ampipe-cp-resend-kv: the blocks travel again while the MoE backward computes.
  const TaskId blocks =
      cp > 1 && z.plan.ampipe_cp_resend_kv ? resend_blocks(*P, pos, l, start) : rt::kNoTask;
  const std::vector<SlotProgress> experts = moe_backward(pos, start, halves);
  TaskId side = rt::kNoTask;
  for (int c = N - 1; c >= 0; --c)
    side = chunk_backward(pos, c, experts[static_cast<std::size_t>(c)], blocks);
  if (cp > 1) side = send_block_gradients_home(pos, side);
  // A staged bucket (ZeRO stage 2) after every micro-batch, the others after the last.
  reduce_buckets(*P, fmt::format("layers.{}.mlp", l), side, last);
  // ZeRO stage 2 keeps the QKV weight half inside the layer's backward, which holds its slot.
  const WeightPlacement qkv_weights =
      z.tp == 1 && cp == 1 && !z.plan.shard_gradients ? halves.deferrable() : halves.immediate();
  return AttentionBlock(*P, l).backward_input(pos, side, halves, last, qkv_weights);
}

std::vector<SlotProgress> AmpipeBlock::moe_backward(const BuildPosition& pos, TaskId start,
                                                    WeightHalves& halves) const {
  const StepShape& z = P->shape;
  const int N = z.ampipe;
  const MoeMlp moe(*P, l);
  std::vector<SlotProgress> combined(static_cast<std::size_t>(N)),
      experts(static_cast<std::size_t>(N));
  for (int c = N - 1; c >= 0; --c)
    combined[c] = moe.combine_backward(pos, c, start);
  halves.flush();                  // the layer above's, while the combines' gradients are in flight
  if (items_in_one_pipeline(z)) {  // every chunk's items in one pipeline, the chunks in reverse
    std::vector<int> chunks;
    std::vector<SlotProgress> arrived;
    for (int c = N - 1; c >= 0; --c) {
      chunks.push_back(c);
      arrived.push_back(combined[c]);
    }
    const std::vector<SlotProgress> done =
        moe.split_item_pipeline_backward(pos, chunks, arrived, halves);
    for (std::size_t s = 0; s < chunks.size(); ++s)
      experts[static_cast<std::size_t>(chunks[s])] = done[s];
  } else {
    for (int c = N - 1; c >= 0; --c)
      experts[c] = moe.experts_backward(pos, c, combined[c], halves);
  }
  return experts;
}

TaskId AmpipeBlock::chunk_backward(const BuildPosition& pos, int c, const SlotProgress& experts,
                                   TaskId blocks) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set, mb = pos.micro_batch;
  const StepShape& z = P->shape;
  const std::int64_t q = z.piece_rows();
  const int N = z.ampipe;
  const rt::TaskTags tags = pos.chunk_tags(rt::Phase::backward, l, c);
  const std::string chunk = fmt::format("L{}.c{}.", l, c);
  const TaskId router = MoeMlp(*P, l).router_backward(pos, c, experts);
  TaskId attention_ready = router;
  if (z.routes_tp_slices())  // the chunk's input gradient from every tp rank's slice
    attention_ready = P->tensor.all_gather(router, read_of(P->slot(set, l, c).d_moe_in),
                                           all_of(P->ws().d_norm.slice(0, c * q, q)),
                                           chunk + "moe_grad_gather", tags);
  if (z.sp()) {
    const TaskId residual = P->compute(chunk + "attention_residual_backward", tags,
                                       cost::streamed(z, 10.0 * q * z.B * z.h),
                                       [=] { chunk_residual_backward(*p, set, layer, mb, c); });
    P->after(router, residual);
    attention_ready = P->tensor.all_gather(residual, read_of(P->ws().d_mlp.slice(0, c * q, q)),
                                           all_of(chunk_d_proj_rows(*P, c)),
                                           chunk + "attention_grad_gather", tags);
  }
  if (z.cp > 1) {
    // The chunk's half: its projection's backward into d_attn, then its share of the products.
    const TaskId projection =
        P->compute(chunk + "projection_backward", tags, 2 * cost::projection(z) / N,
                   [=] { chunk_projection_backward(*p, set, layer, mb, c); });
    P->after(attention_ready, projection);
    return ampipe_ring_attention_backward(*P, pos, l, c, projection, blocks);
  }
  const rt::CostHint flops = cost::ampipe_causal_share(z, c) * cost::causal_attention_backward(z) +
                             2 * cost::projection(z) / N;
  const TaskId attention = P->compute(chunk + "attention_backward", tags, flops,
                                      [=] { chunk_attention_backward(*p, set, layer, mb, c); });
  P->after(attention_ready, attention);
  return attention;
}

}  // namespace weave::graphs
