// Elementwise sums: the residual connection and gradient accumulation.
#pragma once

#include "weave/ops/tensor.hpp"

namespace weave::ops {

// y = a + b (the residual add; y may be a or b). Its backward passes the gradient to both
// inputs unchanged, which callers do with accumulate().
template <typename T>
void add(const BasicTensor<T>& a, const BasicTensor<T>& b, const BasicTensor<T>& y);

// into += scale * x.
template <typename T>
void accumulate(const BasicTensor<T>& x, const BasicTensor<T>& into, T scale = T(1));

}  // namespace weave::ops
