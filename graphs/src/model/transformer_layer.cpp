#include "model/transformer_layer.hpp"
#include "model/half_norm.hpp"
#include "model/half_precision.hpp"
#include "model/norm.hpp"
#include "model/recomputed_norm.hpp"
#include "step/step_costs.hpp"
#include "step/working_set.hpp"

#include "ampipe/ampipe_block.hpp"
#include "model/attention_block.hpp"
#include "model/dense_mlp.hpp"
#include "model/sequence_parallel.hpp"
#include "moe/moe_mlp.hpp"
#include "step/gradient_buckets.hpp"
#include "step/parameter_slots.hpp"
#include "weave/ops/elementwise.hpp"
#include "weave/ops/normalization.hpp"

namespace weave::graphs {

void TransformerLayer::allocate(LayerActivations& A, const Tensor& x_in) const {
  const StepShape& z = P->shape;
  const std::int64_t Sl = z.Sl, B = z.B, h = z.h;
  A.x_in = x_in;
  AttentionBlock(*P, l).allocate(A);
  A.x_mid = P->stream_activation({Sl, B, h});
  // A bf16 run's MoE layer keeps its norm's bf16 output in an fp32 buffer, as every MoE row it
  // routes and exchanges (the virtual clock charges them at 2 bytes a value). Recomputed
  // (--recompute-modules layernorm), the norm's output and statistics are the rank's working set.
  const bool again = z.model.recompute.recomputes(kRecomputeLayerNorm);
  RecomputedNorm& shared = P->state.recomputed_mlp_norm;
  if (P->half() && !z.spec(l).moe())
    A.ln2_16 = kept_or_shared(again, shared.out16, [&] { return P->activation16({z.Sc, B, h}); });
  else
    A.ln2 = kept_or_shared(again, shared.out, [&] { return P->activation({Sl, B, h}); });
  A.ln2_mean = kept_or_shared(again, shared.mean, [&] { return P->activation32({Sl * B}); });
  A.ln2_rstd = kept_or_shared(again, shared.rstd, [&] { return P->activation32({Sl * B}); });
  if (z.spec(l).moe())
    MoeMlp(*P, l).allocate(A);
  else
    DenseMlp(*P, l).allocate(A);
  A.x_out = P->stream_activation({Sl, B, h});
}

void TransformerLayer::declare_parameters(ParameterDeclarer& declare, const LayerSpec& spec,
                                          int layer, LayerShard& L) {
  const std::string prefix = fmt::format("layers.{}.", layer);
  declare.bucket(prefix + "attention");
  AttentionBlock::declare_parameters(declare, spec, layer, L.attention);
  declare.bucket(prefix + "mlp");
  L.ln2_weight = declare.norm(prefix + "mlp_norm.weight", 1);
  if (spec.norm == Normalization::layer_norm)
    L.ln2_bias = declare.norm(prefix + "mlp_norm.bias", 0);
  if (spec.moe())
    MoeMlp::declare_parameters(declare, spec, layer, L.mlp.emplace<MoeMlpParameters>());
  else
    DenseMlp::declare_parameters(declare, spec, layer, L.mlp.emplace<DenseMlpParameters>());
}

TaskId TransformerLayer::forward(const BuildPosition& pos, TaskId ready) const {
  const rt::TaskTags tags = pos.tags(rt::Phase::forward, l);
  acquire_layer_parameters(*P, l, l + 1, tags);
  const TaskId done = forward_pass(pos, ready);
  release_layer_parameters(*P, l, tags);
  return done;
}

TaskId TransformerLayer::backward(const BuildPosition& pos, TaskId ready, WeightHalves& halves,
                                  bool last) const {
  const rt::TaskTags tags = pos.tags(rt::Phase::backward, l);
  acquire_layer_parameters(*P, l, l - 1, tags);
  const TaskId done = backward_pass(pos, ready, halves, last);
  release_layer_parameters(*P, l, tags);
  return done;
}

namespace {

// The pre-MLP norm of layer `layer` for set `set`, from x_mid: into ln2 (fp32, and a 16-bit
// run's MoE layer's), a bf16 run's ln2_16, or under SP the bf16 run's workspace (norm_out) that
// the MLP's gather reads.
void mlp_norm_forward(RankProgram& P, int set, int layer) {
  RankProgram* p = &P;
  LayerActivations& A = p->acts(set, layer);
  const LayerShard& W = p->layer(layer);
  if (p->half() && p->shape.spec(layer).mlp == MlpModule::moe) {  // in fp32, rounded once
    norm_forward(p->shape.model, A.x_mid, *W.ln2_weight, W.ln2_bias, A.ln2, A.ln2_mean, A.ln2_rstd);
    round_in_place(p->precision(), A.ln2);
    return;
  }
  if (p->half() && !p->shape.sp()) {  // in fp32, rounded once into the bf16 input of fc1
    norm_forward_to_half(p->shape.model, A.x_mid, *W.ln2_weight, W.ln2_bias, A.ln2_16, A.ln2_mean,
                         A.ln2_rstd);
    return;
  }
  if (p->half()) {  // gathered first, as the attention's input
    norm_forward(p->shape.model, A.x_mid, *W.ln2_weight, W.ln2_bias, p->ws().half.norm_out,
                 A.ln2_mean, A.ln2_rstd);
    round_in_place(p->precision(), p->ws().half.norm_out);
    return;
  }
  norm_forward(p->shape.model, A.x_mid, *W.ln2_weight, W.ln2_bias, A.ln2, A.ln2_mean, A.ln2_rstd);
}

}  // namespace

TaskId TransformerLayer::mlp_norm_again(const BuildPosition& pos, TaskId ready) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const rt::TaskTags tags = pos.tags(rt::Phase::backward, l);
  const std::string at = fmt::format("L{}.", l);
  const double rows = static_cast<double>(z.Sl * z.B * z.h);
  const TaskId norm = P->compute(at + "mlp_norm_again", tags, cost::streamed(z, 2 * rows),
                                 [p, layer, set] { mlp_norm_forward(*p, set, layer); });
  P->after(ready, norm);
  // A MoE layer routes its own rows (its shared experts gather and keep theirs): nothing to
  // gather. A dense layer's MLP reads the gathered norm under SP.
  if (z.spec(l).mlp == MlpModule::moe) return norm;
  const LayerActivations& A = P->acts(set, l);
  return gather_recomputed_norm(*P, norm, tags, at + "sp_gather_mlp_again",
                                at + "mlp_norm_again_round", A.ln2, A.ln2_full, A.ln2_16);
}

TaskId TransformerLayer::forward_pass(const BuildPosition& pos, TaskId ready) const {
  const StepShape& z = P->shape;
  const MlpModule mlp_module = z.spec(l).mlp;
  // --overlap-param-gather: the attention half's first task waits for its parameters' gather.
  P->wait_for_parameters(fmt::format("layers.{}.attention", l));
  if (mlp_module == MlpModule::ampipe) {
    P->wait_for_parameters(fmt::format("layers.{}.mlp", l));
    return AmpipeBlock(*P, l).forward(pos, ready);
  }
  RankProgram* p = P;
  const int layer = l, set = pos.set, mb = pos.micro_batch;
  const rt::TaskTags tags = pos.tags(rt::Phase::forward, l);
  const std::string at = fmt::format("L{}.", l);
  const TaskId attention = AttentionBlock(*P, l).forward(pos, ready);
  const double rows = static_cast<double>(z.Sl * z.B * z.h);
  // The residual's norm is the MLP half's first reader of its parameters.
  P->wait_for_parameters(fmt::format("layers.{}.mlp", l));
  // Bias, dropout and residual (read 2, write 1), then the norm (read 1, write 1).
  const TaskId residual =
      P->compute(at + "attention_residual", tags, cost::streamed(z, 5 * rows), [=] {
        LayerActivations& A = p->acts(set, layer);
        const LayerShard& W = p->layer(layer);
        // The reduced projection is a bf16 value, as the bf16 collective would leave it.
        if (p->half() && p->shape.tp > 1) round_in_place(p->precision(), A.attention.proj_out);
        p->bias_dropout_add(mb, layer, 0, A.attention.proj_out,
                            compute_value_of(W.attention.proj_bias), A.x_in, A.x_mid);
        mlp_norm_forward(*p, set, layer);
      });
  P->after(attention, residual);
  const TaskId mlp = mlp_module == MlpModule::moe ? MoeMlp(*P, l).forward(pos, residual)
                                                  : DenseMlp(*P, l).forward(pos, residual);
  const TaskId out = P->compute(at + "mlp_residual", tags, cost::streamed(z, 4 * rows), [=] {
    LayerActivations& A = p->acts(set, layer);
    const LayerShard& W = p->layer(layer);
    if (p->half() && p->shape.tp > 1) round_in_place(p->precision(), A.mlp_out);
    if (mlp_module == MlpModule::dense) {
      p->bias_dropout_add(mb, layer, 1, A.mlp_out, compute_value_of(W.dense_mlp().fc2_bias),
                          A.x_mid, A.x_out);
    } else {
      p->apply_dropout(false, mb, layer, 1, A.mlp_out, A.mlp_out);
      ops::add(A.x_mid, A.mlp_out, A.x_out);
      if (p->rounds_residual_stream()) round_in_place(p->precision(), A.x_out);
    }
  });
  P->after(mlp, out);
  return out;
}

TaskId TransformerLayer::backward_pass(const BuildPosition& pos, TaskId ready, WeightHalves& halves,
                                       bool last) const {
  const StepShape& z = P->shape;
  const MlpModule mlp_module = z.spec(l).mlp;
  // ZeRO stage 2: the layer's gradient slot is free (its previous layer reduced) before any of
  // the layer's gradients are written; a zero-bubble I action whose gradients are held aside
  // writes none into it (its W action takes the slot, ModelChunk::weight_gradients).
  if (!halves.zero_bubble() || !P->shard().holds_input_pass_gradients())
    wait_for_gradient_slot(*P, l, pos.tags(rt::Phase::backward, l));
  if (mlp_module == MlpModule::ampipe) return AmpipeBlock(*P, l).backward(pos, ready, halves, last);
  const bool moe = mlp_module == MlpModule::moe;
  RankProgram* p = P;
  const int layer = l, set = pos.set, mb = pos.micro_batch;
  const rt::TaskTags tags = pos.tags(rt::Phase::backward, l);
  const std::string at = fmt::format("L{}.", l);
  // d_x (the layer output's gradient) -> d_mlp; d_x_mid starts as d_x (the residual).
  const double rows = static_cast<double>(z.Sl * z.B * z.h);
  const TaskId residual =
      P->compute(at + "mlp_residual_backward", tags, cost::streamed(z, 4 * rows), [=] {
        BackwardWorkspace& w = p->ws();
        w.d_x_mid.copy_from(w.d_x);
        if (moe)
          p->apply_dropout(true, mb, layer, 1, w.d_x, w.d_mlp);
        else
          p->bias_dropout_add_backward(mb, layer, 1, w.d_x, w.d_mlp,
                                       grad_of(p->dense_mlp_parameters(layer).fc2_bias));
      });
  P->after(ready, residual);
  TaskId mlp_ready = residual;
  // Selective recomputation of the norm: its output again before the MLP's backward (and before
  // the MLP's own recomputation, which reads it), as Megatron-Core recomputes pre_mlp_layernorm
  // when the MLP's output gradient arrives.
  if (z.model.recompute.recomputes(kRecomputeLayerNorm)) mlp_ready = mlp_norm_again(pos, residual);
  if (!moe && z.model.recompute.recomputes(kRecomputeMlp)) {
    // Selective recomputation: the MLP's forward again from its kept input (its SP gather and
    // its reduction included, as Megatron-LM's checkpointed MLP runs them), into the working set.
    BuildPosition again = pos;
    again.recomputing = true;
    mlp_ready = DenseMlp(*P, l).forward(again, mlp_ready);
  }
  if (moe && z.model.recompute.recomputes(kRecomputeMoe)) {
    // The MoE layer's forward again from its kept input: router, dispatch, experts and combine
    // with their all-to-alls, and its shared experts, as Megatron-Core's checkpointed MoELayer
    // runs them; `recomputing` keeps the step's totals (aux losses, picks) counted once.
    BuildPosition again = pos;
    again.recomputing = true;
    mlp_ready = MoeMlp(*P, l).forward(again, mlp_ready);
  }
  const TaskId mlp = moe ? MoeMlp(*P, l).backward(pos, mlp_ready, halves)
                         : DenseMlp(*P, l).backward(pos, mlp_ready, halves);
  // The norm's backward, the residual's sum, the copy and the bias-dropout backward.
  const TaskId norm = P->compute(at + "mlp_norm_backward", tags, cost::streamed(z, 10 * rows), [=] {
    LayerActivations& A = p->acts(set, layer);
    BackwardWorkspace& w = p->ws();
    const LayerShard& W = p->layer(layer);
    if (p->half() && p->shape.tp > 1) round_in_place(p->precision(), w.d_norm);
    norm_backward(p->shape.model, A.x_mid, *W.ln2_weight, W.ln2_bias, A.ln2_mean, A.ln2_rstd,
                  w.d_norm, w.d_tmp);
    ops::accumulate(w.d_tmp, w.d_x_mid);
    // The gradient of a 16-bit stream value, summed over its two readers, is a 16-bit tensor.
    if (p->rounds_residual_stream()) round_in_place(p->precision(), w.d_x_mid);
    // Attention half: d_x_mid -> d_proj_out (in d_mlp), and the residual's d_x.
    w.d_x.copy_from(w.d_x_mid);
    p->bias_dropout_add_backward(mb, layer, 0, w.d_x_mid, w.d_mlp, grad_of(W.attention.proj_bias));
  });
  P->after(mlp, norm);
  // A zero-bubble I action leaves the bucket to its W action, which writes the rest of it.
  if (!halves.zero_bubble()) reduce_buckets(*P, fmt::format("layers.{}.mlp", l), norm, last);
  // With tp or cp the QKV weight half overlaps the input gradient's reduction; with neither it
  // waits for the layer below to launch its first all-to-all.
  // ZeRO stage 2 keeps every weight half inside its layer's backward, which holds its slot.
  // Recomputed, the input norm's output is the rank's working set, which the layer below
  // recomputes into: the QKV weight half reading it runs within its layer.
  const WeightPlacement qkv_weights = z.tp == 1 && z.spec(l).attention == AttentionCore::local &&
                                              !z.plan.shard_gradients &&
                                              !z.model.recompute.recomputes(kRecomputeLayerNorm)
                                          ? halves.deferrable()
                                          : halves.immediate();
  return AttentionBlock(*P, l).backward(pos, norm, halves, last, qkv_weights);
}

}  // namespace weave::graphs
