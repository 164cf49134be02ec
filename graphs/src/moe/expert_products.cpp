#include "moe/expert_products.hpp"

#include "model/half_precision.hpp"
#include "weave/graphs/model_shard.hpp"
#include "weave/ops/linear.hpp"
#include "weave/runtime/parallel_for.hpp"

namespace weave::graphs {

namespace {

template <typename T>
ops::BasicTensor<T> expert_matrix(const ops::BasicTensor<T>& w, std::int64_t e) {
  return w.slice(0, e, 1).reshape({w.dim(1), w.dim(2)});
}

// x's 16-bit values as a 16-bit tensor (exact: x holds values of that precision).
ops::Bf16Tensor as_half(Precision precision, const Tensor& x) {
  const ops::Bf16Tensor out = ops::Bf16Tensor::empty(x.shape());
  round_to_half(precision, x, out);
  return out;
}

void activation_forward(ops::ExpertActivation act, const Tensor& pre, const Tensor& out) {
  if (act == ops::ExpertActivation::swiglu)
    ops::swiglu_forward(pre, out);
  else
    ops::gelu_forward(
        act == ops::ExpertActivation::gelu_tanh ? ops::GeluForm::tanh : ops::GeluForm::erf, pre,
        out);
}

void activation_backward(ops::ExpertActivation act, const Tensor& pre, const Tensor& d_out,
                         const Tensor& d_pre) {
  if (act == ops::ExpertActivation::swiglu)
    ops::swiglu_backward(pre, d_out, d_pre);
  else
    ops::gelu_backward(
        act == ops::ExpertActivation::gelu_tanh ? ops::GeluForm::tanh : ops::GeluForm::erf, pre,
        d_out, d_pre);
}

// Calls fn(e, r0, n) for every local expert with rows, in parallel over the arena's cores.
template <typename Fn>
void for_experts(std::span<const std::int64_t> begin, Fn&& fn) {
  const auto experts = static_cast<std::int64_t>(begin.size()) - 1;
  rt::parallel_for(std::int64_t{0}, experts, [&](std::int64_t e) {
    const std::int64_t r0 = begin[static_cast<std::size_t>(e)],
                       n = begin[static_cast<std::size_t>(e) + 1] - r0;
    if (n > 0) fn(e, r0, n);
  });
}

}  // namespace

void linear_forward_half(Precision precision, const Tensor& x, const ops::Bf16Tensor& w,
                         const Tensor& y) {
  const ops::Bf16Tensor y16 = ops::Bf16Tensor::empty(y.shape());
  half_linear_forward(precision, as_half(precision, x), w, ops::Bf16Tensor{}, y16);
  widen_to_fp32(precision, y16, y);
}

void linear_backward_input_half(Precision precision, const Tensor& dy, const ops::Bf16Tensor& w,
                                const Tensor& dx) {
  const ops::Bf16Tensor dx16 = ops::Bf16Tensor::empty(dx.shape());
  half_linear_backward_input(precision, as_half(precision, dy), w, dx16);
  widen_to_fp32(precision, dx16, dx);
}

ExpertWeights ExpertWeights::expert(std::int64_t e) const {
  ExpertWeights one{w1.slice(0, e, 1), w2.slice(0, e, 1), {}, {}, precision};
  if (half()) {
    one.w1_16 = w1_16.slice(0, e, 1);
    one.w2_16 = w2_16.slice(0, e, 1);
  }
  return one;
}

ExpertWeights expert_weights(const MoeExpertsParameters& W) {
  return {W.fc1->value, W.fc2->value, W.fc1->value16, W.fc2->value16,
          W.fc1->fp16 ? Precision::fp16 : Precision::bf16};
}

void experts_forward(ops::ExpertActivation act, const Tensor& x,
                     std::span<const std::int64_t> begin, const ExpertWeights& w,
                     const Tensor& hidden_pre, const Tensor& hidden, const Tensor& y) {
  if (!w.half()) {
    ops::experts_forward(act, x, begin, w.w1, w.w2, hidden_pre, hidden, y);
    return;
  }
  for_experts(begin, [&](std::int64_t e, std::int64_t r0, std::int64_t n) {
    const Tensor pre = hidden_pre.slice(0, r0, n), hid = hidden.slice(0, r0, n);
    linear_forward_half(w.precision, x.slice(0, r0, n), expert_matrix(w.w1_16, e), pre);
    activation_forward(act, pre, hid);
    round_in_place(w.precision, hid);
    linear_forward_half(w.precision, hid, expert_matrix(w.w2_16, e), y.slice(0, r0, n));
  });
}

void experts_backward_input(ops::ExpertActivation act, const Tensor& x,
                            std::span<const std::int64_t> begin, const ExpertWeights& w,
                            const Tensor& hidden_pre, const Tensor& hidden, const Tensor& dy,
                            const Tensor& dx, const Tensor& d_pre) {
  if (!w.half()) {
    ops::experts_backward_input(act, x, begin, w.w1, w.w2, hidden_pre, hidden, dy, dx, d_pre);
    return;
  }
  for_experts(begin, [&](std::int64_t e, std::int64_t r0, std::int64_t n) {
    const Tensor dy_e = dy.slice(0, r0, n), d = d_pre.slice(0, r0, n);
    round_in_place(w.precision, dy_e);  // the weight half reads the same 16-bit values
    const Tensor d_hidden = Tensor::empty({n, w.w2.dim(2)});
    linear_backward_input_half(w.precision, dy_e, expert_matrix(w.w2_16, e), d_hidden);
    activation_backward(act, hidden_pre.slice(0, r0, n), d_hidden, d);
    round_in_place(w.precision, d);
    if (dx.defined())
      linear_backward_input_half(w.precision, d, expert_matrix(w.w1_16, e), dx.slice(0, r0, n));
  });
}

namespace {

// The activation's output again from the kept first product (--recompute-modules moe_act).
void activation_again(ops::ExpertActivation act, std::span<const std::int64_t> begin,
                      const ExpertWeights& w, const Tensor& hidden_pre, const Tensor& hidden) {
  for_experts(begin, [&](std::int64_t, std::int64_t r0, std::int64_t n) {
    const Tensor hid = hidden.slice(0, r0, n);
    activation_forward(act, hidden_pre.slice(0, r0, n), hid);
    if (w.half()) round_in_place(w.precision, hid);
  });
}

}  // namespace

void experts_backward(ops::ExpertActivation act, const Tensor& x,
                      std::span<const std::int64_t> begin, const ExpertWeights& w,
                      const Tensor& hidden_pre, const Tensor& hidden, const Tensor& dy,
                      const Tensor& dx, const Tensor& dw1, const Tensor& dw2, bool hidden_again) {
  if (hidden_again) activation_again(act, begin, w, hidden_pre, hidden);
  if (!w.half()) {
    ops::experts_backward(act, x, begin, w.w1, w.w2, hidden_pre, hidden, dy, dx, dw1, dw2);
    return;
  }
  const Tensor d_pre = Tensor::empty(hidden_pre.shape());
  experts_backward_input(act, x, begin, w, hidden_pre, hidden, dy, dx, d_pre);
  // Every operand holds bf16 (or fp16) values, so the fp32 kernels' products (16 or 22
  // significant bits) are the 16-bit products exactly and their sums are fp32 sums: the weight
  // gradients gemm_bf16 (gemm_fp16) would give, in fp32.
  ops::experts_backward_weight(x, begin, hidden, dy, d_pre, dw1, dw2);
}

void experts_backward_weight(ops::ExpertActivation act, const Tensor& x,
                             std::span<const std::int64_t> begin, const ExpertWeights& w,
                             const Tensor& hidden_pre, const Tensor& hidden, const Tensor& dy,
                             const Tensor& d_pre, const Tensor& dw1, const Tensor& dw2,
                             bool hidden_again) {
  if (hidden_again) activation_again(act, begin, w, hidden_pre, hidden);
  ops::experts_backward_weight(x, begin, hidden, dy, d_pre, dw1, dw2);
}

}  // namespace weave::graphs
