// Token embedding lookup, whole or vocab-parallel (Megatron's VocabParallelEmbedding: each
// tensor-parallel rank holds rows [vocab_start, vocab_start + rows) of the table, writes zeros
// for tokens outside them, and an all-reduce over the group sums the partial outputs).
#pragma once

#include <cstdint>
#include <span>

#include "weave/ops/tensor.hpp"

namespace weave::ops {

struct EmbeddingShard {
  std::int64_t vocab_start = 0;  // first token id this table holds
  std::int64_t vocab_size = 0;   // of the whole vocabulary; 0: the table's rows
};

// y [..., h] row r = table[ids[r] - vocab_start] or zeros; table [rows, h]; ids.size() ==
// y.rows(). Throws std::invalid_argument naming the position of an id outside
// [0, vocab_size).
template <typename T>
void embedding_forward(std::span<const std::int32_t> ids, const BasicTensor<T>& table,
                       const EmbeddingShard& shard, const BasicTensor<T>& y);

// The same with a 16-bit table (Half: bf16, or fp16), each row widened to fp32 (exactly) into y:
// a 16-bit model's lookup, whose output the model keeps in fp32.
template <typename Half>
void embedding_forward_widened(std::span<const std::int32_t> ids, const BasicTensor<Half>& table,
                               const EmbeddingShard& shard, const BasicTensor<float>& y);

// dtable += the rows of dy scattered to their ids, in position order (deterministic).
template <typename T>
void embedding_backward(std::span<const std::int32_t> ids, const BasicTensor<T>& dy,
                        const EmbeddingShard& shard, const BasicTensor<T>& dtable);

}  // namespace weave::ops
