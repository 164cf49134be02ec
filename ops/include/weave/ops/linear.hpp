// Linear layer: y = x W^T + b, as in torch.nn.Linear and Megatron's column/row-parallel
// linears (which shard W's rows or columns and call this on the shard).
//
// Conventions shared by every kernel in ops/: outputs are written (not accumulated) into
// tensors the caller allocates; gradients of parameters are ACCUMULATED (+=), so micro-batches
// and sequence chunks add into one gradient buffer; gradients of inputs are written. An
// undefined tensor (BasicTensor{}) means "not wanted" (no bias, no dx).
#pragma once

#include "weave/ops/tensor.hpp"

namespace weave::ops {

// x [..., in], w [out, in], b [out] or undefined; y [..., out].
template <typename T>
void linear_forward(const BasicTensor<T>& x, const BasicTensor<T>& w, const BasicTensor<T>& b,
                    const BasicTensor<T>& y);

// dx [..., in] = dy w. The input-gradient half of the backward (phase B of a zero-bubble
// schedule).
template <typename T>
void linear_backward_input(const BasicTensor<T>& dy, const BasicTensor<T>& w,
                           const BasicTensor<T>& dx);

// dw [out, in] += dy^T x; db [out] += the sum of dy's rows (db may be undefined). The
// weight-gradient half (phase W).
template <typename T>
void linear_backward_weight(const BasicTensor<T>& x, const BasicTensor<T>& dy,
                            const BasicTensor<T>& dw, const BasicTensor<T>& db);

}  // namespace weave::ops
