// Rotary position embeddings (RoPE, Su et al. 2021), as Megatron-LM applies them to queries and
// keys: the first `rotary_dims` dimensions of each head are rotated in pairs (i, i + r/2), for
// i < r/2, by the angle position x base^(-2i / r); the rest pass unchanged.
//
// x [s, b, n, m] is rotated in place, m being a whole number of heads of `head_dim` (a group's
// query heads side by side, or one key head); row s is at sequence position positions[s], so
// a context-parallel rank's pieces or an Ampipe chunk rotate as they would in the whole sequence.
#pragma once

#include <cstdint>
#include <span>

#include "weave/ops/tensor.hpp"

namespace weave::ops {

struct RotarySpec {
  std::int64_t head_dim = 0;
  std::int64_t rotary_dims = 0;  // even, at most head_dim
  double base = 10000;
};

// x <- rotate(x).
template <typename T>
void rotary_forward(const RotarySpec& spec, const BasicTensor<T>& x,
                    std::span<const std::int64_t> positions);
// dx <- rotate^T(dx): the gradient through rotary_forward (each pair's rotation is orthogonal).
template <typename T>
void rotary_backward(const RotarySpec& spec, const BasicTensor<T>& dx,
                     std::span<const std::int64_t> positions);

}  // namespace weave::ops
