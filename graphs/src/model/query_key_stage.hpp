// A step of the attention on each head's queries and keys, between the QKV projection and the
// rotary embedding, where Megatron-Core's SelfAttention applies its q_layernorm and k_layernorm
// submodules. The layer's spec lists the stages a layer runs (LayerSpec::query_key); the
// attention runs them, forward and backward, in every path that projects QKV (training's
// strategies through project_qkv, and decoding) without naming any, so a stage owns its
// parameters, its saved state, its forward and backward and their cost, and a new one is a
// file of its own and its entry in the spec.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "weave/graphs/model_config.hpp"
#include "weave/graphs/model_shard.hpp"
#include "weave/ops/tensor.hpp"
#include "weave/runtime/types.hpp"

namespace weave::graphs {

class ParameterDeclarer;
struct LayerSpec;
struct StepShape;

// A stage's parameters on one rank (null entries for absent ones, as the stage lays them out)
// and what it keeps from forward for backward, for one micro-batch or one decoded token.
using StageParameters = std::vector<Parameter*>;
using StageState = std::vector<ops::Tensor>;

// The QKV rows a stage sees: `rows` (s B) rows of Gl key/value groups, each qpg query heads, a
// key and a value of head_dim d, stored [s, B, Gl, (qpg + 2) d].
struct QkvRows {
  std::int64_t rows = 0, groups = 0, queries_per_group = 0, head_dim = 0;
};

class QueryKeyStage {
 public:
  virtual ~QueryKeyStage() = default;
  // The stage's parameters of a layer, named from `prefix` ("layers.3.attention."), in the
  // attention's bucket.
  virtual StageParameters declare_parameters(ParameterDeclarer& declare, const LayerSpec& spec,
                                             const std::string& prefix) const = 0;
  // What forward keeps for `at`'s rows, from `allocate` (none for a stage without state).
  virtual StageState allocate(const std::function<ops::Tensor(const ops::Shape&)>& allocate,
                              const QkvRows& at) const = 0;
  // In place on qkv [s, B, Gl, (qpg + 2) d], keeping `state`.
  virtual void forward(const ModelConfig& m, const StageParameters& params, const ops::Tensor& qkv,
                       const StageState& state) const = 0;
  // In place on its gradient d_qkv, its parameters' gradients accumulated.
  virtual void backward(const ModelConfig& m, const StageParameters& params,
                        const ops::Tensor& d_qkv, const StageState& state) const = 0;
  // Its cost on a rank's rows of the step, forward or backward (added to the QKV task's).
  virtual rt::CostHint cost(const StepShape& z, bool backward) const = 0;
};

}  // namespace weave::graphs
