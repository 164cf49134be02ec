#include "moe/moe_shared_experts.hpp"

#include <cmath>

#include "model/dense_mlp.hpp"
#include "model/half_precision.hpp"
#include "model/sequence_parallel.hpp"
#include "moe/expert_products.hpp"
#include "step/step_costs.hpp"
#include "weave/ops/linear.hpp"

namespace weave::graphs {

namespace {

// The rank's columns of the hidden layer, and fc1's rows (twice as many with SwiGLU).
std::int64_t local_width(const ModelConfig& m, int tp) {
  return m.moe_shared_expert_intermediate_size / tp;
}
std::int64_t local_width1(const ModelConfig& m, int tp) {
  return (m.activation == Activation::swiglu ? 2 : 1) * local_width(m, tp);
}

// fc1's and fc2's products over `rows` rows.
rt::CostHint fc1_products(const StepShape& z, std::int64_t rows) {
  return cost::matmul(rows, z.h, local_width1(z.model, z.tp));
}
rt::CostHint fc2_products(const StepShape& z, std::int64_t rows) {
  return cost::matmul(rows, local_width(z.model, z.tp), z.h);
}

// The gate's rows: the norm's, as the shared experts' output holds them after its reduction.
std::int64_t gate_rows(const Tensor& x, std::int64_t h) {
  return x.numel() / h;
}

// A 16-bit run's products are the routed experts' (expert_products.hpp): 16-bit products with
// fp32 sums into fp32 buffers holding 16-bit values, the activation in fp32 on fc1's output,
// rounded once. The input holds 16-bit values (the rounded norm). In the backward a 16-bit
// tensor's gradient is 16-bit (rounded); the input gradients are 16-bit products, rounded once;
// the weight gradients run through the fp32 kernels, whose operands all hold 16-bit values, so
// their products are exact and their sums the fp32 sums the 16-bit kernels would give
// (experts_backward's argument), accumulated into the fp32 main gradients.

}  // namespace

Parameter* declare_shared_expert_gate(ParameterDeclarer& declare, const std::string& prefix) {
  if (!declare.model.moe_shared_expert_gate) return nullptr;
  const std::int64_t h = declare.model.hidden_size;
  // Each tp rank gates the tokens of its norm: its sequence-parallel shard (the gradient a
  // partial sum over tp), or without sp every token (the same gradient on every tp rank).
  return &declare.replicated(declare.add(prefix + "shared_experts.gate_weight", {1, h}, 1, h,
                                         RowMap::range(0, 1), 0, declare.std, 0),
                             declare.mesh.plan().sequence_parallel);
}

void shared_expert_gate_forward(const Tensor& w, const Tensor& x, const Tensor& out,
                                const Tensor& ungated, const Tensor& gate) {
  const std::int64_t h = w.numel(), rows = gate_rows(x, h);
  const float* wv = w.data();
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = x.data() + r * h;
    float* o = out.data() + r * h;
    double logit = 0;
    for (std::int64_t j = 0; j < h; ++j)
      logit += static_cast<double>(xr[j]) * wv[j];
    const auto g = static_cast<float>(1 / (1 + std::exp(-logit)));
    gate.data()[r] = g;
    if (ungated.defined()) std::copy_n(o, h, ungated.data() + r * h);
    for (std::int64_t j = 0; j < h; ++j)
      o[j] *= g;
  }
}

void declare_shared_expert_parameters(ParameterDeclarer& declare, const std::string& prefix,
                                      DenseMlpParameters& W) {
  const ModelConfig& m = declare.model;
  const std::int64_t h = m.hidden_size, f = m.moe_shared_expert_intermediate_size;
  const std::int64_t f_local = f / declare.tp, t = declare.at.tp;
  const bool swiglu = m.activation == Activation::swiglu;
  RowMap fc1_rows = RowMap::range(t * f_local, f_local);
  if (swiglu) fc1_rows.append(f + t * f_local, f_local);
  const std::int64_t f1 = swiglu ? 2 * f : f, f1_local = swiglu ? 2 * f_local : f_local;
  W.fc1_weight = &declare.add(prefix + "shared_experts.fc1.weight", {f1_local, h}, f1, h, fc1_rows,
                              0, declare.std, 0);
  W.fc2_weight = &declare.add(prefix + "shared_experts.fc2.weight", {h, f_local}, h, f,
                              RowMap::range(0, h), t * f_local, declare.out_std, 0);
}

void allocate_shared_expert_workspace(RankProgram& P, BackwardWorkspace& workspace) {
  const StepShape& z = P.shape;
  const std::int64_t Sl = z.Sl, Sc = z.Sc, B = z.B, h = z.h;
  const bool sp = z.sp();
  SharedExpertWorkspace& W = workspace.shared_expert;
  const bool gated = z.model.moe_shared_expert_gate;
  if (gated) {
    W.d_gated = P.activation(workspace.d_mlp.shape());
    W.d_logit = P.activation({workspace.d_mlp.numel() / h, 1});
  }
  W.d_out = sp ? P.activation({Sc, B, h}) : gated ? W.d_gated : workspace.d_mlp;
  W.d_act = P.activation({Sc, B, local_width(z.model, z.tp)});
  W.d_fc1 = P.activation({Sc, B, local_width1(z.model, z.tp)});
  W.d_in_full = P.activation({Sc, B, h});
  W.d_in = sp ? P.activation({Sl, B, h}) : W.d_in_full;
}

void SharedExperts::allocate(LayerActivations& A) const {
  const StepShape& z = P->shape;
  const std::int64_t Sl = z.Sl, Sc = z.Sc, B = z.B, h = z.h;
  SharedExpertActivations& S = A.moe().shared;
  S.input = z.sp() ? P->activation({Sc, B, h}) : A.ln2;
  S.fc1 = P->activation({Sc, B, local_width1(z.model, z.tp)});
  S.act = P->activation({Sc, B, local_width(z.model, z.tp)});
  S.partial = P->activation({Sc, B, h});
  S.out = z.sp() ? P->activation({Sl, B, h}) : S.partial;
  if (z.model.moe_shared_expert_gate) {
    S.ungated = P->activation(S.out.shape());
    S.gate = P->activation({S.out.numel() / h, 1});
  }
  if (z.splits_backward) {  // the I action keeps the output gradients the W action reads
    S.saved_d_out = P->activation({Sc, B, h});
    S.saved_d_fc1 = P->activation({Sc, B, local_width1(z.model, z.tp)});
  }
}

TaskId SharedExperts::gather_input(const BuildPosition& pos, TaskId ready) const {
  if (!P->shape.sp()) return rt::kNoTask;
  return sp_gather(*P, ready, P->acts(pos.set, l).ln2, P->acts(pos.set, l).moe().shared.input,
                   fmt::format("L{}.shared_expert_sp_gather", l), pos.tags(rt::Phase::forward, l));
}

TaskId SharedExperts::fc1_forward(const BuildPosition& pos, TaskId ready, TaskId gathered) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const TaskId fc1 =
      P->compute(fmt::format("L{}.shared_expert_fc1", l), pos.tags(rt::Phase::forward, l),
                 fc1_products(z, z.Sc * z.B), [p, layer, set] {
                   const SharedExpertActivations& S = p->acts(set, layer).moe().shared;
                   const DenseMlpParameters& W = p->moe_parameters(layer).shared;
                   const ModelConfig& m = p->shape.model;
                   if (p->half()) {
                     linear_forward_half(p->precision(), S.input, W.fc1_weight->value16, S.fc1);
                     mlp_activation_forward(m, S.fc1, S.act);
                     round_in_place(p->precision(), S.act);
                     return;
                   }
                   ops::linear_forward(S.input, W.fc1_weight->value, Tensor{}, S.fc1);
                   mlp_activation_forward(m, S.fc1, S.act);
                 });
  P->after(ready, fc1);
  P->after(gathered, fc1);
  return fc1;
}

TaskId SharedExperts::fc2_forward(const BuildPosition& pos, TaskId fc1) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const rt::TaskTags tags = pos.tags(rt::Phase::forward, l);
  const std::string at = fmt::format("L{}.shared_expert", l);
  const SharedExpertActivations& S = P->acts(set, l).moe().shared;
  const TaskId fc2 = P->compute(at + "_fc2", tags, fc2_products(z, z.Sc * z.B), [p, layer, set] {
    const SharedExpertActivations& S = p->acts(set, layer).moe().shared;
    const DenseMlpParameters& W = p->moe_parameters(layer).shared;
    if (p->half())
      linear_forward_half(p->precision(), S.act, W.fc2_weight->value16, S.partial);
    else
      ops::linear_forward(S.act, W.fc2_weight->value, Tensor{}, S.partial);
  });
  P->after(fc1, fc2);
  const TaskId reduced = reduce_partial(*P, fc2, S.partial, S.out, at + "_reduce", tags);
  const TaskId out = reduced != rt::kNoTask ? reduced : fc2;
  if (!z.model.moe_shared_expert_gate) return out;
  // The gate on the reduced output's rows, the norm's (every tp rank's sequence without sp).
  const TaskId gate =
      P->compute(at + "_gate", tags,
                 cost::matmul(z.Sl * z.B, z.h, 1) + cost::streamed(z, 2.0 * z.Sl * z.B * z.h),
                 [p, layer, set] {
                   LayerActivations& A = p->acts(set, layer);
                   const SharedExpertActivations& S = A.moe().shared;
                   // A 16-bit run: the reduced sum is a 16-bit value, as the 16-bit collective
                   // leaves it; the score in fp32 from the weight's 16-bit copy, as the router
                   // scores in fp32; the gated output rounded when added (MoeMlp::forward).
                   if (p->half()) round_in_place(p->precision(), S.out);
                   shared_expert_gate_forward(compute_value(*p->moe_parameters(layer).shared_gate),
                                              A.ln2, S.out, S.ungated, S.gate);
                 });
  P->after(out, gate);
  return gate;
}

TaskId SharedExperts::forward(const BuildPosition& pos, TaskId ready) const {
  return fc2_forward(pos, fc1_forward(pos, ready, gather_input(pos, ready)));
}

TaskId SharedExperts::fc2_backward(const BuildPosition& pos, TaskId ready,
                                   const WeightHalves& halves) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const rt::TaskTags tags = pos.tags(rt::Phase::backward, l);
  const std::string at = fmt::format("L{}.shared_expert", l);
  const SharedExpertWorkspace& W = P->ws().shared_expert;
  const bool gated = z.model.moe_shared_expert_gate, keep = halves.zero_bubble();
  const std::int64_t rows = P->ws().d_mlp.numel() / z.h, h = z.h;
  if (gated) {
    // Through the gate: the ungated output's gradient d_mlp g, and each logit's g (1 - g)
    // sum_j d_mlp u_j.
    const TaskId gate = P->compute(
        at + "_gate_backward", tags, cost::streamed(z, 3.0 * rows * h), [p, layer, set, rows, h] {
          const SharedExpertActivations& S = p->acts(set, layer).moe().shared;
          const SharedExpertWorkspace& w = p->ws().shared_expert;
          const float* d = p->ws().d_mlp.data();
          for (std::int64_t r = 0; r < rows; ++r) {
            const float g = S.gate.data()[r];
            const float* u = S.ungated.data() + r * h;
            double dot = 0;
            for (std::int64_t j = 0; j < h; ++j) {
              dot += static_cast<double>(d[r * h + j]) * u[j];
              w.d_gated.data()[r * h + j] = d[r * h + j] * g;
            }
            w.d_logit.data()[r] = static_cast<float>(dot * g * (1 - g));
          }
          // A 16-bit run: the gated product's gradient is a 16-bit value, the logit's fp32.
          if (p->half()) round_in_place(p->precision(), w.d_gated);
        });
    P->after(ready, gate);
    ready = gate;
  }
  const Tensor& d_out = gated ? W.d_gated : P->ws().d_mlp;
  TaskId gathered = rt::kNoTask;
  if (z.sp()) gathered = sp_gather(*P, ready, d_out, W.d_out, at + "_grad_gather", tags);
  const rt::CostHint products = fc2_products(z, z.Sc * z.B);
  // fc2's input half, with its weight half folded in unless the W action runs it.
  const TaskId fc2 =
      P->compute(at + "_fc2_backward", tags, keep ? products : products + products, [=] {
        const SharedExpertActivations& S = p->acts(set, layer).moe().shared;
        const SharedExpertWorkspace& w = p->ws().shared_expert;
        const DenseMlpParameters& M = p->moe_parameters(layer).shared;
        if (!p->half()) {
          ops::linear_backward_input(w.d_out, M.fc2_weight->value, w.d_act);
          if (keep)
            S.saved_d_out.copy_from(w.d_out);
          else
            ops::linear_backward_weight(S.act, w.d_out, M.fc2_weight->grad, Tensor{});
          return;
        }
        // The output gradient rounded: in place unless it is d_mlp itself, which the routed
        // experts' backward reads, or the W action needs it kept.
        Tensor dy = w.d_out;
        if (keep) {
          dy = S.saved_d_out;
          dy.copy_from(w.d_out);
        } else if (dy.data() == p->ws().d_mlp.data()) {
          dy = Tensor::empty(w.d_out.shape());
          dy.copy_from(w.d_out);
        }
        round_in_place(p->precision(), dy);
        linear_backward_input_half(p->precision(), dy, M.fc2_weight->value16, w.d_act);
        if (!keep) ops::linear_backward_weight(S.act, dy, M.fc2_weight->grad, Tensor{});
      });
  P->after(ready, fc2);
  P->after(gathered, fc2);
  return fc2;
}

TaskId SharedExperts::fc1_backward(const BuildPosition& pos, TaskId fc2,
                                   WeightHalves& halves) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const rt::TaskTags tags = pos.tags(rt::Phase::backward, l);
  const std::string at = fmt::format("L{}.shared_expert", l);
  const SharedExpertWorkspace& W = P->ws().shared_expert;
  const bool gated = z.model.moe_shared_expert_gate, keep = halves.zero_bubble();
  const std::int64_t rows = P->ws().d_mlp.numel() / z.h, h = z.h;
  const rt::CostHint products = fc1_products(z, z.Sc * z.B);
  // The activation's and fc1's input halves, fc1's weight half folded in unless the W action
  // runs it.
  const TaskId fc1 =
      P->compute(at + "_fc1_backward", tags, keep ? products : products + products, [=] {
        const SharedExpertActivations& S = p->acts(set, layer).moe().shared;
        const SharedExpertWorkspace& w = p->ws().shared_expert;
        const DenseMlpParameters& M = p->moe_parameters(layer).shared;
        mlp_activation_backward(p->shape.model, S.fc1, w.d_act, w.d_fc1);
        if (p->half()) {
          round_in_place(p->precision(), w.d_fc1);
          linear_backward_input_half(p->precision(), w.d_fc1, M.fc1_weight->value16, w.d_in_full);
        } else {
          ops::linear_backward_input(w.d_fc1, M.fc1_weight->value, w.d_in_full);
        }
        if (keep)
          S.saved_d_fc1.copy_from(w.d_fc1);
        else
          ops::linear_backward_weight(S.input, w.d_fc1, M.fc1_weight->grad, Tensor{});
      });
  P->after(fc2, fc1);
  if (keep)
    halves.place(WeightPlacement::zero_bubble, [=] {
      return p->compute(
          at + "_weight_grad", pos.tags(rt::Phase::weight, layer),
          fc1_products(z, z.Sc * z.B) + fc2_products(z, z.Sc * z.B), [=] {
            const SharedExpertActivations& S = p->acts(set, layer).moe().shared;
            const DenseMlpParameters& M = p->moe_parameters(layer).shared;
            ops::linear_backward_weight(S.act, S.saved_d_out, M.fc2_weight->grad, Tensor{});
            ops::linear_backward_weight(S.input, S.saved_d_fc1, M.fc1_weight->grad, Tensor{});
          });
    });
  const TaskId reduced = reduce_partial(*P, fc1, W.d_in_full, W.d_in, at + "_grad_reduce", tags);
  const TaskId d_in = reduced != rt::kNoTask ? reduced : fc1;
  if (!gated) return d_in;
  // The gate's input and weight gradients from its logits': d_in += d_logit w, d_w += d_logit x.
  const TaskId gate =
      P->compute(at + "_gate_grad", tags, cost::matmul(rows, h, 1) * 2.0, [p, layer, set, rows, h] {
        const SharedExpertWorkspace& w = p->ws().shared_expert;
        Parameter& gate_weight = *p->moe_parameters(layer).shared_gate;
        const float* x = p->acts(set, layer).ln2.data();
        const Tensor weight = compute_value(gate_weight);  // a 16-bit run's 16-bit copy
        const float* wv = weight.data();
        float* grad = gate_weight.grad.data();
        for (std::int64_t r = 0; r < rows; ++r) {
          const float dl = w.d_logit.data()[r];
          for (std::int64_t j = 0; j < h; ++j) {
            w.d_in.data()[r * h + j] += dl * wv[j];
            grad[j] += dl * x[r * h + j];
          }
        }
      });
  P->after(d_in, gate);
  return gate;
}

TaskId SharedExperts::backward(const BuildPosition& pos, TaskId ready, WeightHalves& halves) const {
  return fc1_backward(pos, fc2_backward(pos, ready, halves), halves);
}

}  // namespace weave::graphs
