#include "weave/ops/normalization.hpp"

#include <fmt/format.h>

#include <cmath>
#include <vector>

#include "parallel_rows.hpp"

namespace weave::ops {

using detail::add_block_partials;
using detail::for_row_blocks;

namespace {

constexpr std::int64_t kBlock = 64;

template <typename T>
void check_norm(const char* op, const BasicTensor<T>& x, const BasicTensor<T>& gamma,
                const BasicTensor<T>& y, const BasicTensor<T>& stat) {
  check_rows(fmt::format("{} input", op), x);
  check_rows(fmt::format("{} output", op), y);
  check_shape(fmt::format("{} output", op), y.shape(), x.shape());
  check_shape(fmt::format("{} weight", op), gamma.shape(), Shape{x.dim(-1)});
  check_shape(fmt::format("{} saved statistics", op), stat.shape(), Shape{x.rows()});
}

}  // namespace

template <typename T>
void layer_norm_forward(const BasicTensor<T>& x, const BasicTensor<T>& gamma,
                        const BasicTensor<T>& beta, double eps, const BasicTensor<T>& y,
                        const BasicTensor<T>& mean, const BasicTensor<T>& rstd) {
  check_norm("layer_norm", x, gamma, y, rstd);
  check_shape("layer_norm bias", beta.shape(), gamma.shape());
  check_shape("layer_norm saved mean", mean.shape(), rstd.shape());
  const std::int64_t n = x.dim(-1);
  for_row_blocks(x.rows(), kBlock, 4.0 * n, [&](std::int64_t r0, std::int64_t r1) {
    for (std::int64_t r = r0; r < r1; ++r) {
      const T* xr = x.row(r);
      T* yr = y.row(r);
      // Two passes in double: the variance of a long row in float loses digits otherwise.
      double sum = 0;
      for (std::int64_t i = 0; i < n; ++i)
        sum += xr[i];
      const double mu = sum / static_cast<double>(n);
      double sq = 0;
      for (std::int64_t i = 0; i < n; ++i)
        sq += (xr[i] - mu) * (xr[i] - mu);
      const double rs = 1.0 / std::sqrt(sq / static_cast<double>(n) + eps);
      mean.data()[r] = static_cast<T>(mu);
      rstd.data()[r] = static_cast<T>(rs);
      const T m = static_cast<T>(mu), s = static_cast<T>(rs);
      for (std::int64_t i = 0; i < n; ++i)
        yr[i] = (xr[i] - m) * s * gamma.data()[i] + beta.data()[i];
    }
  });
}

template <typename T>
void layer_norm_backward(const BasicTensor<T>& x, const BasicTensor<T>& gamma,
                         const BasicTensor<T>& mean, const BasicTensor<T>& rstd,
                         const BasicTensor<T>& dy, const BasicTensor<T>& dx,
                         const BasicTensor<T>& dgamma, const BasicTensor<T>& dbeta) {
  check_norm("layer_norm", x, gamma, dy, rstd);
  check_shape("layer_norm saved mean", mean.shape(), rstd.shape());
  if (dx.defined()) check_shape("layer_norm input gradient", dx.shape(), x.shape());
  if (dgamma.defined()) check_shape("layer_norm weight gradient", dgamma.shape(), gamma.shape());
  if (dbeta.defined()) check_shape("layer_norm bias gradient", dbeta.shape(), gamma.shape());
  const std::int64_t n = x.dim(-1), rows = x.rows();
  const std::int64_t blocks = (rows + kBlock - 1) / kBlock;
  std::vector<T> pg(static_cast<std::size_t>(blocks * n), T(0)), pb(pg.size(), T(0));
  for_row_blocks(rows, kBlock, 6.0 * n, [&](std::int64_t r0, std::int64_t r1) {
    T* g_part = pg.data() + (r0 / kBlock) * n;
    T* b_part = pb.data() + (r0 / kBlock) * n;
    for (std::int64_t r = r0; r < r1; ++r) {
      const T* xr = x.row(r);
      const T* dyr = dy.row(r);
      const T m = mean.data()[r], s = rstd.data()[r];
      T mean_g = 0, mean_gx = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        const T xhat = (xr[i] - m) * s;
        const T g = dyr[i] * gamma.data()[i];
        mean_g += g;
        mean_gx += g * xhat;
        g_part[i] += dyr[i] * xhat;
        b_part[i] += dyr[i];
      }
      mean_g /= static_cast<T>(n);
      mean_gx /= static_cast<T>(n);
      if (dx.defined()) {
        T* dxr = dx.row(r);
        for (std::int64_t i = 0; i < n; ++i) {
          const T xhat = (xr[i] - m) * s;
          dxr[i] = s * (dyr[i] * gamma.data()[i] - mean_g - xhat * mean_gx);
        }
      }
    }
  });
  if (dgamma.defined()) add_block_partials(pg, blocks, n, dgamma.data());
  if (dbeta.defined()) add_block_partials(pb, blocks, n, dbeta.data());
}

template <typename T>
void rms_norm_forward(const BasicTensor<T>& x, const BasicTensor<T>& gamma, double eps,
                      const BasicTensor<T>& y, const BasicTensor<T>& rstd) {
  check_norm("rms_norm", x, gamma, y, rstd);
  const std::int64_t n = x.dim(-1);
  for_row_blocks(x.rows(), kBlock, 3.0 * n, [&](std::int64_t r0, std::int64_t r1) {
    for (std::int64_t r = r0; r < r1; ++r) {
      const T* xr = x.row(r);
      T* yr = y.row(r);
      double sq = 0;
      for (std::int64_t i = 0; i < n; ++i)
        sq += static_cast<double>(xr[i]) * xr[i];
      const T s = static_cast<T>(1.0 / std::sqrt(sq / static_cast<double>(n) + eps));
      rstd.data()[r] = s;
      for (std::int64_t i = 0; i < n; ++i)
        yr[i] = xr[i] * s * gamma.data()[i];
    }
  });
}

template <typename T>
void rms_norm_backward(const BasicTensor<T>& x, const BasicTensor<T>& gamma,
                       const BasicTensor<T>& rstd, const BasicTensor<T>& dy,
                       const BasicTensor<T>& dx, const BasicTensor<T>& dgamma) {
  check_norm("rms_norm", x, gamma, dy, rstd);
  if (dx.defined()) check_shape("rms_norm input gradient", dx.shape(), x.shape());
  if (dgamma.defined()) check_shape("rms_norm weight gradient", dgamma.shape(), gamma.shape());
  const std::int64_t n = x.dim(-1), rows = x.rows();
  const std::int64_t blocks = (rows + kBlock - 1) / kBlock;
  std::vector<T> pg(static_cast<std::size_t>(blocks * n), T(0));
  for_row_blocks(rows, kBlock, 5.0 * n, [&](std::int64_t r0, std::int64_t r1) {
    T* g_part = pg.data() + (r0 / kBlock) * n;
    for (std::int64_t r = r0; r < r1; ++r) {
      const T* xr = x.row(r);
      const T* dyr = dy.row(r);
      const T s = rstd.data()[r];
      T mean_gx = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        const T xhat = xr[i] * s;
        mean_gx += dyr[i] * gamma.data()[i] * xhat;
        g_part[i] += dyr[i] * xhat;
      }
      mean_gx /= static_cast<T>(n);
      if (dx.defined()) {
        T* dxr = dx.row(r);
        for (std::int64_t i = 0; i < n; ++i)
          dxr[i] = s * (dyr[i] * gamma.data()[i] - xr[i] * s * mean_gx);
      }
    }
  });
  if (dgamma.defined()) add_block_partials(pg, blocks, n, dgamma.data());
}

#define WEAVE_INSTANTIATE(T)                                                                       \
  template void layer_norm_forward(const BasicTensor<T>&, const BasicTensor<T>&,                   \
                                   const BasicTensor<T>&, double, const BasicTensor<T>&,           \
                                   const BasicTensor<T>&, const BasicTensor<T>&);                  \
  template void layer_norm_backward(                                                               \
      const BasicTensor<T>&, const BasicTensor<T>&, const BasicTensor<T>&, const BasicTensor<T>&,  \
      const BasicTensor<T>&, const BasicTensor<T>&, const BasicTensor<T>&, const BasicTensor<T>&); \
  template void rms_norm_forward(const BasicTensor<T>&, const BasicTensor<T>&, double,             \
                                 const BasicTensor<T>&, const BasicTensor<T>&);                    \
  template void rms_norm_backward(const BasicTensor<T>&, const BasicTensor<T>&,                    \
                                  const BasicTensor<T>&, const BasicTensor<T>&,                    \
                                  const BasicTensor<T>&, const BasicTensor<T>&);
WEAVE_INSTANTIATE(float)
WEAVE_INSTANTIATE(double)

}  // namespace weave::ops
