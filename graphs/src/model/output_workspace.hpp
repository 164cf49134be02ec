// The output layer's and loss's share of the backward's workspace, on the last stage's devices.
#pragma once

#include "weave/ops/tensor.hpp"

namespace weave::graphs {

using ops::Tensor;

struct OutputWorkspace {
  // [S B, Vl], [S, B, h]. A 16-bit run has no d_logits: its loss writes the fp32 gradient over
  // its fp32 logits and rounds it into HalfWorkspace::d_logits16.
  Tensor d_logits, d_final_full;
};

}  // namespace weave::graphs
