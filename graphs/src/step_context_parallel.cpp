// Context parallelism: ring attention over 2 x cp load-balanced chunks, forward and backward.
#include "training_step_impl.hpp"

namespace weave::graphs {

std::vector<TaskId> TrainingStep::Impl::ring_shift(const std::vector<TaskId>& producers,
                                                   std::function<Tensor(int)> from,
                                                   std::function<Tensor(int)> into,
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

void TrainingStep::Impl::merge_partial(const Tensor& o, const Tensor& lse, const Tensor& o_part,
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

Tensor TrainingStep::Impl::ring_block(int r, int set, int layer, int t) {
  return t == 0 ? acts(r, set, layer).kv_local : ranks[r].ws.ring[t % 2];
}

void TrainingStep::Impl::attend_half(int r, int set, int l, std::int64_t half, const Tensor& block,
                                     int owner) {
  LayerActivations& A = acts(r, set, l);
  BackwardWorkspace& w = ranks[r].ws;
  const int me = mesh.coordinates(r).cp;
  for (std::int64_t kc = 0; kc < 2; ++kc) {
    const Tensor keys = block.slice(0, kc * chunk, chunk);
    ops::attention_forward({.q_offset = context_position(me, half * chunk),
                            .k_offset = context_position(owner, kc * chunk)},
                           head_view(A.qkv.slice(0, half * chunk, chunk), 0), head_view(keys, 0),
                           head_view(keys, 1), w.o_part.transpose(0, 1), w.lse_part);
    merge_partial(A.attn.slice(0, half * chunk, chunk),
                  A.lse.slice(0, half, 1).reshape({B, Hl, chunk}), w.o_part, w.lse_part);
  }
}

void TrainingStep::Impl::attend_half_backward(int r, int set, int l, std::int64_t half,
                                              const Tensor& block, const Tensor& grads, int owner) {
  LayerActivations& A = acts(r, set, l);
  BackwardWorkspace& w = ranks[r].ws;
  const int me = mesh.coordinates(r).cp;
  const Tensor d_attn = w.d_attn.reshape({Sc, B, Hl, d}).slice(0, half * chunk, chunk);
  for (std::int64_t kc = 0; kc < 2; ++kc) {
    const Tensor keys = block.slice(0, kc * chunk, chunk);
    const Tensor key_grads = grads.slice(0, kc * chunk, chunk);
    // With the full (merged) output and log-sum-exp, each block's probabilities are the final
    // ones, so its gradients are exact parts of the whole.
    ops::attention_backward(
        {.q_offset = context_position(me, half * chunk),
         .k_offset = context_position(owner, kc * chunk)},
        head_view(A.qkv.slice(0, half * chunk, chunk), 0), head_view(keys, 0), head_view(keys, 1),
        A.attn.slice(0, half * chunk, chunk).transpose(0, 1),
        A.lse.slice(0, half, 1).reshape({B, Hl, chunk}), d_attn.transpose(0, 1),
        w.dq_part.transpose(0, 1), head_view(key_grads, 0), head_view(key_grads, 1));
    ops::accumulate(w.dq_part, w.d_qkv.slice(0, half * chunk, chunk).slice(3, 0, d));
  }
}

int TrainingStep::Impl::ring_owner(int r, int t) const {
  const int me = mesh.coordinates(r).cp;
  return ((me - t) % cp + cp) % cp;
}

std::vector<TaskId> TrainingStep::Impl::build_ring_attention_forward(int l,
                                                                     const std::vector<TaskId>& qkv,
                                                                     rt::TaskTags tags) {
  const int set = set_;
  const std::string at = fmt::format("L{}.", l);
  std::vector<TaskId> compute_prev, compute_prev2;
  std::vector<TaskId> arrived = qkv;
  for (int t = 0; t < cp; ++t) {
    if (t > 0) {
      // Pass the block on while step t - 1 computes with it; the receiver's buffer is free
      // once its step t - 2 is done.
      auto shift = ring_shift(
          arrived, [=, this](int r) { return ring_block(r, set, l, t - 1); },
          [=, this](int r) { return ranks[r].ws.ring[t % 2]; }, at + fmt::format("cp_ring{}", t),
          tags);
      if (t >= 2) link(compute_prev2, shift);
      link(qkv, shift);
      arrived = shift;
    }
    const bool last = t == cp - 1;
    auto step = each(at + (last ? "attention" : "attention_step"), tags, [=, this](int r) {
      LayerActivations& A = acts(r, set, l);
      const LayerShard& P = ranks[r].shard->layer(l);
      if (t == 0) {
        A.attn.fill(0.f);
        A.lse.fill(-std::numeric_limits<float>::infinity());
      }
      for (std::int64_t half = 0; half < 2; ++half)
        attend_half(r, set, l, half, ring_block(r, set, l, t), ring_owner(r, t));
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

std::vector<TaskId> TrainingStep::Impl::build_ring_attention_backward(
    int l, const std::vector<TaskId>& start, rt::TaskTags tags) {
  const int set = set_;
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
          kv_arrived, [=, this](int r) { return ring_block(r, set, l, t - 1); },
          [=, this](int r) { return ranks[r].ws.ring[t % 2]; }, at + fmt::format("cp_ring_kv{}", t),
          tags);
      if (t >= 2) link(compute_prev2, shift);
      kv_arrived = shift;
    }
    auto step = each(at + "attention_backward_step", tags, [=, this](int r) {
      BackwardWorkspace& w = ranks[r].ws;
      if (t == 0) w.dring[0].fill(0.f);
      for (std::int64_t half = 0; half < 2; ++half)
        attend_half_backward(r, set, l, half, ring_block(r, set, l, t), w.dring[t % 2],
                             ring_owner(r, t));
    });
    link(kv_arrived, step);
    link(grad_arrived, step);
    compute_prev2 = compute_prev;
    compute_prev = step;
  }
  return grad_arrived;
}

}  // namespace weave::graphs
