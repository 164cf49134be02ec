// bf16 mixed-precision training's conversions between the fp32 tensors of the residual stream,
// the norms and the loss and the bf16 tensors the products read and the layers keep.
#pragma once

#include "weave/ops/tensor.hpp"

namespace weave::graphs {

// to = from rounded to nearest even bf16, element by element (same shape; views whose last
// dimension is contiguous), split over the cores of the caller's arena.
void round_to_bf16(const ops::Tensor& from, const ops::Bf16Tensor& to);
// to = from widened to fp32 (exact).
void widen_to_fp32(const ops::Bf16Tensor& from, const ops::Tensor& to);
// x = x rounded to bf16 and kept in fp32: the value a bf16 tensor would hold.
void round_in_place(const ops::Tensor& x);

}  // namespace weave::graphs
