// The experts of a Mixture-of-Experts layer as batched MLPs over expert-grouped tokens.
//
// Expert e (of this device's experts) processes rows [begin[e], begin[e+1]) of the grouped
// tokens x [rows, h]: y = act(x W1_e^T) W2_e^T, with W1 [experts, f1, h] and W2 [experts, h, f];
// f1 = f for GELU and 2f for SwiGLU (gate and value halves). Experts run in parallel on the
// device's cores; each one's products split further when large.
#pragma once

#include <cstdint>
#include <span>

#include "weave/ops/activation.hpp"
#include "weave/ops/tensor.hpp"

namespace weave::ops {

enum class ExpertActivation { gelu_tanh, gelu_erf, swiglu };

// Saves hidden_pre [rows, f1] and hidden [rows, f] for the backward; writes y [rows, h].
template <typename T>
void experts_forward(ExpertActivation act, const BasicTensor<T>& x,
                     std::span<const std::int64_t> begin, const BasicTensor<T>& w1,
                     const BasicTensor<T>& w2, const BasicTensor<T>& hidden_pre,
                     const BasicTensor<T>& hidden, const BasicTensor<T>& y);

// The backward in two halves, as zero-bubble pipelines run it: the input half writes dx (may be
// undefined) and d_pre [rows, f1], the gradient of the first product's output; the weight half
// accumulates dw1 and dw2 from it later. Together they are experts_backward.
template <typename T>
void experts_backward_input(ExpertActivation act, const BasicTensor<T>& x,
                            std::span<const std::int64_t> begin, const BasicTensor<T>& w1,
                            const BasicTensor<T>& w2, const BasicTensor<T>& hidden_pre,
                            const BasicTensor<T>& hidden, const BasicTensor<T>& dy,
                            const BasicTensor<T>& dx, const BasicTensor<T>& d_pre);
template <typename T>
void experts_backward_weight(const BasicTensor<T>& x, std::span<const std::int64_t> begin,
                             const BasicTensor<T>& hidden, const BasicTensor<T>& dy,
                             const BasicTensor<T>& d_pre, const BasicTensor<T>& dw1,
                             const BasicTensor<T>& dw2);

// dx written (may be undefined); dw1, dw2 accumulated.
template <typename T>
void experts_backward(ExpertActivation act, const BasicTensor<T>& x,
                      std::span<const std::int64_t> begin, const BasicTensor<T>& w1,
                      const BasicTensor<T>& w2, const BasicTensor<T>& hidden_pre,
                      const BasicTensor<T>& hidden, const BasicTensor<T>& dy,
                      const BasicTensor<T>& dx, const BasicTensor<T>& dw1,
                      const BasicTensor<T>& dw2);

}  // namespace weave::ops
