// The experts' products in either precision: fp32, or a 16-bit run's (bf16 or fp16 products
// summed in fp32 through the 16-bit linear kernels, the activation in fp32 on widened values,
// rounded once). A 16-bit run's expert rows live in fp32 buffers holding 16-bit values (what the
// all-to-alls carry and the virtual clock charges at 2 bytes a value), so these take and leave fp32
// tensors.
#pragma once

#include <cstdint>
#include <span>

#include "moe/moe_parameters.hpp"
#include "weave/ops/experts.hpp"

namespace weave::graphs {

using ops::Tensor;

// A rank's local experts' weights as the products read them: fp32 values, and in a 16-bit run
// their 16-bit copies too (w1_16, w2_16 defined), which the products then read instead.
struct ExpertWeights {
  Tensor w1, w2;                          // [experts, f1, h], [experts, h, f]
  ops::Bf16Tensor w1_16, w2_16;           // a 16-bit run's copies (read as fp16 in an fp16 run)
  Precision precision = Precision::bf16;  // of the copies, when defined
  bool half() const { return w1_16.defined(); }
  // Local expert e alone.
  ExpertWeights expert(std::int64_t e) const;
};
ExpertWeights expert_weights(const MoeExpertsParameters& W);

// A 16-bit run's product y = x w^T and input gradient dx = dy w on fp32 tensors holding values
// of `precision`: through its 16-bit linear kernels (fp32 sums), the result rounded once.
void linear_forward_half(Precision precision, const Tensor& x, const ops::Bf16Tensor& w,
                         const Tensor& y);
void linear_backward_input_half(Precision precision, const Tensor& dy, const ops::Bf16Tensor& w,
                                const Tensor& dx);

// As ops::experts_forward: hidden_pre, hidden and y hold bf16 values in a bf16 run (x must).
void experts_forward(ops::ExpertActivation act, const Tensor& x,
                     std::span<const std::int64_t> begin, const ExpertWeights& w,
                     const Tensor& hidden_pre, const Tensor& hidden, const Tensor& y);
// As ops::experts_backward_input: in a bf16 run dy is rounded to bf16 first (a bf16 tensor's
// gradient is bf16), d_pre and dx are bf16 values.
void experts_backward_input(ops::ExpertActivation act, const Tensor& x,
                            std::span<const std::int64_t> begin, const ExpertWeights& w,
                            const Tensor& hidden_pre, const Tensor& hidden, const Tensor& dy,
                            const Tensor& dx, const Tensor& d_pre);
// As ops::experts_backward: dw1, dw2 (fp32) accumulated. With `hidden_again`
// (--recompute-modules moe_act) the activation's output `hidden` is first computed again from
// the kept first product hidden_pre, expert by expert as experts_forward computed it (in a 16-bit
// run rounded once), so its values are bitwise the forward's: Megatron-Core's experts recompute
// the same function (bias_act_func under CheckpointWithoutOutput) before fc2's backward.
void experts_backward(ops::ExpertActivation act, const Tensor& x,
                      std::span<const std::int64_t> begin, const ExpertWeights& w,
                      const Tensor& hidden_pre, const Tensor& hidden, const Tensor& dy,
                      const Tensor& dx, const Tensor& dw1, const Tensor& dw2,
                      bool hidden_again = false);
// As ops::experts_backward_weight (the weight half of a split backward, d_pre kept by its input
// half), with experts_backward's `hidden_again`.
void experts_backward_weight(ops::ExpertActivation act, const Tensor& x,
                             std::span<const std::int64_t> begin, const ExpertWeights& w,
                             const Tensor& hidden_pre, const Tensor& hidden, const Tensor& dy,
                             const Tensor& d_pre, const Tensor& dw1, const Tensor& dw2,
                             bool hidden_again);

}  // namespace weave::graphs
