// The layers: embedding, the pre-norm transformer layers (dense or MoE MLP), the loss, and their
// backward.
#include "training_step_impl.hpp"

namespace weave::graphs {

std::int64_t TrainingStep::Impl::context_position(int cp_rank, std::int64_t s) const {
  if (cp == 1) return s;
  const std::int64_t which = s / chunk == 0 ? cp_rank : 2 * cp - 1 - cp_rank;
  return which * chunk + s % chunk;
}

std::int64_t TrainingStep::Impl::position(int r, std::int64_t s) const {
  const MeshCoordinates at = mesh.coordinates(r);
  return context_position(at.cp, (t_sp > 1 ? at.tp * Sl : 0) + s);
}

void TrainingStep::Impl::load_tokens(int r, int mb, std::vector<std::int32_t>* tokens,
                                     std::vector<std::int32_t>* targets) {
  const MicroBatch& data = batches[mesh.coordinates(r).dp][mb];
  const std::vector<std::int32_t>& from = tokens ? data.tokens : data.targets;
  std::vector<std::int32_t>& into = tokens ? *tokens : *targets;
  into.resize(static_cast<std::size_t>(Sc * B));
  const int at_cp = mesh.coordinates(r).cp;
  for (std::int64_t s = 0; s < Sc; ++s) {
    const std::int64_t g = context_position(at_cp, s);
    for (std::int64_t bi = 0; bi < B; ++bi)
      into[s * B + bi] = from[g * B + bi];
  }
}

void TrainingStep::Impl::apply_dropout(bool backward, int r, int mb, int layer, int site,
                                       const Tensor& in, const Tensor& out,
                                       std::int64_t first_row) {
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

void TrainingStep::Impl::bias_dropout_add(int r, int mb, int layer, int site, const Tensor& y,
                                          const Tensor& bias, const Tensor& x_in,
                                          const Tensor& x_out, std::int64_t first_row) {
  const std::int64_t rows = y.rows();
  for (std::int64_t i = 0; i < rows; ++i) {
    float* row = y.row(i);
    for (std::int64_t c = 0; c < h; ++c)
      row[c] += bias.data()[c];
  }
  apply_dropout(false, r, mb, layer, site, y, y, first_row);
  ops::add(x_in, y, x_out);
}

void TrainingStep::Impl::bias_dropout_add_backward(int r, int mb, int layer, int site,
                                                   const Tensor& d_out, const Tensor& d_y,
                                                   const Tensor& d_bias, std::int64_t first_row) {
  apply_dropout(true, r, mb, layer, site, d_out, d_y, first_row);
  for (std::int64_t i = 0; i < d_y.rows(); ++i) {
    const float* row = d_y.row(i);
    for (std::int64_t c = 0; c < h; ++c)
      d_bias.data()[c] += row[c];
  }
}

std::vector<TaskId> TrainingStep::Impl::build_forward(int k, int mb,
                                                      const std::vector<TaskId>& ready) {
  const rt::TaskTags tags{.micro_batch = mb, .phase = rt::Phase::forward};
  const int set = set_;
  std::vector<TaskId> prev = ready;
  if (k == 0) {
    // Embedding: each rank looks up its vocabulary shard; the group sums (or reduce-scatters).
    auto emb = each("embedding", tags, [this, mb, set](int r) {
      ActivationSet& X = aset(r, set);
      load_tokens(r, mb, &X.tokens, nullptr);
      ops::embedding_forward<float>(X.tokens, ranks[r].shard->embedding().value,
                                    {ranks[r].shard->vocab_start(), m.padded_vocab_size(tp)},
                                    X.emb_partial);
    });
    link(ready, emb);
    auto emb_comm = reduce_partial(
        emb, [this, set](int r) { return aset(r, set).emb_partial; },
        [this, set](int r) { return aset(r, set).x_in; }, "embedding_reduce", tags);
    auto pos = each("positions", tags, [this, mb, set](int r) {
      ActivationSet& X = aset(r, set);
      for (std::int64_t s = 0; s < Sl; ++s)
        for (std::int64_t bi = 0; bi < B; ++bi) {
          float* row = X.x_in.data() + (s * B + bi) * h;
          const float* p = ranks[r].shard->positions().value.row(position(r, s));
          for (std::int64_t c = 0; c < h; ++c)
            row[c] += p[c];
        }
      apply_dropout(false, r, mb, m.num_layers, 2, X.x_in, X.x_in);
    });
    link(emb_comm, pos);
    prev = pos;
  }
  for (int l = layout.first_layer(k); l < layout.end_layer(k); ++l)
    prev = build_layer_forward(l, mb, prev);
  if (k + 1 == layout.chunks()) return build_loss(mb, prev);
  return prev;
}

std::vector<TaskId> TrainingStep::Impl::build_layer_forward(int l, int mb,
                                                            std::vector<TaskId> prev) {
  if (ampipe() > 1 && m.is_moe_layer(l)) return build_ampipe_layer_forward(l, mb, prev);
  rt::TaskTags tags{.layer = static_cast<std::uint16_t>(l),
                    .micro_batch = static_cast<std::uint16_t>(mb),
                    .phase = rt::Phase::forward};
  const auto L = layer_at(l);
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
  if (m.is_moe_layer(l)) {
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

std::vector<TaskId> TrainingStep::Impl::build_attention_input(int l,
                                                              const std::vector<TaskId>& prev,
                                                              rt::TaskTags tags) {
  const auto L = layer_at(l);
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

std::vector<TaskId> TrainingStep::Impl::build_attention_input_backward(
    int l, const std::vector<TaskId>& ready_in, bool last, rt::TaskTags tags) {
  const auto L = layer_at(l);
  auto P = [this, l](int r) -> const LayerShard& { return ranks[r].shard->layer(l); };
  auto W = [this](int r) -> BackwardWorkspace& { return ranks[r].ws; };
  const std::string at = fmt::format("L{}.", l);
  const bool split = split_;
  auto qkv_in = each(at + "qkv_backward", tags, [=, this](int r) {
    BackwardWorkspace& w = W(r);
    if (cp > 1) {  // the block's gradients came home with the last turn of the ring
      const Tensor& home = w.dring[cp % 2];
      w.d_qkv.slice(3, d, d).copy_from(home.slice(3, 0, d));
      w.d_qkv.slice(3, 2 * d, d).copy_from(home.slice(3, d, d));
    }
    ops::linear_backward_input(w.d_qkv.reshape({Sc, B, 3 * Hl * d}), P(r).qkv_weight->value,
                               w.d_norm_full);
    if (split) L(r).saved_d_qkv.copy_from(w.d_qkv.reshape({Sc, B, 3 * Hl * d}));
  });
  link(ready_in, qkv_in);
  auto red = reduce_partial(
      qkv_in, [=](int r) { return W(r).d_norm_full; }, [=](int r) { return W(r).d_norm; },
      at + "attention_grad_reduce", tags);
  auto emit_weight_grad = [=, this] {
    return each(at + "qkv_weight_grad", tags, [=, this](int r) {
      ops::linear_backward_weight(L(r).ln1_full, W(r).d_qkv.reshape({Sc, B, 3 * Hl * d}),
                                  P(r).qkv_weight->grad, P(r).qkv_bias->grad);
    });
  };
  // With tp > 1 the weight gradient overlaps the input gradient's reduction; with neither tp
  // nor cp it waits for the layer below to launch its first all-to-all (see
  // flush_weight_grads), and the layer's input gradient goes on at once.
  if (split) {
    weight_grad(at + "qkv_weight_grad", tags, [=, this](int r) {
      ops::linear_backward_weight(L(r).ln1_full, L(r).saved_d_qkv, P(r).qkv_weight->grad,
                                  P(r).qkv_bias->grad);
    });
  }
  const bool defer = tp == 1 && cp == 1 && !split;
  std::vector<TaskId> ready = red;
  if (split) {
    for (std::size_t r = 0; r < red.size(); ++r)
      if (red[r] == rt::kNoTask) ready[r] = qkv_in[r];
  } else if (!defer) {
    auto wg = emit_weight_grad();
    for (std::size_t r = 0; r < red.size(); ++r)
      if (red[r] == rt::kNoTask) ready[r] = wg[r];
  } else {
    ready = qkv_in;
  }
  auto ln1 = each(at + "input_norm_backward", tags, [=, this](int r) {
    LayerActivations& A = L(r);
    BackwardWorkspace& w = W(r);
    ops::layer_norm_backward(A.x_in, P(r).ln1_weight->value, A.ln1_mean, A.ln1_rstd, w.d_norm,
                             w.d_tmp, P(r).ln1_weight->grad, P(r).ln1_bias->grad);
    ops::accumulate(w.d_tmp, w.d_x);
  });
  link(ready, ln1);
  if (!defer) {
    if (last) reduce_buckets(fmt::format("layers.{}.attention", l), ln1);
    return ln1;
  }
  deferred_weight_grads.push_back([=, this] {
    // After ln1 on the compute stream, so the bucket's every gradient is in once wg is done.
    auto wg = emit_weight_grad();
    if (last) reduce_buckets(fmt::format("layers.{}.attention", l), wg);
  });
  return ln1;
}

void TrainingStep::Impl::flush_weight_grads() {
  for (const auto& emit : deferred_weight_grads)
    emit();
  deferred_weight_grads.clear();
}

void TrainingStep::Impl::activation_forward(const Tensor& pre, const Tensor& out) {
  if (m.activation == Activation::swiglu)
    swiglu_local(pre, out);
  else
    ops::gelu_forward(ops::GeluForm::tanh, pre, out);
}

void TrainingStep::Impl::activation_backward(const Tensor& pre, const Tensor& d_out,
                                             const Tensor& d_pre) {
  if (m.activation == Activation::swiglu)
    ops::swiglu_backward(pre, d_out, d_pre);
  else
    ops::gelu_backward(ops::GeluForm::tanh, pre, d_out, d_pre);
}

std::vector<TaskId> TrainingStep::Impl::build_loss(int mb, const std::vector<TaskId>& prev) {
  const rt::TaskTags tags{.micro_batch = mb, .phase = rt::Phase::forward};
  const int set = set_, out = output_, last_layer = m.num_layers - 1;
  auto fn = each("final_norm", tags, [this, mb, set, out, last_layer](int r) {
    OutputSet& X = oset(r, out);
    ModelShard& P = *ranks[r].shard;
    load_tokens(r, mb, nullptr, &X.targets);
    ops::layer_norm_forward(acts(r, set, last_layer).x_out, P.final_ln_weight().value,
                            P.final_ln_bias().value, m.layernorm_epsilon, X.final_ln, X.final_mean,
                            X.final_rstd);
  });
  link(prev, fn);
  std::vector<TaskId> g(ranks.size(), rt::kNoTask);
  if (t_sp > 1)
    g = tp_all_gather(
        fn, [this, out](int r) { return oset(r, out).final_ln; },
        [this, out](int r) { return oset(r, out).final_full; }, "final_gather", tags);
  auto logits = each("logits", tags, [this, out](int r) {
    OutputSet& X = oset(r, out);
    ops::linear_forward(X.final_full.reshape({Sc * B, h}), ranks[r].shard->embedding().value,
                        Tensor{}, X.logits);
    ops::cross_entropy_row_max(X.logits, X.row_max);
  });
  link(g, logits);
  auto maxima = tp_all_reduce(
      logits, [this, out](int r) { return oset(r, out).row_max; }, devices::ReduceOp::max,
      "loss_max", tags);
  auto sums = each("loss_partials", tags, [this, out](int r) {
    OutputSet& X = oset(r, out);
    ops::cross_entropy_partial_sums<float>(X.logits, X.targets,
                                           {ranks[r].shard->vocab_start(), m.padded_vocab_size(tp)},
                                           X.row_max, X.partials);
  });
  link(maxima, sums);
  auto reduced = tp_all_reduce(
      sums, [this, out](int r) { return oset(r, out).partials; }, devices::ReduceOp::sum,
      "loss_sum", tags);
  auto loss = each("loss", tags, [this, mb, out](int r) {
    OutputSet& X = oset(r, out);
    ranks[r].loss[mb] = ops::cross_entropy_loss<float>(
        X.row_max, X.partials, X.targets, m.padded_vocab_size(tp), ce_options(), X.lse, Tensor{});
  });
  link(reduced, loss);
  return loss;
}

ops::CrossEntropyOptions TrainingStep::Impl::ce_options() const {
  // The mean over the global batch: micro-batches and data-parallel ranks add up to it.
  return {.ignore_index = -100, .denominator = static_cast<double>(S * B * M * plan.data_parallel)};
}

std::vector<TaskId> TrainingStep::Impl::build_backward(int k, int mb,
                                                       const std::vector<TaskId>& ready,
                                                       bool last) {
  const rt::TaskTags tags{.micro_batch = mb, .phase = rt::Phase::backward};
  const int set = set_, out = output_;
  std::vector<TaskId> prev;
  if (k + 1 == layout.chunks()) {
    // Loss -> final norm input gradient.
    const bool split = split_;
    auto dlogits = each("loss_backward", tags, [this, out, split](int r) {
      OutputSet& X = oset(r, out);
      BackwardWorkspace& w = ranks[r].ws;
      ModelShard& P = *ranks[r].shard;
      ops::cross_entropy_backward<float>(X.logits, X.targets,
                                         {P.vocab_start(), m.padded_vocab_size(tp)}, X.lse,
                                         ce_options(), 1.0, w.d_logits);
      ops::linear_backward_input(w.d_logits, P.embedding().value,
                                 w.d_final_full.reshape({Sc * B, h}));
      if (split) X.saved_d_logits.copy_from(w.d_logits);
    });
    link(ready, dlogits);
    auto reduce = reduce_partial(
        dlogits, [this](int r) { return ranks[r].ws.d_final_full; },
        [this](int r) { return t_sp > 1 ? ranks[r].ws.d_norm : ranks[r].ws.d_final_full; },
        "final_grad_reduce", tags);
    // The output layer's weight gradient overlaps the reduction above.
    weight_grad("logits_weight_grad", tags, [this, out, split](int r) {
      OutputSet& X = oset(r, out);
      ops::linear_backward_weight(X.final_full.reshape({Sc * B, h}),
                                  split ? X.saved_d_logits : ranks[r].ws.d_logits,
                                  ranks[r].shard->embedding().grad, Tensor{});
    });
    const int last_layer = m.num_layers - 1;
    auto fn = each("final_norm_backward", tags, [this, set, out, last_layer](int r) {
      OutputSet& X = oset(r, out);
      BackwardWorkspace& w = ranks[r].ws;
      ModelShard& P = *ranks[r].shard;
      const Tensor d_in = t_sp > 1 ? w.d_norm : w.d_final_full;
      ops::layer_norm_backward(acts(r, set, last_layer).x_out, P.final_ln_weight().value,
                               X.final_mean, X.final_rstd, d_in, w.d_x, P.final_ln_weight().grad,
                               P.final_ln_bias().grad);
    });
    link(reduce, fn);
    prev = fn;
    if (last) {
      reduce_buckets("final_norm", prev);
      word_grad_ready(prev);
    }
  } else {
    // The gradient of the chunk's output, from the next stage.
    prev = each("stage_grad_in", tags,
                [this, set](int r) { ranks[r].ws.d_x.copy_from(aset(r, set).d_recv); });
    link(ready, prev);
  }
  for (int l = layout.end_layer(k) - 1; l >= layout.first_layer(k); --l)
    prev = build_layer_backward(l, mb, prev, last);
  flush_weight_grads();
  if (k > 0) {
    // The gradient of the chunk's input, for the previous stage.
    auto out = each("stage_grad_out", tags,
                    [this, set](int r) { aset(r, set).d_send.copy_from(ranks[r].ws.d_x); });
    link(prev, out);
    return out;
  }
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
  auto emb = each("embedding_backward", tags, [this, set](int r) {
    RankState& R = ranks[r];
    const Tensor d = t_sp > 1 ? R.ws.d_norm_full : R.ws.d_x;
    ops::embedding_backward<float>(aset(r, set).tokens, d,
                                   {R.shard->vocab_start(), m.padded_vocab_size(tp)},
                                   R.shard->embedding().grad);
  });
  link(g, emb);
  if (last) word_grad_ready(emb);
  return emb;
}

std::vector<TaskId> TrainingStep::Impl::build_layer_backward(int l, int mb,
                                                             std::vector<TaskId> prev, bool last) {
  if (ampipe() > 1 && m.is_moe_layer(l)) return build_ampipe_layer_backward(l, mb, prev, last);
  rt::TaskTags tags{.layer = static_cast<std::uint16_t>(l),
                    .micro_batch = static_cast<std::uint16_t>(mb),
                    .phase = rt::Phase::backward};
  const auto L = layer_at(l);
  auto P = [this, l](int r) -> const LayerShard& { return ranks[r].shard->layer(l); };
  auto W = [this](int r) -> BackwardWorkspace& { return ranks[r].ws; };
  const std::string at = fmt::format("L{}.", l);
  const bool moe = m.is_moe_layer(l);
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
    flush_weight_grads();
    std::vector<TaskId> g(ranks.size(), rt::kNoTask);
    if (t_sp > 1)
      g = tp_all_gather(
          res2, [=](int r) { return W(r).d_mlp; }, [=](int r) { return W(r).d_mlp_full; },
          at + "mlp_grad_gather", tags);
    const bool split = split_;
    auto mlp = each(at + "mlp_backward", tags, [=, this](int r) {
      LayerActivations& A = L(r);
      BackwardWorkspace& w = W(r);
      ops::linear_backward_input(w.d_mlp_full, P(r).fc2_weight->value, w.d_act);
      if (split)
        A.saved_d_fc2.copy_from(w.d_mlp_full);
      else
        ops::linear_backward_weight(A.act, w.d_mlp_full, P(r).fc2_weight->grad, Tensor{});
      activation_backward(A.fc1, w.d_act, w.d_fc1);
      ops::linear_backward_input(w.d_fc1, P(r).fc1_weight->value, w.d_norm_full);
      if (split) A.saved_d_fc1.copy_from(w.d_fc1);
    });
    link(g, mlp);
    auto red = reduce_partial(
        mlp, [=](int r) { return W(r).d_norm_full; }, [=](int r) { return W(r).d_norm; },
        at + "mlp_grad_reduce", tags);
    norm_grad_ready = red;
    if (split) {
      weight_grad(at + "mlp_weight_grad", tags, [=, this](int r) {
        LayerActivations& A = L(r);
        ops::linear_backward_weight(A.act, A.saved_d_fc2, P(r).fc2_weight->grad, Tensor{});
        ops::linear_backward_weight(A.ln2_full, A.saved_d_fc1, P(r).fc1_weight->grad,
                                    P(r).fc1_bias->grad);
      });
      for (std::size_t r = 0; r < red.size(); ++r)
        if (red[r] == rt::kNoTask) norm_grad_ready[r] = mlp[r];
    } else {
      // fc1's weight gradient overlaps the reduction of its input gradient.
      auto wg = each(at + "mlp_weight_grad", tags, [=, this](int r) {
        ops::linear_backward_weight(L(r).ln2_full, W(r).d_fc1, P(r).fc1_weight->grad,
                                    P(r).fc1_bias->grad);
      });
      for (std::size_t r = 0; r < red.size(); ++r)
        if (red[r] == rt::kNoTask) norm_grad_ready[r] = wg[r];
    }
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
  const bool split = split_;
  auto attn = each(at + "attention_backward", tags, [=, this](int r) {
    LayerActivations& A = L(r);
    BackwardWorkspace& w = W(r);
    const Tensor d_proj = t_sp > 1 ? w.d_mlp_full : w.d_mlp;
    ops::linear_backward_input(d_proj, P(r).proj_weight->value, w.d_attn);
    if (split)
      A.saved_d_proj.copy_from(d_proj);
    else
      ops::linear_backward_weight(A.attn.reshape({Sc, B, Hl * d}), d_proj, P(r).proj_weight->grad,
                                  Tensor{});
    w.d_qkv.fill(0.f);  // attention accumulates dk and dv
    if (cp == 1)
      ops::attention_backward({}, head_view(A.qkv, 0), head_view(A.qkv, 1), head_view(A.qkv, 2),
                              A.attn.transpose(0, 1), A.lse.reshape({B, Hl, Sc}),
                              w.d_attn.reshape({Sc, B, Hl, d}).transpose(0, 1),
                              head_view(w.d_qkv, 0), head_view(w.d_qkv, 1), head_view(w.d_qkv, 2));
  });
  link(g, attn);
  if (split)
    weight_grad(at + "attention_weight_grad", tags, [=, this](int r) {
      LayerActivations& A = L(r);
      ops::linear_backward_weight(A.attn.reshape({Sc, B, Hl * d}), A.saved_d_proj,
                                  P(r).proj_weight->grad, Tensor{});
    });
  std::vector<TaskId> dkv_ready = attn;
  if (cp > 1) dkv_ready = build_ring_attention_backward(l, attn, tags);
  return build_attention_input_backward(l, dkv_ready, last, tags);
}

}  // namespace weave::graphs
