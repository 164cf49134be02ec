#include "config/step_shape.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "weave/ops/deepspeed_gate.hpp"

namespace weave::graphs {

StepShape::StepShape(const ModelConfig& m, const ParallelPlan& p) : model(m), plan(p) {
  tp = p.tensor_parallel;
  t_sp = p.sequence_parallel ? tp : 1;
  cp = p.context_parallel;
  ep = p.expert_parallel;
  etp = plan_splits_experts(p) ? p.tensor_parallel : 1;
  M = p.micro_batches();
  ampipe = p.ampipe_degree;
  S = m.seq_length;
  Sc = S / cp;
  chunk = cp > 1 ? Sc / 2 : Sc;
  B = p.micro_batch_size;
  Sl = Sc / t_sp;
  h = m.hidden_size;
  d = m.head_dim();
  Hl = m.num_attention_heads / tp;
  Gl = m.query_groups() / tp;
  qpg = m.num_attention_heads / m.query_groups();
  f = m.ffn_hidden_size;
  fl = f / tp;
  f1l = m.activation == Activation::swiglu ? 2 * fl : fl;
  fe = m.expert_ffn_hidden_size();
  Vl = m.padded_vocab_size(tp) / tp;
  routes_replicated = plan_routes_replicated(m, p);
  T = routes_replicated ? Sc * B : Sc / tp * B;
  for (int l = 0; l < m.num_layers; ++l)
    layers.push_back(resolve_layer_spec(m, p, l));
  if (m.num_experts > 0 && tp > 1 && !routes_replicated && Sc % tp != 0)
    throw ConfigError(fmt::format(
        "--seq-length ({}) must be divisible by --tensor-model-parallel-size x "
        "--context-parallel-size ({}) in a MoE model: each tensor-parallel rank routes its "
        "share of the positions",
        S, tp * cp));
}

std::int64_t StepShape::expert_capacity() const {
  // MindSpeed's gate drops each gate call's picks beyond its capacity (unless --moe-no-drop), so
  // a source sends an expert at most that many: the buffers the experts' collectives move are
  // sized by it, as MindSpeed's [ep, capacity, h] tensors are.
  if (model.num_experts > 0 && model.moe_gate == MoeGate::deepspeed)
    return model.moe_no_drop
               ? 0
               : ops::gate_capacity(slot_tokens(), model.num_experts, model.moe_router_topk,
                                    model.moe_train_capacity_factor);
  if (model.moe_expert_capacity_factor <= 0) return 0;
  const std::int64_t n = slot_tokens(), k = model.moe_router_topk;
  return static_cast<std::int64_t>(
      std::ceil(model.moe_expert_capacity_factor * static_cast<double>(n * k) /
                static_cast<double>(model.num_experts)));
}

std::int64_t StepShape::slot_capacity() const {
  const std::int64_t rows = ep * slot_tokens() * model.moe_router_topk;
  return expert_capacity() > 0 ? std::min(rows, model.num_experts * expert_capacity()) : rows;
}

std::int64_t StepShape::context_position(int cp_rank, std::int64_t s) const {
  if (cp == 1) return s;
  const std::int64_t which = s / chunk == 0 ? cp_rank : 2 * cp - 1 - cp_rank;
  return which * chunk + s % chunk;
}

}  // namespace weave::graphs
