#include "model/dense_mlp.hpp"

#include <algorithm>

#include "model/attention_block.hpp"
#include "model/half_precision.hpp"
#include "model/sequence_parallel.hpp"
#include "model/tp_comm_overlap.hpp"
#include "step/step_costs.hpp"
#include "step/working_set.hpp"
#include "weave/ops/activation.hpp"
#include "weave/ops/linear.hpp"
#include "weave/runtime/parallel_for.hpp"

namespace weave::graphs {

void DenseMlp::declare_parameters(ParameterDeclarer& declare, const LayerSpec&, int layer,
                                  DenseMlpParameters& L) {
  const ModelConfig& m = declare.model;
  const std::int64_t h = m.hidden_size, f = m.ffn_hidden_size, f_local = f / declare.tp;
  const std::int64_t t = declare.at.tp;
  const bool swiglu = m.activation == Activation::swiglu;
  const std::string prefix = fmt::format("layers.{}.mlp.", layer);
  // SwiGLU: this rank's gates, then its values.
  RowMap fc1_rows = RowMap::range(t * f_local, f_local);
  if (swiglu) fc1_rows.append(f + t * f_local, f_local);
  const std::int64_t f1 = swiglu ? 2 * f : f, f1_local = swiglu ? 2 * f_local : f_local;
  L.fc1_weight =
      &declare.add(prefix + "fc1.weight", {f1_local, h}, f1, h, fc1_rows, 0, declare.std, 0);
  if (m.add_bias_linear)
    L.fc1_bias = &declare.add(prefix + "fc1.bias", {f1_local}, f1, 1, fc1_rows, 0, 0, 0);
  L.fc2_weight = &declare.add(prefix + "fc2.weight", {h, f_local}, h, f, RowMap::range(0, h),
                              t * f_local, declare.out_std, 0);
  if (m.add_bias_linear)
    L.fc2_bias = &declare.replicated(
        declare.add(prefix + "fc2.bias", {h}, h, 1, RowMap::range(0, h), 0, 0, 0),
        declare.mesh.plan().sequence_parallel);
}

void dense_mlp_forward(const ModelConfig& m, const DenseMlpParameters& W, const Tensor& x,
                       const Tensor& fc1, const Tensor& act, const Tensor& out) {
  ops::linear_forward(x, W.fc1_weight->value, value_of(W.fc1_bias), fc1);
  mlp_activation_forward(m, fc1, act);
  ops::linear_forward(act, W.fc2_weight->value, Tensor{}, out);
}

void mlp_activation_forward(const ModelConfig& m, const Tensor& pre, const Tensor& out) {
  if (m.activation == Activation::swiglu)
    ops::swiglu_forward(pre, out);
  else
    ops::gelu_forward(ops::GeluForm::tanh, pre, out);
}

void mlp_activation_backward(const ModelConfig& m, const Tensor& pre, const Tensor& d_out,
                             const Tensor& d_pre) {
  if (m.activation == Activation::swiglu)
    ops::swiglu_backward(pre, d_out, d_pre);
  else
    ops::gelu_backward(ops::GeluForm::tanh, pre, d_out, d_pre);
}

namespace {

// A 16-bit run's activation reads fc1's 16-bit output and writes 16-bit values, computing in
// fp32 in between, as Megatron-LM's fused bias-GeLU and SwiGLU do
// (megatron/core/fusions/fused_bias_gelu.py, fused_bias_swiglu.py: elementwise kernels on the
// 16-bit tensors, which keep their 16-bit input for the backward): no fp32 tensor of the
// activation's size is held. weave widens a block of a few rows at a time into a scratch of the
// block's size (a kernel's working set, not an activation) and computes there; each value is
// computed as on the whole tensor, so the result is bitwise the same.
constexpr std::int64_t kActivationBlockRows = 8;  // rows of the [S, B, f] layout

// fn(first, rows) for every block of rows of `rows`, over the cores of the caller's arena.
template <typename Fn>
void for_row_blocks(std::int64_t rows, Fn&& fn) {
  const std::int64_t blocks = (rows + kActivationBlockRows - 1) / kActivationBlockRows;
  rt::parallel_for(std::int64_t{0}, blocks, [&](std::int64_t b) {
    const std::int64_t first = b * kActivationBlockRows;
    fn(first, std::min(kActivationBlockRows, rows - first));
  });
}

// act16 = the activation of fc1's 16-bit output pre16, in fp32, rounded once.
void half_activation_forward(const ModelConfig& m, const ops::Bf16Tensor& pre16,
                             const ops::Bf16Tensor& act16) {
  for_row_blocks(pre16.dim(0), [&](std::int64_t first, std::int64_t rows) {
    const ops::Bf16Tensor pre_rows = pre16.slice(0, first, rows),
                          act_rows = act16.slice(0, first, rows);
    const Tensor pre = Tensor::empty(pre_rows.shape()), act = Tensor::empty(act_rows.shape());
    widen_to_fp32(m.precision, pre_rows, pre);
    mlp_activation_forward(m, pre, act);
    round_to_half(m.precision, act, act_rows);
  });
}

// d_pre16 = the activation's backward at pre16 of the 16-bit output gradient d_act16, in fp32,
// rounded once: the 16-bit gradient fc1's products read, as autograd's bf16 gradient is.
void half_activation_backward(const ModelConfig& m, const ops::Bf16Tensor& pre16,
                              const ops::Bf16Tensor& d_act16, const ops::Bf16Tensor& d_pre16) {
  for_row_blocks(pre16.dim(0), [&](std::int64_t first, std::int64_t rows) {
    const ops::Bf16Tensor pre_rows = pre16.slice(0, first, rows),
                          d_act_rows = d_act16.slice(0, first, rows),
                          d_pre_rows = d_pre16.slice(0, first, rows);
    const Tensor pre = Tensor::empty(pre_rows.shape()), d_act = Tensor::empty(d_act_rows.shape()),
                 d_pre = Tensor::empty(d_pre_rows.shape());
    widen_to_fp32(m.precision, pre_rows, pre);
    widen_to_fp32(m.precision, d_act_rows, d_act);
    mlp_activation_backward(m, pre, d_act, d_pre);
    round_to_half(m.precision, d_pre, d_pre_rows);
  });
}

// A bf16 run's MLP forward: fc1 and fc2 as bf16 products, the activation in fp32 on fc1's
// widened output, rounded once; fc2's bf16 output joins the fp32 residual stream.
void dense_mlp_forward_bf16(const ModelConfig& m, const DenseMlpParameters& W,
                            const ops::Bf16Tensor& x, const DenseMlpActivations& D,
                            const HalfWorkspace& half) {
  half_linear_forward(m.precision, x, W.fc1_weight->value16, value16_of(W.fc1_bias), D.fc1_16);
  half_activation_forward(m, D.fc1_16, D.act16);
  half_linear_forward(m.precision, D.act16, W.fc2_weight->value16, ops::Bf16Tensor{}, half.out16);
  widen_to_fp32(m.precision, half.out16, D.fc2_partial);
}

// Its backward (fc2's weight half folded in, or with `keep` its output gradient kept for W; fc1's
// runs after, from half.d_fc1_16 or the kept one): the output gradient rounded to bf16 for the
// products, the activation's backward in fp32.
void dense_mlp_backward_bf16(const ModelConfig& m, const DenseMlpParameters& W,
                             const DenseMlpActivations& D, BackwardWorkspace& w, bool keep) {
  const HalfWorkspace& half = w.half;
  round_to_half(m.precision, w.d_mlp_full, half.d_out16);
  half_linear_backward_input(m.precision, half.d_out16, W.fc2_weight->value16, half.d_act16);
  if (keep)
    D.saved_d_fc2_16.copy_from(half.d_out16);
  else
    half_linear_backward_weight(m.precision, D.act16, half.d_out16, W.fc2_weight->grad, Tensor{});
  half_activation_backward(m, D.fc1_16, half.d_act16, half.d_fc1_16);
  if (keep) D.saved_d_fc1_16.copy_from(half.d_fc1_16);
  half_linear_backward_input(m.precision, half.d_fc1_16, W.fc1_weight->value16, half.out16);
  widen_to_fp32(m.precision, half.out16, w.d_norm_full);
}

// --tp-comm-overlap's forward (tp_comm_overlap.hpp): fc1 and the activation piece by piece as
// the gather of the norm's output arrives, then fc2 piece by piece, each piece's partial sums
// reduce-scattered while the next is computed. Returns the last reduce-scatter.
TaskId dense_mlp_forward_in_pieces(RankProgram& P, const BuildPosition& pos, int layer,
                                   TaskId ready, bool recomputing) {
  RankProgram* p = &P;
  const int set = pos.set;
  const StepShape& z = P.shape;
  const rt::TaskTags tags = pos.tags(rt::Phase::forward, layer);
  const std::string at = fmt::format("L{}.", layer);
  LayerActivations& A = P.acts(set, layer);
  const bool half = P.half();
  const Tensor shard = half ? P.ws().half.norm_out : A.ln2;
  const Tensor full = half ? P.ws().half.gathered : A.ln2_full;
  const std::int64_t B = z.B, h = z.h, f = z.fl, f1 = z.f1l;
  const rt::CostHint activation_row = cost::mlp_activation(z, 1);  // a row's, scaled by rows
  const TaskId fc1 = gather_in_pieces(
      P, ready, P.ws().tp_overlap.gather, shard, full, at + "sp_gather_mlp", at + "mlp_fc1", tags,
      [=](std::int64_t rows) {
        return cost::matmul(rows * B, h, f1) + static_cast<double>(rows * B) * activation_row;
      },
      [=](std::int64_t first, std::int64_t rows) {
        LayerActivations& A = p->acts(set, layer);
        const DenseMlpActivations& D = A.dense();
        const DenseMlpParameters& W = p->dense_mlp_parameters(layer);
        const ModelConfig& m = p->shape.model;
        if (p->half()) {
          const HalfWorkspace& hw = p->ws().half;
          const Precision precision = p->precision();
          const ops::Bf16Tensor x = A.ln2_16.slice(0, first, rows),
                                fc1_16 = D.fc1_16.slice(0, first, rows);
          if (!recomputing) round_to_half(precision, hw.gathered.slice(0, first, rows), x);
          half_linear_forward(precision, x, W.fc1_weight->value16, value16_of(W.fc1_bias), fc1_16);
          half_activation_forward(m, fc1_16, D.act16.slice(0, first, rows));
          return;
        }
        const Tensor pre = D.fc1.slice(0, first, rows);
        ops::linear_forward(A.ln2_full.slice(0, first, rows), W.fc1_weight->value,
                            value_of(W.fc1_bias), pre);
        mlp_activation_forward(m, pre, D.act.slice(0, first, rows));
      });
  return scatter_in_pieces(
      P, fc1, P.ws().tp_overlap.scatter, A.dense().fc2_partial, A.mlp_out, at + "mlp_fc2",
      at + "mlp_reduce", tags, [=](std::int64_t rows) { return cost::matmul(rows * B, f, h); },
      [=](std::int64_t first, std::int64_t rows) {
        const DenseMlpActivations& D = p->acts(set, layer).dense();
        const DenseMlpParameters& W = p->dense_mlp_parameters(layer);
        const Tensor out = D.fc2_partial.slice(0, first, rows);
        if (p->half()) {
          const ops::Bf16Tensor out16 = p->ws().half.out16.slice(0, first, rows);
          half_linear_forward(p->precision(), D.act16.slice(0, first, rows), W.fc2_weight->value16,
                              ops::Bf16Tensor{}, out16);
          widen_to_fp32(p->precision(), out16, out);
          return;
        }
        ops::linear_forward(D.act.slice(0, first, rows), W.fc2_weight->value, Tensor{}, out);
      });
}

// --tp-comm-overlap's backward input half: fc2's and fc1's input gradients piece by piece as the
// gather of the output's gradient arrives; fc2's weight half (unless `keep`) after the last
// piece, over every row as without the overlap. Returns the last piece's task.
TaskId dense_mlp_backward_in_pieces(RankProgram& P, const BuildPosition& pos, int layer,
                                    TaskId ready, bool keep) {
  RankProgram* p = &P;
  const int set = pos.set;
  const StepShape& z = P.shape;
  const rt::TaskTags tags = pos.tags(rt::Phase::backward, layer);
  const std::string at = fmt::format("L{}.", layer);
  BackwardWorkspace& w = P.ws();
  const std::int64_t B = z.B, h = z.h, f = z.fl, f1 = z.f1l;
  const rt::CostHint activation_row = cost::mlp_activation_backward(z, 1);  // scaled by rows
  const RowsCost piece = [=](std::int64_t rows) {
    return cost::matmul(rows * B, h, f) + static_cast<double>(rows * B) * activation_row +
           cost::matmul(rows * B, h, f1);
  };
  const rt::CostHint fc2_weight = cost::matmul(z.Sc * z.B, z.h, z.fl);
  return gather_in_pieces(
      P, ready, w.tp_overlap.grad_gather, w.d_mlp, w.d_mlp_full, at + "mlp_grad_gather",
      at + "mlp_backward", tags, piece,
      [=](std::int64_t first, std::int64_t rows) {
        const DenseMlpActivations& D = p->acts(set, layer).dense();
        const DenseMlpParameters& W = p->dense_mlp_parameters(layer);
        BackwardWorkspace& w = p->ws();
        const ModelConfig& m = p->shape.model;
        const Tensor d_out = w.d_mlp_full.slice(0, first, rows),
                     d_in = w.d_norm_full.slice(0, first, rows);
        if (p->half()) {
          const HalfWorkspace& hw = w.half;
          const Precision precision = p->precision();
          const ops::Bf16Tensor d_out16 = hw.d_out16.slice(0, first, rows),
                                d_act16 = hw.d_act16.slice(0, first, rows),
                                d_fc1_16 = hw.d_fc1_16.slice(0, first, rows),
                                d_in16 = hw.out16.slice(0, first, rows);
          round_to_half(precision, d_out, d_out16);
          half_linear_backward_input(precision, d_out16, W.fc2_weight->value16, d_act16);
          if (keep) D.saved_d_fc2_16.slice(0, first, rows).copy_from(d_out16);
          half_activation_backward(m, D.fc1_16.slice(0, first, rows), d_act16, d_fc1_16);
          if (keep) D.saved_d_fc1_16.slice(0, first, rows).copy_from(d_fc1_16);
          half_linear_backward_input(precision, d_fc1_16, W.fc1_weight->value16, d_in16);
          widen_to_fp32(precision, d_in16, d_in);
          return;
        }
        const Tensor d_act = w.dense_mlp.d_act.slice(0, first, rows),
                     d_fc1 = w.dense_mlp.d_fc1.slice(0, first, rows);
        ops::linear_backward_input(d_out, W.fc2_weight->value, d_act);
        if (keep) D.saved_d_fc2.slice(0, first, rows).copy_from(d_out);
        mlp_activation_backward(m, D.fc1.slice(0, first, rows), d_act, d_fc1);
        ops::linear_backward_input(d_fc1, W.fc1_weight->value, d_in);
        if (keep) D.saved_d_fc1.slice(0, first, rows).copy_from(d_fc1);
      },
      keep ? rt::CostHint{} : fc2_weight,
      [=] {
        if (keep) return;
        const DenseMlpActivations& D = p->acts(set, layer).dense();
        const DenseMlpParameters& W = p->dense_mlp_parameters(layer);
        const BackwardWorkspace& w = p->ws();
        if (p->half())
          half_linear_backward_weight(p->precision(), D.act16, w.half.d_out16, W.fc2_weight->grad,
                                      Tensor{});
        else
          ops::linear_backward_weight(D.act, w.d_mlp_full, W.fc2_weight->grad, Tensor{});
      });
}

}  // namespace

void DenseMlp::allocate(LayerActivations& A) const {
  const StepShape& z = P->shape;
  const std::int64_t Sl = z.Sl, Sc = z.Sc, B = z.B, h = z.h;
  if (!P->half())
    A.ln2_full = z.sp() ? kept_or_shared(z.model.recompute.recomputes(kRecomputeLayerNorm),
                                         P->state.recomputed_mlp_norm.full,
                                         [&] {
                                           return P->activation({Sc, B, h});
                                         })
                        : A.ln2;
  DenseMlpActivations& D = A.mlp.emplace<DenseMlpActivations>();
  auto products = [&](DenseMlpActivations& into) {
    if (P->half()) {
      into.fc1_16 = P->activation16({Sc, B, z.f1l});
      into.act16 = P->activation16({Sc, B, z.fl});
    } else {
      into.fc1 = P->activation({Sc, B, z.f1l});
      into.act = P->activation({Sc, B, z.fl});
    }
    into.fc2_partial = P->activation({Sc, B, h});
  };
  if (z.model.recompute.recomputes(kRecomputeMlp)) {
    // A recomputed MLP keeps its input (ln2_full); its products are the rank's working set,
    // which its forward fills again right before its backward.
    DenseMlpActivations& W = P->state.recomputed_dense_mlp;
    if (!W.fc2_partial.defined()) products(W);
    D = W;
  } else {
    products(D);
  }
  A.mlp_out = z.sp() ? P->activation({Sl, B, h}) : D.fc2_partial;
  if (z.splits_backward && P->half()) {
    D.saved_d_fc2_16 = P->activation16({Sc, B, h});
    D.saved_d_fc1_16 = P->activation16({Sc, B, z.f1l});
  } else if (z.splits_backward) {
    D.saved_d_fc2 = P->activation({Sc, B, h});
    D.saved_d_fc1 = P->activation({Sc, B, z.f1l});
  }
}

TaskId DenseMlp::forward(const BuildPosition& pos, TaskId ready) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const rt::TaskTags tags = pos.tags(rt::Phase::forward, l);
  const std::string at = fmt::format("L{}.", l);
  LayerActivations& A = P->acts(set, l);
  const bool recomputing = pos.recomputing && z.model.recompute.recomputes(kRecomputeMlp);
  if (tp_overlaps(z)) return dense_mlp_forward_in_pieces(*P, pos, l, ready, recomputing);
  TaskId gathered = rt::kNoTask;
  if (z.sp() && P->half())
    gathered = sp_gather(*P, ready, P->ws().half.norm_out, P->ws().half.gathered,
                         at + "sp_gather_mlp", tags);
  else if (z.sp())
    gathered = sp_gather(*P, ready, A.ln2, A.ln2_full, at + "sp_gather_mlp", tags);
  // Recomputed alone (selective), a bf16 run's MLP reads the bf16 input it kept (the gathered
  // one under SP): the gather is issued again as Megatron-LM's checkpointed MLP issues it, its
  // result unread. A whole layer recomputed has its norm's output gathered again.
  const rt::CostHint work = cost::mlp(z, z.Sc * z.B) + cost::mlp_activation(z, z.Sc * z.B);
  const TaskId mlp = P->compute(at + "mlp", tags, work, [=] {
    LayerActivations& A = p->acts(set, layer);
    if (p->half()) {
      if (p->shape.sp() && !recomputing)
        round_to_half(p->precision(), p->ws().half.gathered, A.ln2_16);
      dense_mlp_forward_bf16(p->shape.model, p->dense_mlp_parameters(layer), A.ln2_16, A.dense(),
                             p->ws().half);
      return;
    }
    dense_mlp_forward(p->shape.model, p->dense_mlp_parameters(layer), A.ln2_full, A.dense().fc1,
                      A.dense().act, A.dense().fc2_partial);
  });
  P->after(gathered, mlp);
  const TaskId reduced =
      reduce_partial(*P, mlp, A.dense().fc2_partial, A.mlp_out, at + "mlp_reduce", tags);
  return reduced != rt::kNoTask ? reduced : mlp;
}

TaskId DenseMlp::backward(const BuildPosition& pos, TaskId ready, WeightHalves& halves) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const rt::TaskTags tags = pos.tags(rt::Phase::backward, l);
  const std::string at = fmt::format("L{}.", l);
  halves.flush();
  BackwardWorkspace& w = P->ws();
  const bool keep = halves.zero_bubble();
  const std::int64_t rows = z.Sc * z.B;
  const rt::CostHint fc2_weight = cost::matmul(rows, z.h, z.fl),
                     fc1 = cost::matmul(rows, z.h, z.f1l);
  const bool overlapped = tp_overlaps(z);
  TaskId gathered = rt::kNoTask;
  if (z.sp() && !overlapped)
    gathered = sp_gather(*P, ready, w.d_mlp, w.d_mlp_full, at + "mlp_grad_gather", tags);
  const TaskId mlp =
      overlapped
          ? dense_mlp_backward_in_pieces(*P, pos, l, ready, keep)
          : P->compute(
                at + "mlp_backward", tags,
                (keep ? fc2_weight : fc2_weight + fc2_weight) +
                    cost::mlp_activation_backward(z, rows) + fc1,
                [=] {
                  LayerActivations& A = p->acts(set, layer);
                  BackwardWorkspace& w = p->ws();
                  const DenseMlpParameters& W = p->dense_mlp_parameters(layer);
                  if (p->half()) {
                    dense_mlp_backward_bf16(p->shape.model, W, A.dense(), w, keep);
                    return;
                  }
                  ops::linear_backward_input(w.d_mlp_full, W.fc2_weight->value, w.dense_mlp.d_act);
                  if (keep)
                    A.dense().saved_d_fc2.copy_from(w.d_mlp_full);
                  else  // fc2's weight half, folded in: nothing would overlap it
                    ops::linear_backward_weight(A.dense().act, w.d_mlp_full, W.fc2_weight->grad,
                                                Tensor{});
                  mlp_activation_backward(p->shape.model, A.dense().fc1, w.dense_mlp.d_act,
                                          w.dense_mlp.d_fc1);
                  ops::linear_backward_input(w.dense_mlp.d_fc1, W.fc1_weight->value, w.d_norm_full);
                  if (keep) A.dense().saved_d_fc1.copy_from(w.dense_mlp.d_fc1);
                });
  P->after(gathered, mlp);
  const TaskId reduced =
      reduce_partial(*P, mlp, w.d_norm_full, w.d_norm, at + "mlp_grad_reduce", tags);
  TaskId norm_ready = reduced;
  if (keep) {
    halves.place(WeightPlacement::zero_bubble, [=] {
      return p->compute(
          at + "mlp_weight_grad", pos.tags(rt::Phase::weight, layer), fc1 + fc2_weight, [=] {
            LayerActivations& A = p->acts(set, layer);
            const DenseMlpParameters& W = p->dense_mlp_parameters(layer);
            if (p->half()) {
              half_linear_backward_weight(p->precision(), A.dense().act16, A.dense().saved_d_fc2_16,
                                          W.fc2_weight->grad, Tensor{});
              half_linear_backward_weight(p->precision(), A.ln2_16, A.dense().saved_d_fc1_16,
                                          W.fc1_weight->grad, grad_of(W.fc1_bias));
              return;
            }
            ops::linear_backward_weight(A.dense().act, A.dense().saved_d_fc2, W.fc2_weight->grad,
                                        Tensor{});
            ops::linear_backward_weight(A.ln2_full, A.dense().saved_d_fc1, W.fc1_weight->grad,
                                        grad_of(W.fc1_bias));
          });
    });
    if (reduced == rt::kNoTask) norm_ready = mlp;
  } else {
    // fc1's weight half runs while its input gradient is reduced.
    const TaskId weights = halves.place(WeightPlacement::immediate, [=] {
      return p->compute(at + "mlp_weight_grad", tags, fc1, [=] {
        const DenseMlpParameters& W = p->dense_mlp_parameters(layer);
        if (p->half()) {
          half_linear_backward_weight(p->precision(), p->acts(set, layer).ln2_16,
                                      p->ws().half.d_fc1_16, W.fc1_weight->grad,
                                      grad_of(W.fc1_bias));
          return;
        }
        ops::linear_backward_weight(p->acts(set, layer).ln2_full, p->ws().dense_mlp.d_fc1,
                                    W.fc1_weight->grad, grad_of(W.fc1_bias));
      });
    });
    if (reduced == rt::kNoTask) norm_ready = weights;
  }
  return norm_ready;
}

}  // namespace weave::graphs
