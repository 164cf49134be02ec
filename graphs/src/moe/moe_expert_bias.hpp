// Megatron-Core's aux-loss-free load balancing (--moe-router-enable-expert-bias): each MoE layer's
// per-expert bias, added to the sigmoid scores to choose the experts (not to weigh them), is moved
// after every step by --moe-router-bias-update-rate towards the mean load: up for the experts that
// kept fewer picks than the mean over the step, down for those that kept more. The loads are this
// rank's picks after the capacity's drops, summed over the step's micro-batches and then over
// every rank of the stage (tensor, context, data and expert parallel), so every rank moves its
// copy of the bias alike, as Megatron-Core's finalize_model_grads sums them over its tensor x
// data x context group.
#pragma once

#include "weave/graphs/model_config.hpp"
#include "weave/ops/moe_dispatch.hpp"

namespace weave::graphs {

class RankProgram;

// Whether the model's MoE layers route with the expert bias (Megatron-Core's router only).
bool uses_expert_bias(const ModelConfig& m);
// Adds the picks each expert kept in `plan` to layer `layer`'s loads of the step (nothing without
// the bias).
void count_expert_loads(RankProgram& P, int layer, const ops::DispatchPlan& plan);
// After the step's last forward: each MoE layer's loads summed over the stage's ranks, then its
// bias moved (nothing without the bias).
void build_expert_bias_update(RankProgram& P);

}  // namespace weave::graphs
