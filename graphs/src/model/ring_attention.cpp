#include "model/ring_attention.hpp"

#include <cmath>
#include <limits>

#include "model/attention_block.hpp"
#include "model/half_precision.hpp"
#include "step/step_costs.hpp"
#include "weave/ops/attention.hpp"
#include "weave/ops/elementwise.hpp"
#include "weave/ops/linear.hpp"

namespace weave::graphs {

TaskId RingAttention::shift(TaskId ready, const Tensor& from, const Tensor& into,
                            const std::string& name, rt::TaskTags tags) const {
  BackwardWorkspace& w = P->ws();
  const StepShape& z = P->shape;
  return P->context.all_to_all_v(ready,
                                 {.send = read_of(from),
                                  .send_counts = &w.cp_ring.ring_send,
                                  .recv = all_of(into),
                                  .recv_counts = std::span<std::int64_t>(w.cp_ring.ring_recv)},
                                 z.B * z.Gl * 2 * z.d, name, tags);
}

int RingAttention::owner(int t) const {
  const int me = P->at.cp, cp = P->shape.cp;
  return ((me - t) % cp + cp) % cp;
}

Tensor RingAttention::block(int set, int t) const {
  return t == 0 ? P->acts(set, l).attention.kv_local : P->ws().cp_ring.ring[t % 2];
}

void RingAttention::merge_partial(const Tensor& o, const Tensor& lse, const Tensor& o_part,
                                  const Tensor& lse_part) const {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const StepShape& z = P->shape;
  for (std::int64_t bi = 0; bi < z.B; ++bi)
    for (std::int64_t hh = 0; hh < z.Hl; ++hh)
      for (std::int64_t i = 0; i < z.chunk; ++i) {
        float& l1 = lse(bi, hh, i);
        const float l2 = lse_part(bi, hh, i);
        if (l2 == kNegInf) continue;
        const float top = std::max(l1, l2);
        const float merged = top + std::log(std::exp(l1 - top) + std::exp(l2 - top));
        const float w1 = l1 == kNegInf ? 0.f : std::exp(l1 - merged), w2 = std::exp(l2 - merged);
        float* acc = &o(i, bi, hh, 0);
        const float* part = &o_part(i, bi, hh, 0);
        for (std::int64_t x = 0; x < z.d; ++x)
          acc[x] = w1 * acc[x] + w2 * part[x];
        l1 = merged;
      }
}

void RingAttention::attend_half(int set, int mb, std::int64_t half, const Tensor& kv,
                                int from) const {
  for (std::int64_t key_half = 0; key_half < 2; ++key_half)
    attend_piece(set, mb, half, kv, from, key_half);
}

void RingAttention::attend_piece(int set, int mb, std::int64_t half, const Tensor& kv, int from,
                                 std::int64_t key_half) const {
  const StepShape& z = P->shape;
  const std::int64_t chunk = z.chunk, d = z.d;
  LayerActivations& A = P->acts(set, l);
  BackwardWorkspace& w = P->ws();
  const int me = P->at.cp;
  const Tensor keys = kv.slice(0, key_half * chunk, chunk);
  if (P->half()) {
    // The bf16 attention kernel on the block's bf16 keys and values (carried as bf16 values in
    // fp32), its partial output rounded to bf16 and merged in fp32 with the fp32 statistics.
    const ops::AttentionOptions options{.q_offset = z.context_position(me, half * chunk),
                                        .k_offset = z.context_position(from, key_half * chunk),
                                        .dropout = attention_dropout(*P, l, mb)};
    const ops::Bf16Tensor kv16 = ops::Bf16Tensor::empty(keys.shape());
    round_to_half(P->precision(), keys, kv16);
    const ops::Bf16Tensor o16 = ops::Bf16Tensor::empty(w.cp_ring.o_part.shape());
    half_attention_forward(P->precision(), options,
                           query_view(A.attention.qkv16.slice(0, half * chunk, chunk), z),
                           kv16.slice(3, 0, d).transpose(0, 1), kv16.slice(3, d, d).transpose(0, 1),
                           output_view(o16, z), w.cp_ring.lse_part);
    widen_to_fp32(P->precision(), o16, w.cp_ring.o_part);
    merge_partial(w.cp_ring.merged.slice(0, half * chunk, chunk),
                  A.attention.lse.slice(0, half, 1).reshape({z.B, z.Hl, chunk}), w.cp_ring.o_part,
                  w.cp_ring.lse_part);
    return;
  }
  ops::attention_forward({.q_offset = z.context_position(me, half * chunk),
                          .k_offset = z.context_position(from, key_half * chunk),
                          .dropout = attention_dropout(*P, l, mb)},
                         query_view(A.attention.qkv.slice(0, half * chunk, chunk), z),
                         head_view(keys, d, 0), head_view(keys, d, 1),
                         output_view(w.cp_ring.o_part, z), w.cp_ring.lse_part);
  merge_partial(A.attention.attn.slice(0, half * chunk, chunk),
                A.attention.lse.slice(0, half, 1).reshape({z.B, z.Hl, chunk}), w.cp_ring.o_part,
                w.cp_ring.lse_part);
}

void RingAttention::attend_half_backward(int set, int mb, std::int64_t half, const Tensor& kv,
                                         const Tensor& grads, int from) const {
  for (std::int64_t key_half = 0; key_half < 2; ++key_half)
    attend_piece_backward(set, mb, half, kv, grads, from, key_half);
}

void RingAttention::attend_piece_backward(int set, int mb, std::int64_t half, const Tensor& kv,
                                          const Tensor& grads, int from,
                                          std::int64_t key_half) const {
  const StepShape& z = P->shape;
  const std::int64_t chunk = z.chunk, d = z.d;
  LayerActivations& A = P->acts(set, l);
  BackwardWorkspace& w = P->ws();
  const int me = P->at.cp;
  const Tensor keys = kv.slice(0, key_half * chunk, chunk);
  const Tensor key_grads = grads.slice(0, key_half * chunk, chunk);
  if (P->half()) {
    // The bf16 attention backward: dq in bf16 (widened and summed over the blocks in fp32), the
    // block's dk and dv accumulated in fp32.
    const ops::AttentionOptions options{.q_offset = z.context_position(me, half * chunk),
                                        .k_offset = z.context_position(from, key_half * chunk),
                                        .dropout = attention_dropout(*P, l, mb)};
    const ops::Bf16Tensor kv16 = ops::Bf16Tensor::empty(keys.shape());
    round_to_half(P->precision(), keys, kv16);
    const ops::Bf16Tensor dq16 = ops::Bf16Tensor::empty(w.cp_ring.dq_part.shape());
    half_attention_backward(
        P->precision(), options, query_view(A.attention.qkv16.slice(0, half * chunk, chunk), z),
        kv16.slice(3, 0, d).transpose(0, 1), kv16.slice(3, d, d).transpose(0, 1),
        output_view(A.attention.attn16.slice(0, half * chunk, chunk), z),
        A.attention.lse.slice(0, half, 1).reshape({z.B, z.Hl, chunk}),
        output_view(w.half.d_attn16.slice(0, half * chunk, chunk), z), output_view(dq16, z),
        head_view(key_grads, d, 0), head_view(key_grads, d, 1));
    widen_to_fp32(P->precision(), dq16, w.cp_ring.dq_part);
    ops::accumulate(w.cp_ring.dq_part.reshape({chunk, z.B, z.Gl, z.qpg * d}),
                    w.attention.d_qkv.slice(0, half * chunk, chunk).slice(3, 0, z.qpg * d));
    return;
  }
  // With the full (merged) output and log-sum-exp, each block's probabilities are the final
  // ones, so its gradients are exact parts of the whole.
  const Tensor d_attn = w.attention.d_attn.slice(0, half * chunk, chunk);
  ops::attention_backward(
      {.q_offset = z.context_position(me, half * chunk),
       .k_offset = z.context_position(from, key_half * chunk),
       .dropout = attention_dropout(*P, l, mb)},
      query_view(A.attention.qkv.slice(0, half * chunk, chunk), z), head_view(keys, d, 0),
      head_view(keys, d, 1), output_view(A.attention.attn.slice(0, half * chunk, chunk), z),
      A.attention.lse.slice(0, half, 1).reshape({z.B, z.Hl, chunk}), output_view(d_attn, z),
      output_view(w.cp_ring.dq_part, z), head_view(key_grads, d, 0), head_view(key_grads, d, 1));
  ops::accumulate(w.cp_ring.dq_part.reshape({chunk, z.B, z.Gl, z.qpg * d}),
                  w.attention.d_qkv.slice(0, half * chunk, chunk).slice(3, 0, z.qpg * d));
}

TaskId RingAttention::forward(const BuildPosition& pos, TaskId qkv) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set, mb = pos.micro_batch;
  const StepShape& z = P->shape;
  const int cp = z.cp;
  const std::int64_t Sc = z.Sc, B = z.B, Hl = z.Hl, d = z.d;
  const rt::TaskTags tags = pos.tags(rt::Phase::forward, l);
  const std::string at = fmt::format("L{}.", l);
  const rt::CostHint per_step = cost::causal_attention(z) / cp;
  TaskId compute_prev = rt::kNoTask, compute_prev2 = rt::kNoTask, arrived = qkv;
  for (int t = 0; t < cp; ++t) {
    if (t > 0) {
      // Pass the block on while step t - 1 computes with it; the receiver's buffer is free
      // once its step t - 2 is done.
      const TaskId moved = shift(arrived, block(set, t - 1), P->ws().cp_ring.ring[t % 2],
                                 at + fmt::format("cp_ring{}", t), tags);
      if (t >= 2) P->after(compute_prev2, moved);
      P->after(qkv, moved);
      arrived = moved;
    }
    const bool last = t == cp - 1;
    const TaskId step = P->compute(
        at + (last ? "attention" : "attention_step"), tags,
        per_step + (last ? cost::projection(z) : rt::CostHint{}), [=] {
          const RingAttention ring(*p, layer);
          LayerActivations& A = p->acts(set, layer);
          if (t == 0) {
            (p->half() ? p->ws().cp_ring.merged : A.attention.attn).fill(0.f);
            A.attention.lse.fill(-std::numeric_limits<float>::infinity());
          }
          for (std::int64_t half = 0; half < 2; ++half)
            ring.attend_half(set, mb, half, ring.block(set, t), ring.owner(t));
          if (last && p->half()) {  // rounded once; the projection in bf16
            const HalfWorkspace& half = p->ws().half;
            round_to_half(p->precision(), p->ws().cp_ring.merged, A.attention.attn16);
            half_linear_forward(p->precision(), A.attention.attn16.reshape({Sc, B, Hl * d}),
                                p->attention_parameters(layer).proj_weight->value16,
                                ops::Bf16Tensor{}, half.out16);
            widen_to_fp32(p->precision(), half.out16, A.attention.proj_partial);
          } else if (last)
            ops::linear_forward(A.attention.attn.reshape({Sc, B, Hl * d}),
                                p->attention_parameters(layer).proj_weight->value, Tensor{},
                                A.attention.proj_partial);
        });
    P->after(arrived, step);
    compute_prev2 = compute_prev;
    compute_prev = step;
  }
  return compute_prev;
}

TaskId RingAttention::backward(const BuildPosition& pos, TaskId start) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set, mb = pos.micro_batch;
  const StepShape& z = P->shape;
  const int cp = z.cp;
  const rt::TaskTags tags = pos.tags(rt::Phase::backward, l);
  const std::string at = fmt::format("L{}.", l);
  BackwardWorkspace& w = P->ws();
  TaskId compute_prev = start, compute_prev2 = rt::kNoTask;
  TaskId kv_arrived = start, grad_arrived = start;
  for (int t = 0; t <= cp; ++t) {
    if (t > 0) {
      // The gradient of the block computed at step t - 1 moves on.
      const TaskId moved = shift(compute_prev, w.cp_ring.dring[(t - 1) % 2], w.cp_ring.dring[t % 2],
                                 at + fmt::format("cp_ring_grad{}", t), tags);
      if (t >= 2) P->after(compute_prev2, moved);
      grad_arrived = moved;
    }
    if (t == cp) break;
    if (t > 0) {
      const TaskId moved = shift(kv_arrived, block(set, t - 1), w.cp_ring.ring[t % 2],
                                 at + fmt::format("cp_ring_kv{}", t), tags);
      if (t >= 2) P->after(compute_prev2, moved);
      kv_arrived = moved;
    }
    const TaskId step = P->compute(
        at + "attention_backward_step", tags, cost::causal_attention_backward(z) / cp, [=] {
          const RingAttention ring(*p, layer);
          BackwardWorkspace& w = p->ws();
          if (t == 0) w.cp_ring.dring[0].fill(0.f);
          for (std::int64_t half = 0; half < 2; ++half)
            ring.attend_half_backward(set, mb, half, ring.block(set, t), w.cp_ring.dring[t % 2],
                                      ring.owner(t));
        });
    P->after(kv_arrived, step);
    P->after(grad_arrived, step);
    compute_prev2 = compute_prev;
    compute_prev = step;
  }
  return grad_arrived;
}

}  // namespace weave::graphs
