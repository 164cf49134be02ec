// Tensors of the same leading shape seen as a few row-major matrices with uniform row strides.
//
// A contiguous [..., n] tensor is one matrix of numel / n rows. A view (a sequence slice of a
// [batch, sequence, n] tensor, say) is one matrix per index of the dimensions whose stride
// breaks the pattern. Kernels that multiply matrices walk these blocks together.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "weave/ops/gemm.hpp"
#include "weave/ops/tensor.hpp"

namespace weave::ops::detail {

struct RowBlock {
  std::int64_t rows = 0;
  std::vector<std::int64_t> offsets;  // per tensor, element offset of the block's first row
};

// The tensors must have equal leading shapes (all dimensions but the last) and contiguous last
// dimensions; blocks come in row order.
template <typename T>
std::vector<RowBlock> row_blocks(std::initializer_list<const BasicTensor<T>*> tensors) {
  const BasicTensor<T>& first = **tensors.begin();
  const int lead = first.rank() - 1;  // leading dimensions
  // Dimensions [merge_from, lead) fold into one run of rows for every tensor.
  int merge_from = lead;
  if (lead > 0) {
    merge_from = lead - 1;
    while (merge_from > 0) {
      bool uniform = true;
      for (const BasicTensor<T>* t : tensors)
        uniform =
            uniform && t->stride(merge_from - 1) == t->stride(merge_from) * t->dim(merge_from);
      if (!uniform) break;
      --merge_from;
    }
  }
  std::int64_t rows = 1, outer = 1;
  for (int d = merge_from; d < lead; ++d)
    rows *= first.dim(d);
  for (int d = 0; d < merge_from; ++d)
    outer *= first.dim(d);
  std::vector<RowBlock> blocks;
  if (rows == 0) return blocks;
  blocks.reserve(static_cast<std::size_t>(outer));
  for (std::int64_t o = 0; o < outer; ++o) {
    RowBlock b{rows, {}};
    for (const BasicTensor<T>* t : tensors) {
      std::int64_t offset = 0, rest = o;
      for (int d = merge_from - 1; d >= 0; --d) {
        offset += (rest % t->dim(d)) * t->stride(d);
        rest /= t->dim(d);
      }
      b.offsets.push_back(offset);
    }
    blocks.push_back(std::move(b));
  }
  return blocks;
}

// Block `b`'s rows of tensor t (the i-th of the list given to row_blocks).
template <typename T>
MatrixView<T> block_of(const BasicTensor<T>& t, const RowBlock& b, std::size_t i) {
  const std::int64_t stride = t.rank() >= 2 ? t.stride(-2) : t.dim(-1);
  return {t.data() + b.offsets[i], b.rows, t.dim(-1), stride};
}

template <typename T>
MatrixView<const T> as_const(MatrixView<T> m) {
  return {m.data, m.rows, m.cols, m.stride};
}

// A whole rank-2 contiguous-rows tensor as a matrix.
template <typename T>
MatrixView<T> matrix_of(const BasicTensor<T>& t) {
  return {t.data(), t.dim(0), t.dim(1), t.stride(0)};
}

}  // namespace weave::ops::detail
