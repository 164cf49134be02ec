#include "weave/ops/linear.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

#include "row_blocks.hpp"
#include "weave/ops/gemm_bf16.hpp"

namespace weave::ops {

using detail::as_const;
using detail::block_of;
using detail::matrix_of;
using detail::row_blocks;

namespace {

template <typename T, typename W>
void check_linear(const BasicTensor<T>& x, const BasicTensor<W>& w, const BasicTensor<T>& y,
                  const char* x_name, const char* y_name) {
  check_rows(x_name, x);
  check_rows(y_name, y);
  if (!w.defined() || w.rank() != 2)
    throw std::invalid_argument(
        fmt::format("linear weight must have shape [out, in], got {}", w.shape().str()));
  check_rows("linear weight", w);
  check_shape(fmt::format("linear {} (for weight {})", x_name, w.shape().str()).c_str(), x.shape(),
              x.shape().with(-1, w.dim(1)));
  check_shape(fmt::format("linear {} (for {} {} and weight {})", y_name, x_name, x.shape().str(),
                          w.shape().str())
                  .c_str(),
              y.shape(), x.shape().with(-1, w.dim(0)));
}

}  // namespace

template <typename T>
void linear_forward(const BasicTensor<T>& x, const BasicTensor<T>& w, const BasicTensor<T>& b,
                    const BasicTensor<T>& y) {
  check_linear(x, w, y, "input", "output");
  if (b.defined()) check_shape("linear bias", b.shape(), Shape{w.dim(0)});
  const auto wm = as_const(matrix_of(w));
  for (const auto& blk : row_blocks<T>({&x, &y})) {
    const auto ym = block_of(y, blk, 1);
    if (b.defined()) {
      for (std::int64_t r = 0; r < ym.rows; ++r)
        std::copy_n(b.data(), ym.cols, ym.data + r * ym.stride);
    }
    gemm<T>(Transpose::no, Transpose::yes, T(1), as_const(block_of(x, blk, 0)), wm,
            b.defined() ? T(1) : T(0), ym);
  }
}

template <typename T>
void linear_backward_input(const BasicTensor<T>& dy, const BasicTensor<T>& w,
                           const BasicTensor<T>& dx) {
  check_linear(dx, w, dy, "input gradient", "output gradient");
  const auto wm = as_const(matrix_of(w));
  for (const auto& blk : row_blocks<T>({&dy, &dx}))
    gemm<T>(Transpose::no, Transpose::no, T(1), as_const(block_of(dy, blk, 0)), wm, T(0),
            block_of(dx, blk, 1));
}

template <typename T>
void linear_backward_weight(const BasicTensor<T>& x, const BasicTensor<T>& dy,
                            const BasicTensor<T>& dw, const BasicTensor<T>& db) {
  check_linear(x, dw, dy, "input", "output gradient");
  if (db.defined()) check_shape("linear bias gradient", db.shape(), Shape{dw.dim(0)});
  const auto dwm = matrix_of(dw);
  for (const auto& blk : row_blocks<T>({&x, &dy})) {
    const auto dym = as_const(block_of(dy, blk, 1));
    gemm<T>(Transpose::yes, Transpose::no, T(1), dym, as_const(block_of(x, blk, 0)), T(1), dwm);
    if (db.defined()) {
      // Rows in order: the same sum whatever the thread count.
      for (std::int64_t r = 0; r < dym.rows; ++r)
        for (std::int64_t c = 0; c < dym.cols; ++c)
          db.data()[c] += dym.data[r * dym.stride + c];
    }
  }
}

#define WEAVE_INSTANTIATE(T)                                                         \
  template void linear_forward(const BasicTensor<T>&, const BasicTensor<T>&,         \
                               const BasicTensor<T>&, const BasicTensor<T>&);        \
  template void linear_backward_input(const BasicTensor<T>&, const BasicTensor<T>&,  \
                                      const BasicTensor<T>&);                        \
  template void linear_backward_weight(const BasicTensor<T>&, const BasicTensor<T>&, \
                                       const BasicTensor<T>&, const BasicTensor<T>&);
WEAVE_INSTANTIATE(float)
WEAVE_INSTANTIATE(double)

namespace {

template <typename Half>
void linear_forward_half(const BasicTensor<Half>& x, const BasicTensor<Half>& w,
                         const BasicTensor<Half>& b, const BasicTensor<Half>& y) {
  check_linear(x, w, y, "input", "output");
  if (b.defined()) check_shape("linear bias", b.shape(), Shape{w.dim(0)});
  const auto wm = as_const(matrix_of(w));
  for (const auto& blk : row_blocks<Half>({&x, &y})) {
    const auto ym = block_of(y, blk, 1);
    // The bias goes in as C with beta = 1: oneDNN adds it to the fp32 sums before the one
    // rounding to 16 bits.
    if (b.defined()) {
      for (std::int64_t r = 0; r < ym.rows; ++r)
        std::copy_n(b.data(), ym.cols, ym.data + r * ym.stride);
    }
    gemm_half(Transpose::no, Transpose::yes, 1.f, as_const(block_of(x, blk, 0)), wm,
              b.defined() ? 1.f : 0.f, ym);
  }
}

template <typename Half>
void linear_backward_input_half(const BasicTensor<Half>& dy, const BasicTensor<Half>& w,
                                const BasicTensor<Half>& dx) {
  check_linear(dx, w, dy, "input gradient", "output gradient");
  const auto wm = as_const(matrix_of(w));
  for (const auto& blk : row_blocks<Half>({&dy, &dx}))
    gemm_half(Transpose::no, Transpose::no, 1.f, as_const(block_of(dy, blk, 0)), wm, 0.f,
              block_of(dx, blk, 1));
}

template <typename Half>
void linear_backward_weight_half(const BasicTensor<Half>& x, const BasicTensor<Half>& dy,
                                 const Tensor& dw, const Tensor& db) {
  check_linear(x, dw, dy, "input", "output gradient");
  if (db.defined()) check_shape("linear bias gradient", db.shape(), Shape{dw.dim(0)});
  const auto dwm = matrix_of(dw);
  for (const auto& blk : row_blocks<Half>({&x, &dy})) {
    const auto dym = as_const(block_of(dy, blk, 1));
    gemm_half(Transpose::yes, Transpose::no, 1.f, dym, as_const(block_of(x, blk, 0)), 1.f, dwm);
    if (db.defined()) {
      // Rows in order, in fp32: the same sum whatever the thread count.
      for (std::int64_t r = 0; r < dym.rows; ++r)
        for (std::int64_t c = 0; c < dym.cols; ++c)
          db.data()[c] += static_cast<float>(dym.data[r * dym.stride + c]);
    }
  }
}

}  // namespace

void linear_forward(const Bf16Tensor& x, const Bf16Tensor& w, const Bf16Tensor& b,
                    const Bf16Tensor& y) {
  linear_forward_half(x, w, b, y);
}
void linear_forward(const Fp16Tensor& x, const Fp16Tensor& w, const Fp16Tensor& b,
                    const Fp16Tensor& y) {
  linear_forward_half(x, w, b, y);
}
void linear_backward_input(const Bf16Tensor& dy, const Bf16Tensor& w, const Bf16Tensor& dx) {
  linear_backward_input_half(dy, w, dx);
}
void linear_backward_input(const Fp16Tensor& dy, const Fp16Tensor& w, const Fp16Tensor& dx) {
  linear_backward_input_half(dy, w, dx);
}
void linear_backward_weight(const Bf16Tensor& x, const Bf16Tensor& dy, const Tensor& dw,
                            const Tensor& db) {
  linear_backward_weight_half(x, dy, dw, db);
}
void linear_backward_weight(const Fp16Tensor& x, const Fp16Tensor& dy, const Tensor& dw,
                            const Tensor& db) {
  linear_backward_weight_half(x, dy, dw, db);
}

}  // namespace weave::ops
