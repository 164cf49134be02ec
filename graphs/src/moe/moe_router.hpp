// The MoE layer's router, as training's slots and decoding's one token both run it.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "config/step_shape.hpp"
#include "model/parameter_declarer.hpp"
#include "moe/moe_activations.hpp"
#include "moe/moe_parameters.hpp"
#include "weave/ops/router.hpp"

namespace weave::graphs {

// The router's top-k choice, renormalisation and losses, from the model's settings, as decoding
// routes (Megatron-Core's router outside training).
ops::RouterOptions router_options(const ModelConfig& m);
// As training routes a slot: with seq_aux_loss's sequences (the micro-batch's) and sinkhorn's
// balanced picks.
ops::RouterOptions training_router_options(const StepShape& z);
// Floats of a slot's router statistics (moe_router.cpp's layout).
std::int64_t router_statistics_size(const StepShape& z);
// The router's weight [experts, h], named from `prefix` ("layers.3.moe.").
void declare_router_parameters(ParameterDeclarer& declare, const std::string& prefix,
                               MoeRouterParameters& W);
// Rows x [n, h] routed: their logits [n, E], softmax probabilities, top-k experts and weights;
// returns the rows' statistics. Training's slots and decoding's token route through it.
ops::RouterStatistics route_tokens(const ModelConfig& m, const MoeRouterParameters& W,
                                   const Tensor& x, const Tensor& logits, const Tensor& probs,
                                   std::span<std::int32_t> topk_index, const Tensor& topk_weight);
// A slot's tokens (moe_in) routed, their statistics in the slot's stats.
void route_slot(const StepShape& z, const MoeRouterParameters& W, MoeSlot& A);
// Its backward from the top-k weights' gradient d_topk and the micro-batch's statistics
// `stats_total` (the losses' gradients): the router's weight gradient, and the router's share of
// the input gradient added to d_moe_in. `loss_scale`: a loss scaler's scale (1 without one),
// by which the losses' gradients are multiplied as the main loss's are, so that the unscaling of
// every gradient leaves them as an unscaled run's.
void route_slot_backward(const StepShape& z, const MoeRouterParameters& W,
                         const Tensor& stats_total, double loss_scale, MoeSlot& A);

}  // namespace weave::graphs
