// The parameters of a layer's attention on one rank: those it declares (attention_block.cpp) and
// reads, forward and backward, in training and in decoding. A new attention parameter is a field
// here and its declaration in AttentionBlock::declare_parameters.
#pragma once

#include "weave/graphs/model_shard.hpp"

namespace weave::graphs {

// Biases are null with --disable-bias-linear, norm biases with RMSNorm.
struct AttentionParameters {
  Parameter* ln1_weight = nullptr;  // the input norm
  Parameter* ln1_bias = nullptr;
  // local [groups/tp x (heads/groups + 2) x head_dim, h]: per key/value group its query heads,
  // its key, its value (per head q, k, v without grouped-query attention)
  Parameter* qkv_weight = nullptr;
  Parameter* qkv_bias = nullptr;
  // --qk-layernorm: the norms of every query head and every key head, [head_dim] each, the same
  // on every tp rank (biases with LayerNorm only).
  Parameter* q_norm_weight = nullptr;
  Parameter* q_norm_bias = nullptr;
  Parameter* k_norm_weight = nullptr;
  Parameter* k_norm_bias = nullptr;
  Parameter* proj_weight = nullptr;  // local [h, h/tp]
  Parameter* proj_bias = nullptr;    // added by the layer with its residual
};

}  // namespace weave::graphs
