// --qk-layernorm: a norm on each head's queries and on each head's key (LayerNorm or RMSNorm as
// --normalization says), as OLMo 2 and Qwen3 use and Megatron-Core's q_layernorm and k_layernorm
// apply, before the rotary embedding. One weight (and LayerNorm bias) of head_dim per part,
// shared by every head: each tp rank norms its own heads with the whole weight.
#include <fmt/format.h>

#include "config/layer_spec.hpp"
#include "config/step_shape.hpp"
#include "model/norm.hpp"
#include "model/parameter_declarer.hpp"
#include "model/query_key_stage.hpp"
#include "step/step_costs.hpp"

namespace weave::graphs {

namespace {

using ops::Tensor;

// The parameters' layout: the queries' weight and bias, then the keys'.
enum Slot { q_weight, q_bias, k_weight, k_bias, slots };
// The state's: the queries and keys before their norms [s B, Gl, qpg + 1, d] and each head's
// statistics [s B Gl (qpg + 1)], queries' first.
enum StateSlot { input, mean, rstd };

// One of the two norms: its heads in a QKV tensor (or its gradient) as rows of d, their saved
// inputs and statistics, and its parameters.
struct Part {
  Tensor heads, in, mean, rstd;
  const Parameter* weight;
  const Parameter* bias;
};

// Part 0: the queries [s B, Gl, qpg, d]; part 1: the keys [s B, Gl, 1, d].
Part part_of(const StageParameters& W, const Tensor& qkv, const StageState& state, std::int64_t d,
             int part) {
  const std::int64_t qpg = qkv.dim(3) / d - 2;
  const Tensor heads = qkv.reshape({qkv.dim(0) * qkv.dim(1), qkv.dim(2), qpg + 2, d});
  const std::int64_t first = part == 0 ? 0 : qpg, count = part == 0 ? qpg : 1;
  const Tensor& saved_mean = state[mean];
  const std::int64_t stats = state[rstd].numel() / (qpg + 1);  // s B Gl: one head of every group
  const Tensor part_mean =
      saved_mean.defined() ? saved_mean.slice(0, first * stats, count * stats) : Tensor{};
  return {.heads = heads.slice(2, first, count),
          .in = state[input].slice(2, first, count),
          .mean = part_mean,
          .rstd = state[rstd].slice(0, first * stats, count * stats),
          .weight = W[part == 0 ? q_weight : k_weight],
          .bias = W[part == 0 ? q_bias : k_bias]};
}

class QkNorm final : public QueryKeyStage {
 public:
  StageParameters declare_parameters(ParameterDeclarer& declare, const LayerSpec& spec,
                                     const std::string& prefix) const override {
    const std::int64_t d = declare.model.head_dim();
    // Every tp rank norms other heads with the same weight: its gradient is a partial sum.
    auto norm = [&](const char* name, double value) {
      return &declare.replicated(
          declare.add(prefix + name, {d}, d, 1, RowMap::range(0, d), 0, 0, value), true);
    };
    const bool biases = spec.norm == Normalization::layer_norm;
    StageParameters W(slots, nullptr);
    W[q_weight] = norm("q_norm.weight", 1);
    if (biases) W[q_bias] = norm("q_norm.bias", 0);
    W[k_weight] = norm("k_norm.weight", 1);
    if (biases) W[k_bias] = norm("k_norm.bias", 0);
    return W;
  }

  StageState allocate(const std::function<Tensor(const ops::Shape&)>& allocate,
                      const QkvRows& at) const override {
    const std::int64_t per_group = at.queries_per_group + 1;  // its query heads and its key
    const std::int64_t heads = at.rows * at.groups * per_group;
    StageState state;
    state.push_back(allocate({at.rows, at.groups, per_group, at.head_dim}));
    state.push_back(allocate({heads}));
    state.push_back(allocate({heads}));
    return state;
  }

  void forward(const ModelConfig& m, const StageParameters& W, const Tensor& qkv,
               const StageState& state) const override {
    for (int part = 0; part < 2; ++part) {
      const Part q = part_of(W, qkv, state, m.head_dim(), part);
      q.in.copy_from(q.heads);
      norm_forward(m, q.in, *q.weight, q.bias, q.heads, q.mean, q.rstd);
    }
  }

  void backward(const ModelConfig& m, const StageParameters& W, const Tensor& d_qkv,
                const StageState& state) const override {
    for (int part = 0; part < 2; ++part) {
      const Part q = part_of(W, d_qkv, state, m.head_dim(), part);
      norm_backward(m, q.in, *q.weight, q.bias, q.mean, q.rstd, q.heads, q.heads);
    }
  }

  // Forward reads and writes each query and key once and keeps a copy (4 passes); backward reads
  // the gradient and the saved input and writes the gradient (3).
  rt::CostHint cost(const StepShape& z, bool backward) const override {
    const double passes = backward ? 3 : 4;
    return cost::streamed(z, passes * static_cast<double>(z.Sc * z.B * (z.Hl + z.Gl) * z.d));
  }
};

}  // namespace

const QueryKeyStage& qk_norm_stage() {
  static const QkNorm stage;
  return stage;
}

}  // namespace weave::graphs
