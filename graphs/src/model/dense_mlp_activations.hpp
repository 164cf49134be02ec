// What a dense layer's MLP keeps for its backward, on one device, for one micro-batch in flight,
// and the gradient workspace its backward uses.
#pragma once

#include "weave/ops/tensor.hpp"

namespace weave::graphs {

using ops::Tensor;

struct DenseMlpActivations {
  Tensor fc1, act, fc2_partial;  // [Sc, B, f1l], [Sc, B, fl], [Sc, B, h]
  // A split backward (zero-bubble schedules): fc2's and fc1's output gradients, kept from the
  // input-gradient half (I) until the weight half (W) runs.
  Tensor saved_d_fc2, saved_d_fc1;
  // A bf16 run keeps fc1's output and the activation in bf16 instead (fc1, act undefined).
  ops::Bf16Tensor fc1_16, act16;
  // A bf16 run's split backward keeps the output gradients in the bf16 its products read.
  ops::Bf16Tensor saved_d_fc2_16, saved_d_fc1_16;
};

// The dense MLP's share of the backward's workspace, one per device for all its layers: the
// activation's and fc1's output gradients (an fp32 run's; a 16-bit run's are the bf16 ones its
// products read, HalfWorkspace::d_act16 and d_fc1_16).
struct DenseMlpWorkspace {
  Tensor d_act, d_fc1;  // [S, B, f], [S, B, f1]
};

}  // namespace weave::graphs
