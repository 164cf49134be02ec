#include "weave/ops/activation.hpp"

#include <fmt/format.h>

#include <Eigen/Core>
#include <unsupported/Eigen/SpecialFunctions>  // the array form of erf

#include <cmath>
#include <numbers>

#include "parallel_rows.hpp"

namespace weave::ops {

using detail::for_row_blocks;

namespace {

constexpr std::int64_t kBlock = 64;

template <typename T>
T gelu(GeluForm form, T x) {
  if (form == GeluForm::tanh) {
    const T c = static_cast<T>(std::numbers::sqrt2 * std::numbers::inv_sqrtpi);  // sqrt(2/pi)
    return T(0.5) * x * (T(1) + std::tanh(c * (x + T(0.044715) * x * x * x)));
  }
  return T(0.5) * x * (T(1) + std::erf(x / static_cast<T>(std::numbers::sqrt2)));
}

template <typename T>
T gelu_derivative(GeluForm form, T x) {
  if (form == GeluForm::tanh) {
    const T c = static_cast<T>(std::numbers::sqrt2 * std::numbers::inv_sqrtpi);
    const T t = std::tanh(c * (x + T(0.044715) * x * x * x));
    return T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * c * (T(1) + T(3 * 0.044715) * x * x);
  }
  const T pdf =
      std::exp(T(-0.5) * x * x) * static_cast<T>(std::numbers::inv_sqrtpi / std::numbers::sqrt2);
  return T(0.5) * (T(1) + std::erf(x / static_cast<T>(std::numbers::sqrt2))) + x * pdf;
}

template <typename T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

template <typename T>
void check_same(const char* what, const BasicTensor<T>& a, const BasicTensor<T>& b) {
  check_rows(what, a);
  check_rows(what, b);
  check_shape(what, b.shape(), a.shape());
}

}  // namespace

template <typename T>
void gelu_forward(GeluForm form, const BasicTensor<T>& x, const BasicTensor<T>& y) {
  check_same("gelu output", x, y);
  const std::int64_t n = x.dim(-1);
  for_row_blocks(x.rows(), kBlock, 20.0 * n, [&](std::int64_t r0, std::int64_t r1) {
    for (std::int64_t r = r0; r < r1; ++r) {
      // Eigen's array functions vectorise tanh and erf (to within an ulp or two of the scalar
      // ones); the scalar loop spent most of an MLP's time here.
      const Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>> xa(x.row(r), n);
      Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> ya(y.row(r), n);
      if (form == GeluForm::tanh) {
        const T c = static_cast<T>(std::numbers::sqrt2 * std::numbers::inv_sqrtpi);
        ya = T(0.5) * xa * (T(1) + (c * (xa + T(0.044715) * xa.cube())).tanh());
      } else {
        ya = T(0.5) * xa * (T(1) + (xa * static_cast<T>(1 / std::numbers::sqrt2)).erf());
      }
    }
  });
}

template <typename T>
void gelu_backward(GeluForm form, const BasicTensor<T>& x, const BasicTensor<T>& dy,
                   const BasicTensor<T>& dx) {
  check_same("gelu output gradient", x, dy);
  check_same("gelu input gradient", x, dx);
  const std::int64_t n = x.dim(-1);
  for_row_blocks(x.rows(), kBlock, 30.0 * n, [&](std::int64_t r0, std::int64_t r1) {
    for (std::int64_t r = r0; r < r1; ++r) {
      const Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>> xa(x.row(r), n), g(dy.row(r), n);
      Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> out(dx.row(r), n);
      if (form == GeluForm::tanh) {
        const T c = static_cast<T>(std::numbers::sqrt2 * std::numbers::inv_sqrtpi);
        const Eigen::Array<T, Eigen::Dynamic, 1> t = (c * (xa + T(0.044715) * xa.cube())).tanh();
        out = g * (T(0.5) * (T(1) + t) +
                   T(0.5) * xa * (T(1) - t.square()) * c * (T(1) + T(3 * 0.044715) * xa.square()));
      } else {
        const T inv_sqrt2pi = static_cast<T>(std::numbers::inv_sqrtpi / std::numbers::sqrt2);
        out = g * (T(0.5) * (T(1) + (xa * static_cast<T>(1 / std::numbers::sqrt2)).erf()) +
                   xa * (T(-0.5) * xa.square()).exp() * inv_sqrt2pi);
      }
    }
  });
}

template <typename T>
void swiglu_forward(const BasicTensor<T>& x, const BasicTensor<T>& y) {
  check_rows("swiglu input", x);
  check_rows("swiglu output", y);
  if (x.dim(-1) % 2 != 0)
    throw std::invalid_argument(fmt::format(
        "swiglu input's last dimension holds gate and value halves and must be even, got {}",
        x.shape().str()));
  const std::int64_t f = x.dim(-1) / 2;
  check_shape("swiglu output", y.shape(), x.shape().with(-1, f));
  for_row_blocks(x.rows(), kBlock, 20.0 * f, [&](std::int64_t r0, std::int64_t r1) {
    for (std::int64_t r = r0; r < r1; ++r) {
      const T* a = x.row(r);
      const T* b = a + f;
      T* yr = y.row(r);
      for (std::int64_t i = 0; i < f; ++i)
        yr[i] = a[i] * sigmoid(a[i]) * b[i];
    }
  });
}

template <typename T>
void swiglu_backward(const BasicTensor<T>& x, const BasicTensor<T>& dy, const BasicTensor<T>& dx) {
  check_rows("swiglu input", x);
  check_same("swiglu input gradient", x, dx);
  const std::int64_t f = x.dim(-1) / 2;
  check_rows("swiglu output gradient", dy);
  check_shape("swiglu output gradient", dy.shape(), x.shape().with(-1, f));
  for_row_blocks(x.rows(), kBlock, 25.0 * f, [&](std::int64_t r0, std::int64_t r1) {
    for (std::int64_t r = r0; r < r1; ++r) {
      const T* a = x.row(r);
      const T* b = a + f;
      const T* dyr = dy.row(r);
      T* da = dx.row(r);
      T* db = da + f;
      for (std::int64_t i = 0; i < f; ++i) {
        const T s = sigmoid(a[i]);
        const T silu = a[i] * s;
        const T g = dyr[i];
        const T value = b[i];  // read before writing: dx may not alias x, but be safe on order
        db[i] = g * silu;
        da[i] = g * value * s * (T(1) + a[i] * (T(1) - s));
      }
    }
  });
}

#define WEAVE_INSTANTIATE(T)                                                          \
  template void gelu_forward(GeluForm, const BasicTensor<T>&, const BasicTensor<T>&); \
  template void gelu_backward(GeluForm, const BasicTensor<T>&, const BasicTensor<T>&, \
                              const BasicTensor<T>&);                                 \
  template void swiglu_forward(const BasicTensor<T>&, const BasicTensor<T>&);         \
  template void swiglu_backward(const BasicTensor<T>&, const BasicTensor<T>&,         \
                                const BasicTensor<T>&);
WEAVE_INSTANTIATE(float)
WEAVE_INSTANTIATE(double)

}  // namespace weave::ops
