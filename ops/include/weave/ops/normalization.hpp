// LayerNorm and RMSNorm over the last dimension.
//
// Both save per-row statistics in the forward (mean and 1/std, or 1/rms) as float tensors of
// shape [rows] (rows = numel / last dimension) for the backward. Parameter gradients
// accumulate (+=), in a fixed order whatever the number of threads.
#pragma once

#include "weave/ops/tensor.hpp"

namespace weave::ops {

// y = (x - mean) / sqrt(var + eps) * gamma + beta; x, y [..., n]; gamma, beta [n];
// mean, rstd [rows]. var is the biased variance, as in torch.nn.LayerNorm.
template <typename T>
void layer_norm_forward(const BasicTensor<T>& x, const BasicTensor<T>& gamma,
                        const BasicTensor<T>& beta, double eps, const BasicTensor<T>& y,
                        const BasicTensor<T>& mean, const BasicTensor<T>& rstd);

// dx written; dgamma, dbeta accumulated (each may be undefined). dx may be dy (in place): each
// row of dy is read before that row of dx is written.
template <typename T>
void layer_norm_backward(const BasicTensor<T>& x, const BasicTensor<T>& gamma,
                         const BasicTensor<T>& mean, const BasicTensor<T>& rstd,
                         const BasicTensor<T>& dy, const BasicTensor<T>& dx,
                         const BasicTensor<T>& dgamma, const BasicTensor<T>& dbeta);

// y = x / sqrt(mean(x^2) + eps) * gamma; rstd [rows] = 1 / sqrt(mean(x^2) + eps).
template <typename T>
void rms_norm_forward(const BasicTensor<T>& x, const BasicTensor<T>& gamma, double eps,
                      const BasicTensor<T>& y, const BasicTensor<T>& rstd);

// dx may be dy, as for layer_norm_backward.
template <typename T>
void rms_norm_backward(const BasicTensor<T>& x, const BasicTensor<T>& gamma,
                       const BasicTensor<T>& rstd, const BasicTensor<T>& dy,
                       const BasicTensor<T>& dx, const BasicTensor<T>& dgamma);

}  // namespace weave::ops
