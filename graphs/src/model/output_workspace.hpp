// The output layer's and loss's share of the backward's workspace, on the last stage's devices.
#pragma once

#include "weave/ops/tensor.hpp"

namespace weave::graphs {

using ops::Tensor;

struct OutputWorkspace {
  Tensor d_logits, d_final_full;  // [S B, Vl], [S, B, h]
};

}  // namespace weave::graphs
