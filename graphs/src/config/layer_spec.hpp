// Which modules a transformer layer is made of, resolved once from the model and the parallel
// plan, as Megatron-Core's TransformerLayerSubmodules and MoESubmodules name a layer's parts. The
// layer's parameter declarations, its activation layout and its forward and backward emitters
// dispatch on this value instead of testing the configuration again.
#pragma once

#include <vector>

#include "weave/graphs/model_config.hpp"
#include "weave/graphs/parallel_plan.hpp"

namespace weave::graphs {

// The attention's stages on each head's queries and keys (model/query_key_stage.hpp), each
// defined in a file of its own.
class QueryKeyStage;
const QueryKeyStage& qk_norm_stage();  // --qk-layernorm (model/qk_norm.cpp)

// The attention's core: every key and value on the rank, or a ring of key/value blocks passed
// round the context-parallel group.
enum class AttentionCore { local, ring };

// The layer's MLP: dense, Mixture-of-Experts, or the Ampipe block (a MoE layer under
// --ampipe-degree > 1, whose attention and MoE MLP run as sequence chunks together).
enum class MlpModule { dense, moe, ampipe };

struct LayerSpec {
  AttentionCore attention = AttentionCore::local;
  MlpModule mlp = MlpModule::dense;
  Normalization norm = Normalization::layer_norm;  // every norm of the layer
  // What the attention does to each head's queries and keys after the QKV projection, in order,
  // as Megatron-Core's SelfAttentionSubmodules name q_layernorm and k_layernorm.
  std::vector<const QueryKeyStage*> query_key;

  bool moe() const { return mlp != MlpModule::dense; }
};

inline LayerSpec resolve_layer_spec(const ModelConfig& model, const ParallelPlan& plan, int layer) {
  LayerSpec spec;
  spec.attention = plan.context_parallel > 1 ? AttentionCore::ring : AttentionCore::local;
  if (model.is_moe_layer(layer))
    spec.mlp = plan.ampipe_degree > 1 ? MlpModule::ampipe : MlpModule::moe;
  spec.norm = model.normalization;
  if (model.qk_layernorm) spec.query_key.push_back(&qk_norm_stage());
  return spec;
}

}  // namespace weave::graphs
