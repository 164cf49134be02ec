// Softmax over the last dimension.
#pragma once

#include "weave/ops/tensor.hpp"

namespace weave::ops {

// y = exp(x - max) / sum(exp(x - max)) per row; y may be x.
template <typename T>
void softmax_forward(const BasicTensor<T>& x, const BasicTensor<T>& y);
// dx = y * (dy - sum(dy * y)) per row, from the forward's output y.
template <typename T>
void softmax_backward(const BasicTensor<T>& y, const BasicTensor<T>& dy, const BasicTensor<T>& dx);

}  // namespace weave::ops
