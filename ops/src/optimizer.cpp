#include "weave/ops/optimizer.hpp"

#include <fmt/format.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "weave/runtime/parallel_for.hpp"

namespace weave::ops {

namespace {

template <typename T>
void check_state(const char* what, const BasicTensor<T>& param, const BasicTensor<T>& other) {
  if (!other.is_contiguous())
    throw std::invalid_argument(fmt::format("{} must be contiguous", what));
  check_shape(what, other.shape(), param.shape());
}

void check_step(std::int64_t step) {
  if (step < 1)
    throw std::invalid_argument(fmt::format("optimizer steps count from 1, got {}", step));
}

}  // namespace

template <typename T>
void adamw_step(const AdamWOptions& o, std::int64_t step, const BasicTensor<T>& param,
                const BasicTensor<T>& grad, const BasicTensor<T>& exp_avg,
                const BasicTensor<T>& exp_avg_sq) {
  check_step(step);
  if (!param.is_contiguous()) throw std::invalid_argument("AdamW parameter must be contiguous");
  check_state("AdamW gradient", param, grad);
  check_state("AdamW exp_avg", param, exp_avg);
  check_state("AdamW exp_avg_sq", param, exp_avg_sq);
  if (!(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1 && o.eps >= 0 && o.lr >= 0))
    throw std::invalid_argument(fmt::format(
        "AdamW needs 0 <= beta1, beta2 < 1 and lr, eps >= 0; got lr {}, betas ({}, {}), eps {}",
        o.lr, o.beta1, o.beta2, o.eps));
  const double bc1 = 1 - std::pow(o.beta1, static_cast<double>(step));
  const double bc2 = 1 - std::pow(o.beta2, static_cast<double>(step));
  const T decay = static_cast<T>(1 - o.lr * o.weight_decay);
  const T b1 = static_cast<T>(o.beta1), b2 = static_cast<T>(o.beta2);
  const T step_size = static_cast<T>(o.lr / bc1);
  const T sqrt_bc2 = static_cast<T>(std::sqrt(bc2));
  const T eps = static_cast<T>(o.eps);
  // Element-wise and memory-bound: blocks of elements over the arena's threads, each block
  // one vectorised pass.
  const std::int64_t n = param.numel();
  constexpr std::int64_t kBlock = 1 << 14;
  auto block = [&](std::int64_t first, std::int64_t last) {
    using Array = Eigen::Array<T, Eigen::Dynamic, 1>;
    Eigen::Map<Array> p(param.data() + first, last - first),
        m(exp_avg.data() + first, last - first), v(exp_avg_sq.data() + first, last - first);
    const Eigen::Map<const Array> g(grad.data() + first, last - first);
    p *= decay;
    m = b1 * m + (T(1) - b1) * g;
    v = b2 * v + (T(1) - b2) * g * g;
    p -= step_size * m / (v.sqrt() / sqrt_bc2 + eps);
  };
  const std::int64_t blocks = (n + kBlock - 1) / kBlock;
  if (blocks <= 1) {
    block(0, n);
  } else {
    rt::parallel_for(std::int64_t{0}, blocks,
                     [&](std::int64_t i) { block(i * kBlock, std::min(n, (i + 1) * kBlock)); });
  }
}

template <typename T>
void sgd_step(const SgdOptions& o, std::int64_t step, const BasicTensor<T>& param,
              const BasicTensor<T>& grad, const BasicTensor<T>& buffer) {
  check_step(step);
  if (!param.is_contiguous()) throw std::invalid_argument("SGD parameter must be contiguous");
  check_state("SGD gradient", param, grad);
  if (o.momentum != 0) check_state("SGD momentum buffer", param, buffer);
  if (o.nesterov && (o.momentum <= 0 || o.dampening != 0))
    throw std::invalid_argument("SGD Nesterov momentum needs momentum > 0 and dampening 0");
  const T lr = static_cast<T>(o.lr), wd = static_cast<T>(o.weight_decay),
          mu = static_cast<T>(o.momentum), damp = static_cast<T>(1 - o.dampening);
  T* p = param.data();
  const T* g = grad.data();
  T* b = o.momentum != 0 ? buffer.data() : nullptr;
  for (std::int64_t i = 0, n = param.numel(); i < n; ++i) {
    T d = g[i] + wd * p[i];
    if (b) {
      b[i] = step == 1 ? d : mu * b[i] + damp * d;
      d = o.nesterov ? d + mu * b[i] : b[i];
    }
    p[i] -= lr * d;
  }
}

template <typename T>
double squared_norm(std::span<const BasicTensor<T>> grads) {
  double sum = 0;
  for (const BasicTensor<T>& g : grads)
    for (std::int64_t r = 0; r < g.rows(); ++r) {
      const T* row = g.row(r);
      for (std::int64_t c = 0; c < g.dim(-1); ++c)
        sum += static_cast<double>(row[c]) * static_cast<double>(row[c]);
    }
  return sum;
}

double clip_coefficient(double total_norm, double max_norm) {
  if (!(max_norm > 0))
    throw std::invalid_argument(
        fmt::format("gradient clipping max norm must be > 0, got {}", max_norm));
  return std::min(1.0, max_norm / (total_norm + 1e-6));
}

template <typename T>
double clip_grad_norm(std::span<const BasicTensor<T>> grads, double max_norm) {
  const double norm = std::sqrt(squared_norm(grads));
  const T coef = static_cast<T>(clip_coefficient(norm, max_norm));
  if (coef < T(1))
    for (const BasicTensor<T>& g : grads)
      for (std::int64_t r = 0; r < g.rows(); ++r) {
        T* row = g.row(r);
        for (std::int64_t c = 0; c < g.dim(-1); ++c)
          row[c] *= coef;
      }
  return norm;
}

#define WEAVE_INSTANTIATE(T)                                                                     \
  template void adamw_step(const AdamWOptions&, std::int64_t, const BasicTensor<T>&,             \
                           const BasicTensor<T>&, const BasicTensor<T>&, const BasicTensor<T>&); \
  template void sgd_step(const SgdOptions&, std::int64_t, const BasicTensor<T>&,                 \
                         const BasicTensor<T>&, const BasicTensor<T>&);                          \
  template double squared_norm(std::span<const BasicTensor<T>>);                                 \
  template double clip_grad_norm(std::span<const BasicTensor<T>>, double);
WEAVE_INSTANTIATE(float)
WEAVE_INSTANTIATE(double)

}  // namespace weave::ops
