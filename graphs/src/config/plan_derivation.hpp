// The values a parallel plan implies, derived from the flags as given before any rule is
// checked (validate() derives, then checks).
#pragma once

#include <string>
#include <vector>

#include "weave/graphs/model_config.hpp"
#include "weave/graphs/parallel_plan.hpp"

namespace weave::graphs {

// Fills in what the flags imply (virtual stages from --num-layers-per-virtual-pipeline-stage or
// zb-v, split experts from --moe-model-type deepspeed_moe) and switches off what cannot apply,
// returning a warning for each feature switched off or without effect. Refuses nothing: a value
// whose inputs break a rule is left as given (or derived without dividing by a size that may be
// zero), and check_plan_rules() then refuses the plan.
std::vector<std::string> derive_plan(const ModelConfig& model, ParallelPlan& plan);

// The tokens an expert takes from one Ampipe chunk of a micro-batch at a capacity factor > 0:
// ceil(factor x routed tokens x top-k / experts), as a double (a huge factor gives a capacity no
// integer holds).
double expert_capacity_per_chunk(const ModelConfig& model, const ParallelPlan& plan);

}  // namespace weave::graphs
