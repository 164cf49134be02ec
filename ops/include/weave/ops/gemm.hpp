// Matrix products through Eigen, split over the cores of the arena the caller runs in.
//
// Inside a device's task the calling thread is in that device's arena, so a large product is
// shared among the device's cores (tbb::parallel_for over blocks of C's rows or columns) and
// never touches other devices' cores. Eigen's own threading stays off.
#pragma once

#include <cstdint>

namespace weave::ops {

// A row-major matrix in memory: element (i, j) at data[i * stride + j].
template <typename T>
struct MatrixView {
  T* data = nullptr;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t stride = 0;  // >= cols
};

enum class Transpose : bool { no = false, yes = true };

// C = alpha * op(A) op(B) + beta * C. With beta == 0, C's old contents are ignored (NaNs too).
// Throws std::invalid_argument naming the three shapes if they do not fit together.
template <typename T>
void gemm(Transpose trans_a, Transpose trans_b, T alpha, MatrixView<const T> a,
          MatrixView<const T> b, T beta, MatrixView<T> c);

extern template void gemm(Transpose, Transpose, float, MatrixView<const float>,
                          MatrixView<const float>, float, MatrixView<float>);
extern template void gemm(Transpose, Transpose, double, MatrixView<const double>,
                          MatrixView<const double>, double, MatrixView<double>);

}  // namespace weave::ops
