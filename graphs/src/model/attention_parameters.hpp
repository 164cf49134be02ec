// The parameters of a layer's attention on one rank: those it declares (attention_block.cpp) and
// reads, forward and backward, in training and in decoding. A new attention parameter is a field
// here and its declaration in AttentionBlock::declare_parameters.
#pragma once

#include <vector>

#include "model/query_key_stage.hpp"
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
  // Each of the spec's query/key stages' own, in the spec's order (LayerSpec::query_key).
  std::vector<StageParameters> query_key;
  Parameter* proj_weight = nullptr;  // local [h, h/tp]
  Parameter* proj_bias = nullptr;    // added by the layer with its residual
};

}  // namespace weave::graphs
