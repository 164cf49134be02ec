// Cross-entropy over logits, whole or vocab-parallel.
//
// Vocab-parallel (Megatron's vocab_parallel_cross_entropy): each of the p tensor-parallel
// ranks holds the logits of vocabulary entries [vocab_start, vocab_start + v_local). The loss
// needs two reductions across the group, done by the caller's collectives between the steps:
//   1. cross_entropy_row_max          -> all-reduce(max) of row_max [n]
//   2. cross_entropy_partial_sums     -> all-reduce(sum) of partials [n, 3]
//   3. cross_entropy_loss             (every rank gets the same loss)
//   4. cross_entropy_backward         (each rank its own slice of dlogits; no communication)
// With one rank (vocab_start 0, the whole vocabulary) the same steps are plain cross-entropy,
// and cross_entropy_forward runs them in one call.
//
// The mean is over `denominator` tokens: by default those of this call that are not ignored;
// pass the global count when a batch is split into micro-batches or sequence chunks so that
// the parts' losses and gradients add up to the whole batch's.
#pragma once

#include <cstdint>
#include <span>

#include "weave/ops/tensor.hpp"

namespace weave::ops {

struct CrossEntropyOptions {
  std::int32_t ignore_index = -100;  // targets equal to it add nothing (PyTorch's default)
  double label_smoothing = 0;        // in [0, 1): PyTorch's label_smoothing
  double denominator = 0;            // tokens the mean divides by; 0: this call's counted tokens
};

struct VocabShard {
  std::int64_t vocab_start = 0;
  std::int64_t vocab_size = 0;  // of the whole vocabulary; 0: the logits' last dimension
};

// Partial sums per row, reduced by sum across the group: sum of exp(logit - max), the target's
// logit (0 on ranks that do not hold it), and the sum of logits (for label smoothing).
inline constexpr int kCrossEntropyPartials = 3;

// row_max [n] = max over this rank's logits [n, v_local].
template <typename T>
void cross_entropy_row_max(const BasicTensor<T>& logits, const BasicTensor<T>& row_max);

// partials [n, 3] from logits [n, v_local] and the group's row maxima.
template <typename T>
void cross_entropy_partial_sums(const BasicTensor<T>& logits, std::span<const std::int32_t> targets,
                                const VocabShard& shard, const BasicTensor<T>& global_max,
                                const BasicTensor<T>& partials);

// Mean loss; writes log-sum-exp per row (lse [n], kept for the backward) and, if defined, the
// loss per row (losses [n], 0 for ignored rows). vocab_size: of the whole vocabulary.
template <typename T>
double cross_entropy_loss(const BasicTensor<T>& global_max, const BasicTensor<T>& partials,
                          std::span<const std::int32_t> targets, std::int64_t vocab_size,
                          const CrossEntropyOptions& options, const BasicTensor<T>& lse,
                          const BasicTensor<T>& losses);

// dlogits [n, v_local] = loss_scale / denominator * (softmax - (1 - eps) onehot - eps / V),
// zero on ignored rows. loss_scale is the gradient arriving at the mean loss (1 for a plain
// backward). dlogits may be logits itself: each value is read before its gradient is written
// over it (a 16-bit run keeps no other fp32 copy of the logits).
template <typename T>
void cross_entropy_backward(const BasicTensor<T>& logits, std::span<const std::int32_t> targets,
                            const VocabShard& shard, const BasicTensor<T>& lse,
                            const CrossEntropyOptions& options, double loss_scale,
                            const BasicTensor<T>& dlogits);

// The four steps on one rank holding the whole vocabulary: returns the mean loss and fills
// lse [n] for the backward.
template <typename T>
double cross_entropy_forward(const BasicTensor<T>& logits, std::span<const std::int32_t> targets,
                             const CrossEntropyOptions& options, const BasicTensor<T>& lse);

}  // namespace weave::ops
