#include "weave/ops/softmax.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "parallel_rows.hpp"

namespace weave::ops {

template <typename T>
void softmax_forward(const BasicTensor<T>& x, const BasicTensor<T>& y) {
  check_rows("softmax input", x);
  check_rows("softmax output", y);
  check_shape("softmax output", y.shape(), x.shape());
  const std::int64_t n = x.dim(-1);
  detail::for_row_blocks(x.rows(), 64, 10.0 * n, [&](std::int64_t r0, std::int64_t r1) {
    for (std::int64_t r = r0; r < r1; ++r) {
      const T* xr = x.row(r);
      T* yr = y.row(r);
      T m = -std::numeric_limits<T>::infinity();
      for (std::int64_t i = 0; i < n; ++i)
        m = std::max(m, xr[i]);
      T sum = 0;
      for (std::int64_t i = 0; i < n; ++i)
        sum += (yr[i] = std::exp(xr[i] - m));
      const T inv = T(1) / sum;
      for (std::int64_t i = 0; i < n; ++i)
        yr[i] *= inv;
    }
  });
}

template <typename T>
void softmax_backward(const BasicTensor<T>& y, const BasicTensor<T>& dy, const BasicTensor<T>& dx) {
  check_rows("softmax output", y);
  check_rows("softmax output gradient", dy);
  check_rows("softmax input gradient", dx);
  check_shape("softmax output gradient", dy.shape(), y.shape());
  check_shape("softmax input gradient", dx.shape(), y.shape());
  const std::int64_t n = y.dim(-1);
  detail::for_row_blocks(y.rows(), 64, 4.0 * n, [&](std::int64_t r0, std::int64_t r1) {
    for (std::int64_t r = r0; r < r1; ++r) {
      const T* yr = y.row(r);
      const T* dyr = dy.row(r);
      T* dxr = dx.row(r);
      T dot = 0;
      for (std::int64_t i = 0; i < n; ++i)
        dot += dyr[i] * yr[i];
      for (std::int64_t i = 0; i < n; ++i)
        dxr[i] = yr[i] * (dyr[i] - dot);
    }
  });
}

template void softmax_forward(const BasicTensor<float>&, const BasicTensor<float>&);
template void softmax_forward(const BasicTensor<double>&, const BasicTensor<double>&);
template void softmax_backward(const BasicTensor<float>&, const BasicTensor<float>&,
                               const BasicTensor<float>&);
template void softmax_backward(const BasicTensor<double>&, const BasicTensor<double>&,
                               const BasicTensor<double>&);

}  // namespace weave::ops
