// The model's normalization (--normalization): LayerNorm with a weight and a bias, or RMSNorm
// with a weight only, behind one call so every norm of the model follows the flag.
#pragma once

#include "weave/graphs/model_config.hpp"
#include "weave/graphs/model_shard.hpp"
#include "weave/ops/normalization.hpp"

namespace weave::graphs {

// y = norm(x); mean is unused by RMSNorm, bias is null there. A bf16 run's norms read the bf16
// parameters (widened), computing in fp32.
inline void norm_forward(const ModelConfig& m, const ops::Tensor& x, const Parameter& weight,
                         const Parameter* bias, const ops::Tensor& y, const ops::Tensor& mean,
                         const ops::Tensor& rstd) {
  if (m.normalization == Normalization::rms_norm)
    ops::rms_norm_forward(x, compute_value(weight), m.layernorm_epsilon, y, rstd);
  else
    ops::layer_norm_forward(x, compute_value(weight), compute_value(*bias), m.layernorm_epsilon, y,
                            mean, rstd);
}

// dx written, the weight's (and bias's) gradients accumulated.
inline void norm_backward(const ModelConfig& m, const ops::Tensor& x, const Parameter& weight,
                          const Parameter* bias, const ops::Tensor& mean, const ops::Tensor& rstd,
                          const ops::Tensor& dy, const ops::Tensor& dx) {
  if (m.normalization == Normalization::rms_norm)
    ops::rms_norm_backward(x, compute_value(weight), rstd, dy, dx, weight.grad);
  else
    ops::layer_norm_backward(x, compute_value(weight), mean, rstd, dy, dx, weight.grad, bias->grad);
}

}  // namespace weave::graphs
