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

// A MoE MLP's token dispatcher: the permutation alone (one expert-parallel rank), one framed
// all-to-all per slot each way, or one per item (--use-pipe-experts, or split experts under
// --ampipe-tp-sp-comm-overlap).
enum class TokenDispatcher { permute, all_to_all, item_all_to_all };
// Its experts: each local expert whole on its rank, or split over the tensor-parallel group
// (--expert-tensor-parallel-size).
enum class ExpertsModule { local, tensor_split };

// A MoE MLP's parts, as Megatron-Core's MoELayer is made of a TopKRouter (one kind here), the
// token dispatcher its configuration chooses and the experts its MoESubmodules name.
struct MoeSpec {
  TokenDispatcher dispatcher = TokenDispatcher::permute;
  ExpertsModule experts = ExpertsModule::local;
};

// The plan's MoE layout, which the spec and StepShape both read: every expert split over the
// tensor-parallel group (--expert-tensor-parallel-size); --use-pipe-experts with expert
// parallelism; and --ampipe-tp-sp-comm-overlap (section 4 of MindSpeed's Ampipe), which runs
// split experts as items of (chunk, local expert) with their tensor-parallel collectives
// pipelined across the chunks.
inline bool plan_splits_experts(const ParallelPlan& p) {
  return p.expert_tensor_parallel > 1 && p.tensor_parallel > 1;
}
inline bool plan_pipes_experts(const ParallelPlan& p) {
  return p.pipe_experts && p.expert_parallel > 1;
}
inline bool plan_overlaps_tp_sp(const ParallelPlan& p) {
  return p.ampipe_tp_sp_comm_overlap && plan_splits_experts(p) && p.ampipe_degree > 1 &&
         p.expert_parallel > 1 && !plan_pipes_experts(p);
}

inline MoeSpec resolve_moe_spec(const ParallelPlan& plan) {
  MoeSpec moe;
  if (plan.expert_parallel > 1)
    moe.dispatcher = plan_pipes_experts(plan) || plan_overlaps_tp_sp(plan)
                         ? TokenDispatcher::item_all_to_all
                         : TokenDispatcher::all_to_all;
  if (plan_splits_experts(plan)) moe.experts = ExpertsModule::tensor_split;
  return moe;
}

struct LayerSpec {
  AttentionCore attention = AttentionCore::local;
  MlpModule mlp = MlpModule::dense;
  MoeSpec moe_mlp;                                 // a MoE (or Ampipe) layer's parts
  Normalization norm = Normalization::layer_norm;  // every norm of the layer
  // What the attention does to each head's queries and keys after the QKV projection, in order,
  // as Megatron-Core's SelfAttentionSubmodules name q_layernorm and k_layernorm.
  std::vector<const QueryKeyStage*> query_key;

  bool moe() const { return mlp != MlpModule::dense; }
};

inline LayerSpec resolve_layer_spec(const ModelConfig& model, const ParallelPlan& plan, int layer) {
  LayerSpec spec;
  spec.attention = plan.context_parallel > 1 ? AttentionCore::ring : AttentionCore::local;
  if (model.is_moe_layer(layer)) {
    spec.mlp = plan.ampipe_degree > 1 ? MlpModule::ampipe : MlpModule::moe;
    spec.moe_mlp = resolve_moe_spec(plan);
  }
  spec.norm = model.normalization;
  if (model.qk_layernorm) spec.query_key.push_back(&qk_norm_stage());
  return spec;
}

}  // namespace weave::graphs
