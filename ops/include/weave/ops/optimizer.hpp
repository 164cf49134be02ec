// Optimizer steps and gradient clipping, with PyTorch's semantics (torch.optim.AdamW,
// torch.optim.SGD, torch.nn.utils.clip_grad_norm_).
//
// Each step works on one parameter tensor and its state, so a distributed optimizer can step
// the shard it owns. Tensors must be contiguous and of equal shapes.
#pragma once

#include <cstdint>
#include <span>

#include "weave/ops/tensor.hpp"

namespace weave::ops {

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;  // decoupled: p -= lr * wd * p before the Adam update
};

// step counts from 1 (bias correction uses it). exp_avg and exp_avg_sq start at zero.
template <typename T>
void adamw_step(const AdamWOptions& options, std::int64_t step, const BasicTensor<T>& param,
                const BasicTensor<T>& grad, const BasicTensor<T>& exp_avg,
                const BasicTensor<T>& exp_avg_sq);

struct SgdOptions {
  double lr = 1e-2;
  double momentum = 0;
  double dampening = 0;
  double weight_decay = 0;  // L2: added to the gradient
  bool nesterov = false;
};

// momentum_buffer may be undefined when momentum is 0. On step 1 the buffer is set to the
// gradient, as PyTorch does.
template <typename T>
void sgd_step(const SgdOptions& options, std::int64_t step, const BasicTensor<T>& param,
              const BasicTensor<T>& grad, const BasicTensor<T>& momentum_buffer);

// The sum of squares of all gradients' elements (accumulated in double). Shards of a
// distributed model add their partial sums (an all-reduce) before clip_coefficient.
template <typename T>
double squared_norm(std::span<const BasicTensor<T>> grads);

// max_norm / (total_norm + 1e-6), at most 1: the factor clip_grad_norm_ scales by.
double clip_coefficient(double total_norm, double max_norm);

// Scales every gradient by clip_coefficient(norm, max_norm) and returns the total norm before
// clipping, as clip_grad_norm_ does.
template <typename T>
double clip_grad_norm(std::span<const BasicTensor<T>> grads, double max_norm);

}  // namespace weave::ops
