// The parameters of a layer's MoE MLP on one rank, declared by MoeMlp::declare_parameters.
#pragma once

#include "weave/graphs/model_shard.hpp"

namespace weave::graphs {

struct MoeMlpParameters {
  Parameter* router_weight = nullptr;  // [experts, h], replicated
  Parameter* expert_fc1 = nullptr;     // local [local experts, f1, h]
  Parameter* expert_fc2 = nullptr;     // local [local experts, h, f]
};

}  // namespace weave::graphs
