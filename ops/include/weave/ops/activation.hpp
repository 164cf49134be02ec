// Activations: GELU (tanh approximation and exact erf form) and SwiGLU.
#pragma once

#include "weave/ops/tensor.hpp"

namespace weave::ops {

enum class GeluForm {
  tanh,  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), GPT-2 and Megatron's default
  erf,   // 0.5 x (1 + erf(x / sqrt(2))), torch's approximate='none'
};

// y = gelu(x), same shapes (y may be x itself).
template <typename T>
void gelu_forward(GeluForm form, const BasicTensor<T>& x, const BasicTensor<T>& y);
// dx = dy * gelu'(x); dx may alias dy.
template <typename T>
void gelu_backward(GeluForm form, const BasicTensor<T>& x, const BasicTensor<T>& dy,
                   const BasicTensor<T>& dx);

// x [..., 2f] holds the gate a = x[..., :f] and the value b = x[..., f:] (Megatron's layout:
// the fused first linear's output split in two halves); y [..., f] = silu(a) * b.
template <typename T>
void swiglu_forward(const BasicTensor<T>& x, const BasicTensor<T>& y);
// dx [..., 2f] from dy [..., f].
template <typename T>
void swiglu_backward(const BasicTensor<T>& x, const BasicTensor<T>& dy, const BasicTensor<T>& dx);

}  // namespace weave::ops
