#include "weave/ops/gemm.hpp"

#include <tbb/task_arena.h>

#include <Eigen/Core>
#include <algorithm>

#include "gemm_views.hpp"
#include "weave/runtime/parallel_for.hpp"

namespace weave::ops {
namespace {

template <typename T>
using RowMajor = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T>
using ConstMap = Eigen::Map<const RowMajor<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <typename T>
using Map = Eigen::Map<RowMajor<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

// Below this many multiply-adds a product runs on the calling thread: splitting costs more.
constexpr double kParallelMacs = 1 << 21;
// Each parallel piece keeps at least this many rows or columns of C, so Eigen's kernels still
// see panels wide enough to reach their speed.
constexpr std::int64_t kMinPiece = 64;

template <typename T>
void serial_gemm(bool ta, bool tb, T alpha, MatrixView<const T> a, MatrixView<const T> b, T beta,
                 MatrixView<T> c) {
  if (c.rows == 0 || c.cols == 0) return;
  Map<T> C(c.data, c.rows, c.cols, Eigen::OuterStride<>(c.stride));
  const std::int64_t k = ta ? a.rows : a.cols;
  if (k == 0) {
    if (beta == T(0))
      C.setZero();
    else
      C *= beta;
    return;
  }
  ConstMap<T> A(a.data, a.rows, a.cols, Eigen::OuterStride<>(a.stride));
  ConstMap<T> B(b.data, b.rows, b.cols, Eigen::OuterStride<>(b.stride));
  if (beta == T(0)) {
    if (!ta && !tb) C.noalias() = alpha * A * B;
    if (!ta && tb) C.noalias() = alpha * A * B.transpose();
    if (ta && !tb) C.noalias() = alpha * A.transpose() * B;
    if (ta && tb) C.noalias() = alpha * A.transpose() * B.transpose();
    return;
  }
  if (beta != T(1)) C *= beta;
  if (!ta && !tb) C.noalias() += alpha * A * B;
  if (!ta && tb) C.noalias() += alpha * A * B.transpose();
  if (ta && !tb) C.noalias() += alpha * A.transpose() * B;
  if (ta && tb) C.noalias() += alpha * A.transpose() * B.transpose();
}

}  // namespace

template <typename T>
void gemm(Transpose trans_a, Transpose trans_b, T alpha, MatrixView<const T> a,
          MatrixView<const T> b, T beta, MatrixView<T> c) {
  const bool ta = trans_a == Transpose::yes, tb = trans_b == Transpose::yes;
  const GemmShape shape = gemm_shape("gemm", ta, tb, a, b, c);
  const std::int64_t m = shape.m, n = shape.n, k = shape.k;
  const int threads = tbb::this_task_arena::max_concurrency();
  const double macs = static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  const bool split_rows = m >= n;
  const std::int64_t extent = split_rows ? m : n;
  const std::int64_t pieces =
      std::min<std::int64_t>(threads, std::max<std::int64_t>(1, extent / kMinPiece));
  if (threads <= 1 || macs < kParallelMacs || pieces <= 1) {
    serial_gemm<T>(ta, tb, alpha, a, b, beta, c);
    return;
  }
  // Pieces of equal size, rounded to multiples of 16 so Eigen's register blocks line up.
  const std::int64_t step = (extent / pieces + 15) / 16 * 16;
  rt::parallel_for(std::int64_t{0}, (extent + step - 1) / step, [&](std::int64_t p) {
    const std::int64_t lo = p * step, hi = std::min(extent, lo + step);
    if (split_rows) {
      serial_gemm<T>(ta, tb, alpha, op_rows(a, ta, lo, hi), b, beta,
                     {c.data + lo * c.stride, hi - lo, c.cols, c.stride});
    } else {
      serial_gemm<T>(ta, tb, alpha, a, op_cols(b, tb, lo, hi), beta,
                     {c.data + lo, c.rows, hi - lo, c.stride});
    }
  });
}

template void gemm(Transpose, Transpose, float, MatrixView<const float>, MatrixView<const float>,
                   float, MatrixView<float>);
template void gemm(Transpose, Transpose, double, MatrixView<const double>, MatrixView<const double>,
                   double, MatrixView<double>);

}  // namespace weave::ops
