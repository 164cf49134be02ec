#include "weave/ops/embedding.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

#include "weave/ops/bfloat16.hpp"
#include "weave/ops/float16.hpp"
#include "weave/runtime/parallel_for.hpp"

namespace weave::ops {

namespace {

template <typename T, typename Y>
std::int64_t check_embedding(std::span<const std::int32_t> ids, const BasicTensor<T>& table,
                             const EmbeddingShard& shard, const BasicTensor<Y>& y,
                             const char* y_name) {
  check_rows("embedding table", table);
  check_rows(y_name, y);
  if (table.rank() != 2)
    throw std::invalid_argument(
        fmt::format("embedding table must be [vocab rows, hidden], got {}", table.shape().str()));
  check_shape(y_name, y.shape(), y.shape().with(-1, table.dim(1)));
  if (static_cast<std::int64_t>(ids.size()) != y.rows())
    throw std::invalid_argument(fmt::format("embedding: {} token ids for {} of shape {} ({} rows)",
                                            ids.size(), y_name, y.shape().str(), y.rows()));
  const std::int64_t vocab = shard.vocab_size > 0 ? shard.vocab_size : table.dim(0);
  if (shard.vocab_start < 0 || shard.vocab_start + table.dim(0) > vocab)
    throw std::invalid_argument(
        fmt::format("embedding shard rows [{}, {}) lie outside the vocabulary of {}",
                    shard.vocab_start, shard.vocab_start + table.dim(0), vocab));
  for (std::size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= vocab)
      throw std::invalid_argument(
          fmt::format("embedding: token id {} at position {} is outside the vocabulary [0, {})",
                      ids[i], i, vocab));
  return vocab;
}

// y's rows: each token's row of the table (converted to Out), zeros for a token outside it.
template <typename In, typename Out>
void gather_rows(std::span<const std::int32_t> ids, const BasicTensor<In>& table,
                 const EmbeddingShard& shard, const BasicTensor<Out>& y) {
  check_embedding(ids, table, shard, y, "embedding output");
  const std::int64_t h = table.dim(1), rows = table.dim(0);
  for (std::int64_t r = 0; r < y.rows(); ++r) {
    const std::int64_t local = ids[static_cast<std::size_t>(r)] - shard.vocab_start;
    Out* yr = y.row(r);
    if (local >= 0 && local < rows)
      std::transform(table.row(local), table.row(local) + h, yr,
                     [](In v) { return static_cast<Out>(v); });
    else
      std::fill_n(yr, h, Out(0));
  }
}

}  // namespace

template <typename T>
void embedding_forward(std::span<const std::int32_t> ids, const BasicTensor<T>& table,
                       const EmbeddingShard& shard, const BasicTensor<T>& y) {
  gather_rows(ids, table, shard, y);
}

template <typename Half>
void embedding_forward_widened(std::span<const std::int32_t> ids, const BasicTensor<Half>& table,
                               const EmbeddingShard& shard, const BasicTensor<float>& y) {
  gather_rows(ids, table, shard, y);
}

template <typename T>
void embedding_backward(std::span<const std::int32_t> ids, const BasicTensor<T>& dy,
                        const EmbeddingShard& shard, const BasicTensor<T>& dtable) {
  check_embedding(ids, dtable, shard, dy, "embedding output gradient");
  const std::int64_t h = dtable.dim(1), rows = dtable.dim(0);
  // Column slabs in parallel, positions in order within each: every element of dtable sees
  // its additions in position order whatever the thread count.
  constexpr std::int64_t kSlab = 256;
  auto slab = [&](std::int64_t c0, std::int64_t c1) {
    for (std::int64_t r = 0; r < dy.rows(); ++r) {
      const std::int64_t local = ids[static_cast<std::size_t>(r)] - shard.vocab_start;
      if (local < 0 || local >= rows) continue;
      const T* g = dy.row(r);
      T* d = dtable.row(local);
      for (std::int64_t c = c0; c < c1; ++c)
        d[c] += g[c];
    }
  };
  const std::int64_t slabs = (h + kSlab - 1) / kSlab;
  if (slabs <= 1 || dy.rows() * h < 32768) {
    slab(0, h);
    return;
  }
  rt::parallel_for(std::int64_t{0}, slabs,
                   [&](std::int64_t s) { slab(s * kSlab, std::min(h, (s + 1) * kSlab)); });
}

template void embedding_forward(std::span<const std::int32_t>, const BasicTensor<float>&,
                                const EmbeddingShard&, const BasicTensor<float>&);
template void embedding_forward(std::span<const std::int32_t>, const BasicTensor<double>&,
                                const EmbeddingShard&, const BasicTensor<double>&);
template void embedding_forward_widened(std::span<const std::int32_t>, const BasicTensor<bf16>&,
                                        const EmbeddingShard&, const BasicTensor<float>&);
template void embedding_forward_widened(std::span<const std::int32_t>, const BasicTensor<fp16>&,
                                        const EmbeddingShard&, const BasicTensor<float>&);
template void embedding_backward(std::span<const std::int32_t>, const BasicTensor<float>&,
                                 const EmbeddingShard&, const BasicTensor<float>&);
template void embedding_backward(std::span<const std::int32_t>, const BasicTensor<double>&,
                                 const EmbeddingShard&, const BasicTensor<double>&);

}  // namespace weave::ops
