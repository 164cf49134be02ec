#include "layer_spec.hpp"

namespace weave::graphs {

LayerSpec resolve_layer_spec(const ModelConfig& model, const ParallelPlan& plan, int layer) {
  LayerSpec spec;
  spec.attention = plan.context_parallel > 1 ? AttentionCore::ring : AttentionCore::local;
  if (model.is_moe_layer(layer))
    spec.mlp = plan.ampipe_degree > 1 ? MlpModule::ampipe : MlpModule::moe;
  spec.norm = model.normalization;
  return spec;
}

}  // namespace weave::graphs
