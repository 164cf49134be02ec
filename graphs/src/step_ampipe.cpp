// Ampipe: the attention-to-MoE region of a MoE layer in sequence chunks whose all-to-alls overlap
// other chunks' compute.
#include "training_step_impl.hpp"

namespace weave::graphs {

std::vector<TaskId> TrainingStep::Impl::build_ampipe_layer_forward(int l, int mb,
                                                                   std::vector<TaskId> prev) {
  const rt::TaskTags tags{.layer = static_cast<std::uint16_t>(l),
                          .micro_batch = static_cast<std::uint16_t>(mb),
                          .phase = rt::Phase::forward};
  const auto L = layer_at(l);
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

std::vector<TaskId> TrainingStep::Impl::build_ampipe_layer_backward(int l, int mb,
                                                                    std::vector<TaskId> prev,
                                                                    bool last_micro_batch) {
  const int set = set_;
  const rt::TaskTags tags{.layer = static_cast<std::uint16_t>(l),
                          .micro_batch = static_cast<std::uint16_t>(mb),
                          .phase = rt::Phase::backward};
  const auto L = layer_at(l);
  auto P = [this, l](int r) -> const LayerShard& { return ranks[r].shard->layer(l); };
  auto W = [this](int r) -> BackwardWorkspace& { return ranks[r].ws; };
  const std::string at = fmt::format("L{}.", l);
  const std::int64_t q = piece_rows(), n = t_sp * q;
  auto start = each(at + "mlp_residual_backward", tags, [=, this](int r) {
    BackwardWorkspace& w = W(r);
    w.d_x_mid.copy_from(w.d_x);
    apply_dropout(true, r, mb, l, 1, w.d_x, w.d_mlp);
    if (cp > 1) w.dkv_send.fill(0.f);  // the chunks' attention accumulates every block's dk, dv
  });
  link(prev, start);
  const int N = ampipe();
  std::vector<std::vector<TaskId>> combined(static_cast<std::size_t>(N)),
      experts(static_cast<std::size_t>(N));
  for (int c = N - 1; c >= 0; --c)
    combined[c] = moe_combine_backward(l, c, start, tags);
  flush_weight_grads();  // the layer above's, while the combines' gradients are in flight
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
      d_norm.reshape({q * B, h}).copy_from(slot(r, set, l, c).d_moe_in);
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
      // The chunks' attention accumulates dk and dv; zeroed here, not earlier, as the layer
      // above's deferred weight gradient reads d_qkv until this layer's combines are launched.
      if (c == N - 1) w.d_qkv.fill(0.f);
      if (t_sp == 1) residual_backward(r);
      if (cp > 1) {
        ampipe_ring_attention_backward(r, set, l, c);
        return;
      }
      for (int j = 0; j < t_sp; ++j) {
        const std::int64_t first = piece_start(c, j);
        const Tensor d_proj = d_proj_rows(r).slice(0, j * q, q);
        const Tensor d_attn = w.d_attn.reshape({Sc, B, Hl * d}).slice(0, first, q);
        ops::linear_backward_input(d_proj, P(r).proj_weight->value, d_attn);
        ops::linear_backward_weight(A.attn.slice(0, first, q).reshape({q, B, Hl * d}), d_proj,
                                    P(r).proj_weight->grad, Tensor{});
        ops::attention_backward(
            {.q_offset = first}, head_view(A.qkv.slice(0, first, q), 0), head_view(A.qkv, 1),
            head_view(A.qkv, 2), A.attn.slice(0, first, q).transpose(0, 1),
            A.lse.slice(0, c * t_sp + j, 1).reshape({B, Hl, q}),
            d_attn.reshape({q, B, Hl, d}).transpose(0, 1), head_view(w.d_qkv.slice(0, first, q), 0),
            head_view(w.d_qkv, 1), head_view(w.d_qkv, 2));
      }
    });
    link(ready, attn);
    side = attn;
  }
  if (cp > 1) side = send_block_gradients_home(l, side, tags);
  if (last_micro_batch) reduce_buckets(fmt::format("layers.{}.mlp", l), side);
  return build_attention_input_backward(l, side, last_micro_batch, tags);
}

Tensor TrainingStep::Impl::kv_block(int r, int set, int l, int owner) {
  return acts(r, set, l).kv_store.slice(0, owner * Sc, Sc);
}

std::vector<TaskId> TrainingStep::Impl::ampipe_ring_attention(int l, int c,
                                                              const std::vector<TaskId>& qkv,
                                                              rt::TaskTags tags,
                                                              std::function<void(int)> finish) {
  const int set = set_;
  const std::string at = fmt::format("L{}.c{}.", l, c);
  auto begin_half = [=, this](int r) {
    LayerActivations& A = acts(r, set, l);
    A.attn.slice(0, c * chunk, chunk).fill(0.f);
    A.lse.slice(0, c, 1).fill(-std::numeric_limits<float>::infinity());
  };
  if (c == 1) {  // every block is here: chunk 0's ring brought them
    auto task = each(at + "attention", tags, [=, this](int r) {
      begin_half(r);
      for (int owner = 0; owner < cp; ++owner)
        attend_half(r, set, l, 1, kv_block(r, set, l, owner), owner);
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
          arrived, [=, this](int r) { return kv_block(r, set, l, ring_owner(r, t - 1)); },
          [=, this](int r) { return kv_block(r, set, l, ring_owner(r, t)); },
          at + fmt::format("cp_ring{}", t), tags);
      link(qkv, shift);
      arrived = shift;
    }
    const bool last = t == cp - 1;
    step = each(at + (last ? "attention" : "attention_step"), tags, [=, this](int r) {
      if (t == 0) begin_half(r);
      attend_half(r, set, l, 0, kv_block(r, set, l, ring_owner(r, t)), ring_owner(r, t));
      if (last) finish(r);
    });
    link(arrived, step);
  }
  return step;
}

void TrainingStep::Impl::ampipe_ring_attention_backward(int r, int set, int l, int c) {
  LayerActivations& A = acts(r, set, l);
  BackwardWorkspace& w = ranks[r].ws;
  const LayerShard& P = ranks[r].shard->layer(l);
  const Tensor d_proj = w.d_mlp.slice(0, c * chunk, chunk);
  const Tensor d_attn = w.d_attn.reshape({Sc, B, Hl * d}).slice(0, c * chunk, chunk);
  const Tensor attn = A.attn.slice(0, c * chunk, chunk);
  ops::linear_backward_input(d_proj, P.proj_weight->value, d_attn);
  ops::linear_backward_weight(attn.reshape({chunk, B, Hl * d}), d_proj, P.proj_weight->grad,
                              Tensor{});
  for (int owner = 0; owner < cp; ++owner)
    attend_half_backward(r, set, l, c, kv_block(r, set, l, owner),
                         w.dkv_send.slice(0, owner * Sc, Sc), owner);
}

std::vector<TaskId> TrainingStep::Impl::send_block_gradients_home(int l,
                                                                  const std::vector<TaskId>& ready,
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

}  // namespace weave::graphs
