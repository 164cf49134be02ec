// The parameters of a layer's dense MLP on one rank, declared by DenseMlp::declare_parameters.
#pragma once

#include "weave/graphs/model_shard.hpp"

namespace weave::graphs {

// Biases are null with --disable-bias-linear.
struct DenseMlpParameters {
  Parameter* fc1_weight = nullptr;  // local [f1/tp, h]; SwiGLU: this rank's gates, then values
  Parameter* fc1_bias = nullptr;
  Parameter* fc2_weight = nullptr;  // local [h, f/tp]
  Parameter* fc2_bias = nullptr;    // added by the layer with its residual
};

}  // namespace weave::graphs
