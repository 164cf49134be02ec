#include "moe/moe_shared_experts.hpp"

#include "model/dense_mlp.hpp"
#include "model/sequence_parallel.hpp"
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
rt::CostHint products(const StepShape& z, std::int64_t rows) {
  return cost::matmul(rows, z.h, local_width1(z.model, z.tp)) +
         cost::matmul(rows, local_width(z.model, z.tp), z.h);
}

}  // namespace

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
  W.d_out = sp ? P.activation({Sc, B, h}) : workspace.d_mlp;
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
}

TaskId SharedExperts::forward(const BuildPosition& pos, TaskId ready) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const rt::TaskTags tags = pos.tags(rt::Phase::forward, l);
  const std::string at = fmt::format("L{}.shared_expert", l);
  const SharedExpertActivations& S = P->acts(set, l).moe().shared;
  TaskId gathered = rt::kNoTask;
  if (z.sp())
    gathered = sp_gather(*P, ready, P->acts(set, l).ln2, S.input, at + "_sp_gather", tags);
  const TaskId mlp = P->compute(at, tags, products(z, z.Sc * z.B), [p, layer, set] {
    const SharedExpertActivations& S = p->acts(set, layer).moe().shared;
    dense_mlp_forward(p->shape.model, p->moe_parameters(layer).shared, S.input, S.fc1, S.act,
                      S.partial);
  });
  P->after(ready, mlp);
  P->after(gathered, mlp);
  const TaskId reduced = reduce_partial(*P, mlp, S.partial, S.out, at + "_reduce", tags);
  return reduced != rt::kNoTask ? reduced : mlp;
}

TaskId SharedExperts::backward(const BuildPosition& pos, TaskId ready) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const rt::TaskTags tags = pos.tags(rt::Phase::backward, l);
  const std::string at = fmt::format("L{}.shared_expert", l);
  const SharedExpertWorkspace& W = P->ws().shared_expert;
  TaskId gathered = rt::kNoTask;
  if (z.sp()) gathered = sp_gather(*P, ready, P->ws().d_mlp, W.d_out, at + "_grad_gather", tags);
  // Both products' input and weight halves: twice the forward's.
  const TaskId mlp = P->compute(at + "_backward", tags, 2 * products(z, z.Sc * z.B), [=] {
    const SharedExpertActivations& S = p->acts(set, layer).moe().shared;
    const SharedExpertWorkspace& w = p->ws().shared_expert;
    const DenseMlpParameters& M = p->moe_parameters(layer).shared;
    ops::linear_backward_input(w.d_out, M.fc2_weight->value, w.d_act);
    ops::linear_backward_weight(S.act, w.d_out, M.fc2_weight->grad, Tensor{});
    mlp_activation_backward(p->shape.model, S.fc1, w.d_act, w.d_fc1);
    ops::linear_backward_input(w.d_fc1, M.fc1_weight->value, w.d_in_full);
    ops::linear_backward_weight(S.input, w.d_fc1, M.fc1_weight->grad, Tensor{});
  });
  P->after(ready, mlp);
  P->after(gathered, mlp);
  const TaskId reduced = reduce_partial(*P, mlp, W.d_in_full, W.d_in, at + "_grad_reduce", tags);
  return reduced != rt::kNoTask ? reduced : mlp;
}

}  // namespace weave::graphs
