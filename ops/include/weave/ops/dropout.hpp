// Dropout with masks drawn from the counter-based generator, never stored.
//
// x [..., s, n] is read as rows of tokens: with s = dim(-2) (1 for a rank-1 x), row r is token
// (batch_offset + r / s) * sequence_length + sequence_offset + r % s of the whole batch, and
// column j is
// feature feature_offset + j. A chunk or shard of the sequence therefore draws the same mask
// as the whole sequence when it passes its offsets. The backward recomputes the mask.
#pragma once

#include <cstdint>

#include "weave/ops/random.hpp"
#include "weave/ops/tensor.hpp"

namespace weave::ops {

struct DropoutSpec {
  double probability = 0;  // of dropping; in [0, 1)
  RandomKey key;
  std::int64_t sequence_offset = 0;  // of this tensor's first position in the full sequence
  std::int64_t sequence_length = 0;  // of the full sequence; 0: this tensor's dim(-2)
  std::int64_t feature_offset = 0;   // of this tensor's first feature (tensor-parallel shards)
  std::int64_t batch_offset = 0;     // of this tensor's first sequence in the global batch
};

// y = x * keep / (1 - p), keep = uniform >= p. y may be x.
template <typename T>
void dropout_forward(const DropoutSpec& spec, const BasicTensor<T>& x, const BasicTensor<T>& y);
// dx = dy * keep / (1 - p). dx may be dy.
template <typename T>
void dropout_backward(const DropoutSpec& spec, const BasicTensor<T>& dy, const BasicTensor<T>& dx);

}  // namespace weave::ops
