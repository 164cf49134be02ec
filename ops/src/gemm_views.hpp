// What the fp32 and bf16 products share about their operands: the shape rule of
// C = alpha op(A) op(B) + beta C, and the sub-views a product split over the arena hands each
// piece.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <stdexcept>
#include <string_view>

#include "weave/ops/gemm.hpp"

namespace weave::ops {

struct GemmShape {
  std::int64_t m, n, k;
};

// op(A) [m, k], op(B) [k, n] and C [m, n], or an error naming `kernel` and the three shapes.
template <typename A, typename B, typename C>
GemmShape gemm_shape(std::string_view kernel, bool ta, bool tb, MatrixView<A> a, MatrixView<B> b,
                     MatrixView<C> c) {
  const std::int64_t m = ta ? a.cols : a.rows, k = ta ? a.rows : a.cols;
  const std::int64_t kb = tb ? b.cols : b.rows, n = tb ? b.rows : b.cols;
  if (k != kb || c.rows != m || c.cols != n)
    throw std::invalid_argument(fmt::format(
        "{}: op(A) is [{}, {}], op(B) is [{}, {}] and C is [{}, {}]: need op(A) [m, k], "
        "op(B) [k, n], C [m, n]",
        kernel, m, k, kb, n, c.rows, c.cols));
  return {m, n, k};
}

// Rows [r0, r1) of op(A): a sub-view of A.
template <typename T>
MatrixView<const T> op_rows(MatrixView<const T> a, bool trans, std::int64_t r0, std::int64_t r1) {
  if (!trans) return {a.data + r0 * a.stride, r1 - r0, a.cols, a.stride};
  return {a.data + r0, a.rows, r1 - r0, a.stride};
}
// Columns [c0, c1) of op(B).
template <typename T>
MatrixView<const T> op_cols(MatrixView<const T> b, bool trans, std::int64_t c0, std::int64_t c1) {
  if (!trans) return {b.data + c0, b.rows, c1 - c0, b.stride};
  return {b.data + c0 * b.stride, c1 - c0, b.cols, b.stride};
}

}  // namespace weave::ops
