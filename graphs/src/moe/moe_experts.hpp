// The MoE layer's experts' parameters and activation, as training and decoding run them.
#pragma once

#include <string>

#include "model/parameter_declarer.hpp"
#include "moe/moe_parameters.hpp"
#include "weave/ops/experts.hpp"

namespace weave::graphs {

// The experts' activation (--swiglu or GeLU).
ops::ExpertActivation expert_activation(const ModelConfig& m);
// This rank's local experts' fc1 and fc2 (split over tp with expert tensor parallelism), named
// from `prefix` ("layers.3.moe."), reduced over the expert-data-parallel group.
void declare_experts_parameters(ParameterDeclarer& declare, const std::string& prefix,
                                MoeExpertsParameters& W);

}  // namespace weave::graphs
