#include "model/output_loss.hpp"
#include "model/half_norm.hpp"
#include "model/half_precision.hpp"
#include "model/norm.hpp"

#include "model/attention_block.hpp"
#include "model/sequence_parallel.hpp"
#include "step/step_costs.hpp"
#include "weave/ops/cross_entropy.hpp"
#include "weave/ops/linear.hpp"
#include "weave/ops/normalization.hpp"

namespace weave::graphs {

namespace {

ops::CrossEntropyOptions cross_entropy_options(const StepShape& z) {
  // The mean over the global batch: micro-batches and data-parallel ranks add up to it.
  return {.ignore_index = -100,
          .denominator = static_cast<double>(z.S * z.B * z.M * z.plan.data_parallel)};
}

ops::VocabShard vocab_shard(RankProgram& P) {
  return {P.shard().vocab_start(), P.shape.model.padded_vocab_size(P.shape.tp)};
}

}  // namespace

void OutputLoss::allocate(OutputSet& O) const {
  const StepShape& z = P->shape;
  const std::int64_t Sl = z.Sl, Sc = z.Sc, B = z.B, h = z.h;
  if (P->half())
    O.final16 = P->activation16({Sc, B, h});
  else
    O.final_ln = P->activation({Sl, B, h});
  O.final_mean = P->activation32({Sl * B});
  O.final_rstd = P->activation32({Sl * B});
  if (!P->half()) O.final_full = z.sp() ? P->activation({Sc, B, h}) : O.final_ln;
  O.logits = P->activation32({Sc * B, z.Vl});
  O.row_max = P->activation32({Sc * B});
  O.partials = P->activation32({Sc * B, ops::kCrossEntropyPartials});
  O.lse = P->activation32({Sc * B});
  if (z.splits_backward && P->half())
    O.saved_d_logits16 = P->activation16({Sc * B, z.Vl});
  else if (z.splits_backward)
    O.saved_d_logits = P->activation({Sc * B, z.Vl});
}

TaskId OutputLoss::forward(const BuildPosition& pos, TaskId ready) const {
  RankProgram* p = P;
  const int set = pos.set, out = pos.output, mb = pos.micro_batch;
  const StepShape& z = P->shape;
  const std::int64_t Sc = z.Sc, B = z.B, h = z.h;
  const int last_layer = z.model.num_layers - 1;
  const rt::TaskTags tags = pos.tags(rt::Phase::forward);
  // --overlap-param-gather: the final norm, the first task of the model's end, waits for the
  // gathers of the norm's, the output layer's and (tied weights) the word embedding's buckets.
  for (const char* point : {"final_norm", "output", "embedding"})
    P->wait_for_parameters(point);
  const TaskId norm = P->compute("final_norm", tags, cost::streamed(z, 2.0 * z.Sl * B * h), [=] {
    OutputSet& X = p->oset(out);
    ModelShard& W = p->shard();
    p->load_tokens(mb, X.targets, true);
    if (p->half() && !p->shape.sp()) {  // in fp32, rounded once into the output layer's input
      norm_forward_to_half(p->shape.model, p->acts(set, last_layer).x_out, W.final_ln_weight(),
                           W.final_ln_bias(), X.final16, X.final_mean, X.final_rstd);
      return;
    }
    if (p->half()) {  // gathered first
      norm_forward(p->shape.model, p->acts(set, last_layer).x_out, W.final_ln_weight(),
                   W.final_ln_bias(), p->ws().half.norm_out, X.final_mean, X.final_rstd);
      round_in_place(p->precision(), p->ws().half.norm_out);
      return;
    }
    norm_forward(p->shape.model, p->acts(set, last_layer).x_out, W.final_ln_weight(),
                 W.final_ln_bias(), X.final_ln, X.final_mean, X.final_rstd);
  });
  P->after(ready, norm);
  OutputSet& X = P->oset(out);
  TaskId gathered = rt::kNoTask;
  if (z.sp() && P->half())
    gathered =
        sp_gather(*P, norm, P->ws().half.norm_out, P->ws().half.gathered, "final_gather", tags);
  else if (z.sp())
    gathered = sp_gather(*P, norm, X.final_ln, X.final_full, "final_gather", tags);
  // The products, then the loss's passes as Megatron's cross-entropy makes them (step_costs.hpp).
  const rt::CostHint logits_cost = cost::matmul(Sc * B, h, z.Vl) + cost::cross_entropy_maxima(z);
  const TaskId logits = P->compute("logits", tags, logits_cost, [=] {
    OutputSet& X = p->oset(out);
    if (p->half()) {  // bf16 logits, widened: the loss is fp32
      const ops::Bf16Tensor& logits16 = p->ws().half.logits16;
      if (p->shape.sp()) round_to_half(p->precision(), p->ws().half.gathered, X.final16);
      half_linear_forward(p->precision(), X.final16.reshape({Sc * B, h}),
                          p->shard().output_weight().value16, ops::Bf16Tensor{}, logits16);
      widen_to_fp32(p->precision(), logits16, X.logits);
    } else {
      ops::linear_forward(X.final_full.reshape({Sc * B, h}), p->shard().output_weight().value,
                          Tensor{}, X.logits);
    }
    ops::cross_entropy_row_max(X.logits, X.row_max);
  });
  P->after(gathered, logits);
  const TaskId maxima =
      P->tensor.all_reduce(logits, all_of(X.row_max), devices::ReduceOp::max, "loss_max", tags);
  const TaskId sums = P->compute("loss_partials", tags, cost::cross_entropy_exp_sums(z), [p, out] {
    OutputSet& X = p->oset(out);
    ops::cross_entropy_partial_sums<float>(X.logits, X.targets, vocab_shard(*p), X.row_max,
                                           X.partials);
  });
  P->after(maxima, sums);
  const TaskId reduced =
      P->tensor.all_reduce(sums, all_of(X.partials), devices::ReduceOp::sum, "loss_sum", tags);
  const rt::CostHint loss_cost = cost::streamed(z, 3.0 * Sc * B) + cost::cross_entropy_softmax(z);
  const TaskId loss = P->compute("loss", tags, loss_cost, [p, out, mb] {
    OutputSet& X = p->oset(out);
    p->state.loss[static_cast<std::size_t>(mb)] = ops::cross_entropy_loss<float>(
        X.row_max, X.partials, X.targets, p->shape.model.padded_vocab_size(p->shape.tp),
        cross_entropy_options(p->shape), X.lse, Tensor{});
  });
  P->after(reduced, loss);
  return loss;
}

TaskId OutputLoss::backward(const BuildPosition& pos, TaskId ready, WeightHalves& halves) const {
  RankProgram* p = P;
  const int set = pos.set, out = pos.output;
  const StepShape& z = P->shape;
  const std::int64_t Sc = z.Sc, B = z.B, h = z.h;
  const bool sp = z.sp(), keep = halves.zero_bubble();
  const int last_layer = z.model.num_layers - 1;
  const rt::TaskTags tags = pos.tags(rt::Phase::backward);
  const rt::CostHint logits_flops = cost::matmul(Sc * B, h, z.Vl);
  const rt::CostHint d_logits_cost = logits_flops + cost::cross_entropy_backward(z);
  const TaskId d_logits = P->compute("loss_backward", tags, d_logits_cost, [=] {
    OutputSet& X = p->oset(out);
    BackwardWorkspace& w = p->ws();
    // A 16-bit run computes the fp32 gradient in place over its fp32 logits, as Megatron-LM's
    // cross-entropy does over its fp32 softmax, and rounds it into the bf16 its products read.
    const Tensor d_logits = p->half() ? X.logits : w.output.d_logits;
    ops::cross_entropy_backward<float>(X.logits, X.targets, vocab_shard(*p), X.lse,
                                       cross_entropy_options(p->shape),
                                       p->opt.loss_scaling ? p->inputs.loss_scale : 1.0, d_logits);
    if (p->half()) {  // the output layer's products take the gradient in bf16
      const HalfWorkspace& half = w.half;
      round_to_half(p->precision(), d_logits, half.d_logits16);
      if (keep) X.saved_d_logits16.copy_from(half.d_logits16);
      half_linear_backward_input(p->precision(), half.d_logits16,
                                 p->shard().output_weight().value16,
                                 half.out16.reshape({Sc * B, h}));
      widen_to_fp32(p->precision(), half.out16, w.output.d_final_full);
      return;
    }
    ops::linear_backward_input(w.output.d_logits, p->shard().output_weight().value,
                               w.output.d_final_full.reshape({Sc * B, h}));
    if (keep) X.saved_d_logits.copy_from(w.output.d_logits);
  });
  P->after(ready, d_logits);
  BackwardWorkspace& w = P->ws();
  const TaskId reduced =
      reduce_partial(*P, d_logits, w.output.d_final_full, sp ? w.d_norm : w.output.d_final_full,
                     "final_grad_reduce", tags);
  // The output layer's weight half overlaps the reduction above.
  halves.place(halves.immediate(), [=] {
    return p->compute(
        "logits_weight_grad", pos.tags(keep ? rt::Phase::weight : rt::Phase::backward),
        logits_flops, [=] {
          OutputSet& X = p->oset(out);
          if (p->half()) {
            half_linear_backward_weight(p->precision(), X.final16.reshape({Sc * B, h}),
                                        keep ? X.saved_d_logits16 : p->ws().half.d_logits16,
                                        p->shard().output_weight().grad, Tensor{});
            return;
          }
          ops::linear_backward_weight(X.final_full.reshape({Sc * B, h}),
                                      keep ? X.saved_d_logits : p->ws().output.d_logits,
                                      p->shard().output_weight().grad, Tensor{});
        });
  });
  const TaskId norm =
      P->compute("final_norm_backward", tags, cost::streamed(z, 3.0 * z.Sl * B * h), [=] {
        OutputSet& X = p->oset(out);
        BackwardWorkspace& w = p->ws();
        ModelShard& W = p->shard();
        const Tensor d_in = sp ? w.d_norm : w.output.d_final_full;
        if (p->half() && p->shape.tp > 1) round_in_place(p->precision(), d_in);
        norm_backward(p->shape.model, p->acts(set, last_layer).x_out, W.final_ln_weight(),
                      W.final_ln_bias(), X.final_mean, X.final_rstd, d_in, w.d_x);
        // The gradient of the 16-bit stream's last value (the final norm its only reader).
        if (p->rounds_residual_stream()) round_in_place(p->precision(), w.d_x);
      });
  P->after(reduced, norm);
  return norm;
}

void OutputLoss::declare_parameters(ParameterDeclarer& declare, const StageContents& contents,
                                    OutputLossParameters& O) {
  const ModelConfig& m = declare.model;
  const std::int64_t h = m.hidden_size, vocab = m.padded_vocab_size(declare.tp);
  const std::int64_t v_local = vocab / declare.tp;
  declare.hold(contents.output_layer);
  declare.bucket("final_norm");
  O.final_norm_weight = declare.norm("final_norm.weight", 1);
  if (m.normalization == Normalization::layer_norm)
    O.final_norm_bias = declare.norm("final_norm.bias", 0);
  declare.bucket("output");
  if (m.untie_embeddings_and_output_weights)
    O.output_weight =
        &declare.add("output.weight", {v_local, h}, vocab, h,
                     RowMap::range(declare.vocab_start(), v_local), 0, declare.std, 0);
  if (!contents.output_layer) O = OutputLossParameters{};
}

}  // namespace weave::graphs
