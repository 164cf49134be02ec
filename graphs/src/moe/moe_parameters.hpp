// The parameters of a layer's MoE MLP on one rank, one struct per part: the router's, declared by
// declare_router_parameters (moe_router.cpp), and this rank's experts', declared by
// declare_experts_parameters (moe_experts.cpp). The token dispatcher has none.
#pragma once

#include "model/dense_mlp_parameters.hpp"
#include "weave/graphs/model_shard.hpp"

namespace weave::graphs {

struct MoeRouterParameters {
  Parameter* weight = nullptr;  // [experts, h], replicated
  // --moe-router-enable-expert-bias: [experts], the same on every rank; null without it.
  ModelState* expert_bias = nullptr;
};

struct MoeExpertsParameters {
  Parameter* fc1 = nullptr;  // local [local experts, f1, h]
  Parameter* fc2 = nullptr;  // local [local experts, h, f]
};

struct MoeMlpParameters {
  MoeRouterParameters router;
  MoeExpertsParameters experts;
  // --moe-shared-expert-intermediate-size: the shared experts' fc1 (column-parallel) and fc2
  // (row-parallel), declared by declare_shared_expert_parameters (moe_shared_experts.cpp); no
  // biases. Null without shared experts.
  DenseMlpParameters shared;
  // --moe-shared-expert-gate: the shared experts' gate weight [1, h], replicated; null without.
  Parameter* shared_gate = nullptr;
};

}  // namespace weave::graphs
