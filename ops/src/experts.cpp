#include "weave/ops/experts.hpp"

#include <fmt/format.h>

#include <stdexcept>

#include "weave/ops/linear.hpp"
#include "weave/runtime/parallel_for.hpp"

namespace weave::ops {

namespace {

template <typename T>
void check_experts(ExpertActivation act, const BasicTensor<T>& x,
                   std::span<const std::int64_t> begin, const BasicTensor<T>& w1,
                   const BasicTensor<T>& w2, const BasicTensor<T>& hidden_pre,
                   const BasicTensor<T>& hidden, const BasicTensor<T>& y, const char* y_name) {
  check_rows("expert input", x);
  if (x.rank() != 2 || w1.rank() != 3 || w2.rank() != 3)
    throw std::invalid_argument(fmt::format(
        "experts take x [rows, h], w1 [experts, f1, h], w2 [experts, h, f]; got {}, {}, {}",
        x.shape().str(), w1.shape().str(), w2.shape().str()));
  const std::int64_t e = w1.dim(0), h = x.dim(1), f = w2.dim(2);
  const std::int64_t f1 = act == ExpertActivation::swiglu ? 2 * f : f;
  check_shape("expert first weights", w1.shape(), Shape{e, f1, h});
  check_shape("expert second weights", w2.shape(), Shape{e, h, f});
  check_shape("expert hidden (before activation)", hidden_pre.shape(), Shape{x.dim(0), f1});
  check_shape("expert hidden", hidden.shape(), Shape{x.dim(0), f});
  check_shape(y_name, y.shape(), x.shape());
  if (static_cast<std::int64_t>(begin.size()) != e + 1 || begin.front() != 0 ||
      begin.back() != x.dim(0))
    throw std::invalid_argument(fmt::format(
        "experts: row ranges must have {} entries from 0 to {} rows, got {} entries ending at {}",
        e + 1, x.dim(0), begin.size(), begin.empty() ? -1 : begin.back()));
  for (std::size_t i = 1; i < begin.size(); ++i)
    if (begin[i] < begin[i - 1])
      throw std::invalid_argument("experts: row ranges must not decrease");
}

template <typename T>
BasicTensor<T> expert_weight(const BasicTensor<T>& w, std::int64_t e) {
  return w.slice(0, e, 1).reshape({w.dim(1), w.dim(2)});
}

}  // namespace

template <typename T>
void experts_forward(ExpertActivation act, const BasicTensor<T>& x,
                     std::span<const std::int64_t> begin, const BasicTensor<T>& w1,
                     const BasicTensor<T>& w2, const BasicTensor<T>& hidden_pre,
                     const BasicTensor<T>& hidden, const BasicTensor<T>& y) {
  check_experts(act, x, begin, w1, w2, hidden_pre, hidden, y, "expert output");
  rt::parallel_for(std::int64_t{0}, w1.dim(0), [&](std::int64_t e) {
    const std::int64_t r0 = begin[e], n = begin[e + 1] - r0;
    if (n == 0) return;
    const BasicTensor<T> pre = hidden_pre.slice(0, r0, n), act_out = hidden.slice(0, r0, n);
    linear_forward(x.slice(0, r0, n), expert_weight(w1, e), BasicTensor<T>{}, pre);
    if (act == ExpertActivation::swiglu)
      swiglu_forward(pre, act_out);
    else
      gelu_forward(act == ExpertActivation::gelu_tanh ? GeluForm::tanh : GeluForm::erf, pre,
                   act_out);
    linear_forward(act_out, expert_weight(w2, e), BasicTensor<T>{}, y.slice(0, r0, n));
  });
}

template <typename T>
void experts_backward(ExpertActivation act, const BasicTensor<T>& x,
                      std::span<const std::int64_t> begin, const BasicTensor<T>& w1,
                      const BasicTensor<T>& w2, const BasicTensor<T>& hidden_pre,
                      const BasicTensor<T>& hidden, const BasicTensor<T>& dy,
                      const BasicTensor<T>& dx, const BasicTensor<T>& dw1,
                      const BasicTensor<T>& dw2) {
  check_shape("expert first weights gradient", dw1.shape(), w1.shape());
  check_shape("expert second weights gradient", dw2.shape(), w2.shape());
  const BasicTensor<T> d_pre = BasicTensor<T>::empty(hidden_pre.shape());
  experts_backward_input(act, x, begin, w1, w2, hidden_pre, hidden, dy, dx, d_pre);
  experts_backward_weight(x, begin, hidden, dy, d_pre, dw1, dw2);
}

template <typename T>
void experts_backward_input(ExpertActivation act, const BasicTensor<T>& x,
                            std::span<const std::int64_t> begin, const BasicTensor<T>& w1,
                            const BasicTensor<T>& w2, const BasicTensor<T>& hidden_pre,
                            const BasicTensor<T>& hidden, const BasicTensor<T>& dy,
                            const BasicTensor<T>& dx, const BasicTensor<T>& d_pre) {
  check_experts(act, x, begin, w1, w2, hidden_pre, hidden, dy, "expert output gradient");
  check_shape("expert first product's gradient", d_pre.shape(), hidden_pre.shape());
  if (dx.defined()) check_shape("expert input gradient", dx.shape(), x.shape());
  rt::parallel_for(std::int64_t{0}, w1.dim(0), [&](std::int64_t e) {
    const std::int64_t r0 = begin[e], n = begin[e + 1] - r0;
    if (n == 0) return;
    const BasicTensor<T> d_hidden = BasicTensor<T>::empty({n, w2.dim(2)});
    linear_backward_input(dy.slice(0, r0, n), expert_weight(w2, e), d_hidden);
    const BasicTensor<T> pre = hidden_pre.slice(0, r0, n), d = d_pre.slice(0, r0, n);
    if (act == ExpertActivation::swiglu)
      swiglu_backward(pre, d_hidden, d);
    else
      gelu_backward(act == ExpertActivation::gelu_tanh ? GeluForm::tanh : GeluForm::erf, pre,
                    d_hidden, d);
    if (dx.defined()) linear_backward_input(d, expert_weight(w1, e), dx.slice(0, r0, n));
  });
}

template <typename T>
void experts_backward_weight(const BasicTensor<T>& x, std::span<const std::int64_t> begin,
                             const BasicTensor<T>& hidden, const BasicTensor<T>& dy,
                             const BasicTensor<T>& d_pre, const BasicTensor<T>& dw1,
                             const BasicTensor<T>& dw2) {
  const std::int64_t experts = dw1.dim(0);
  if (static_cast<std::int64_t>(begin.size()) != experts + 1 || begin[experts] > x.dim(0))
    throw std::invalid_argument(fmt::format(
        "experts_backward_weight: {} group offsets for {} experts over {} rows; give experts + 1 "
        "offsets ending within the rows",
        begin.size(), experts, x.dim(0)));
  rt::parallel_for(std::int64_t{0}, experts, [&](std::int64_t e) {
    const std::int64_t r0 = begin[e], n = begin[e + 1] - r0;
    if (n == 0) return;
    linear_backward_weight(hidden.slice(0, r0, n), dy.slice(0, r0, n), expert_weight(dw2, e),
                           BasicTensor<T>{});
    linear_backward_weight(x.slice(0, r0, n), d_pre.slice(0, r0, n), expert_weight(dw1, e),
                           BasicTensor<T>{});
  });
}

#define WEAVE_INSTANTIATE(T)                                                                       \
  template void experts_forward(ExpertActivation, const BasicTensor<T>&,                           \
                                std::span<const std::int64_t>, const BasicTensor<T>&,              \
                                const BasicTensor<T>&, const BasicTensor<T>&,                      \
                                const BasicTensor<T>&, const BasicTensor<T>&);                     \
  template void experts_backward(                                                                  \
      ExpertActivation, const BasicTensor<T>&, std::span<const std::int64_t>,                      \
      const BasicTensor<T>&, const BasicTensor<T>&, const BasicTensor<T>&, const BasicTensor<T>&,  \
      const BasicTensor<T>&, const BasicTensor<T>&, const BasicTensor<T>&, const BasicTensor<T>&); \
  template void experts_backward_input(                                                            \
      ExpertActivation, const BasicTensor<T>&, std::span<const std::int64_t>,                      \
      const BasicTensor<T>&, const BasicTensor<T>&, const BasicTensor<T>&, const BasicTensor<T>&,  \
      const BasicTensor<T>&, const BasicTensor<T>&, const BasicTensor<T>&);                        \
  template void experts_backward_weight(                                                           \
      const BasicTensor<T>&, std::span<const std::int64_t>, const BasicTensor<T>&,                 \
      const BasicTensor<T>&, const BasicTensor<T>&, const BasicTensor<T>&, const BasicTensor<T>&);
WEAVE_INSTANTIATE(float)
WEAVE_INSTANTIATE(double)

}  // namespace weave::ops
