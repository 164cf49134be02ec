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

// bf16 linear layers (gemm_bf16: products of bf16 values summed in fp32), as mixed-precision
// training stores them: parameters and activations in bf16, parameter gradients in fp32.

// y = x w^T + b, rounded to bf16 once after the fp32 sum (the bias added in fp32 too).
void linear_forward(const Bf16Tensor& x, const Bf16Tensor& w, const Bf16Tensor& b,
                    const Bf16Tensor& y);
// dx = dy w, rounded to bf16 once.
void linear_backward_input(const Bf16Tensor& dy, const Bf16Tensor& w, const Bf16Tensor& dx);
// dw [out, in] += dy^T x and db [out] += the sum of dy's rows, in fp32 (the gradients the
// optimizer's fp32 main parameters take; db may be undefined).
// The same in fp16 (gemm_fp16): fp16 runs.
void linear_forward(const Fp16Tensor& x, const Fp16Tensor& w, const Fp16Tensor& b,
                    const Fp16Tensor& y);
void linear_backward_input(const Fp16Tensor& dy, const Fp16Tensor& w, const Fp16Tensor& dx);
void linear_backward_weight(const Fp16Tensor& x, const Fp16Tensor& dy, const Tensor& dw,
                            const Tensor& db = {});
void linear_backward_weight(const Bf16Tensor& x, const Bf16Tensor& dy, const Tensor& dw,
                            const Tensor& db);

}  // namespace weave::ops
