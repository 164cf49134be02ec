// Splitting row-wise kernels over the cores of the caller's arena.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "weave/runtime/parallel_for.hpp"

namespace weave::ops::detail {

// Calls fn(first, last) over [0, rows) in pieces. Pieces are fixed blocks of `block` rows
// (independent of the thread count), so per-block partial results combined in block order
// give the same numbers on any number of threads. Small work stays on the calling thread.
template <typename Fn>
void for_row_blocks(std::int64_t rows, std::int64_t block, double work_per_row, Fn&& fn) {
  const std::int64_t blocks = (rows + block - 1) / block;
  if (blocks <= 1 || work_per_row * static_cast<double>(rows) < 32768.0) {
    for (std::int64_t b = 0; b < blocks; ++b)
      fn(b * block, std::min(rows, (b + 1) * block));
    return;
  }
  rt::parallel_for(std::int64_t{0}, blocks,
                   [&](std::int64_t b) { fn(b * block, std::min(rows, (b + 1) * block)); });
}

// Column sums of per-block partials: partials holds `blocks` rows of `cols`; adds them in
// block order into out.
template <typename T>
void add_block_partials(const std::vector<T>& partials, std::int64_t blocks, std::int64_t cols,
                        T* out) {
  for (std::int64_t b = 0; b < blocks; ++b)
    for (std::int64_t c = 0; c < cols; ++c)
      out[c] += partials[static_cast<std::size_t>(b * cols + c)];
}

}  // namespace weave::ops::detail
