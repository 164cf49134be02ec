// Scaled dot-product attention, computed blockwise with an online softmax (flash-attention
// style): scores are never held for the whole sequence, only a block of queries against a
// block of keys at a time.
//
// Layout: q [b, sq, g, n d]; k, v [b, sk, g, d]; o [b, sq, g, n d]; lse [b, g n, sq]: g key/value
// heads, each shared by the n query heads stored beside it (grouped-query attention; n = 1 is
// ordinary multi-head attention, q [b, sq, h, d]). Query head i is (i / n, i % n). Views are
// fine (q may be a sequence slice of a larger tensor) as long as the last dimension is
// contiguous.
//
// Offsets place the tensors in the full sequence: query row i is position q_offset + i and
// key row j is position k_offset + j; with a causal mask a query sees the keys at positions
// <= its own. A chunk of queries with q_offset set, against whole keys and values, therefore
// gives exactly the rows of the full sequence's output — Ampipe's sequence chunks and
// context parallelism's ring steps rely on this.
#pragma once

#include <cstdint>

#include "weave/ops/random.hpp"
#include "weave/ops/tensor.hpp"

namespace weave::ops {

// Dropout on the attention probabilities, its mask drawn from the counter-based generator and
// never stored: probability (query, key) of sequence b and query head i is kept when
// uniform(key, token = (batch_offset + b) sequence_length + query position, feature =
// (head_offset + i) sequence_length + key position) >= probability, so a chunk, a ring step or a
// tensor-parallel share of the heads draws what the whole attention draws at those positions.
struct AttentionDropout {
  double probability = 0;  // in [0, 1); 0: none
  RandomKey key;
  std::int64_t sequence_length = 0;  // of the whole sequence
  std::int64_t batch_offset = 0;     // of this tensor's first sequence in the global batch
  std::int64_t head_offset = 0;      // of this tensor's first query head in the whole model
};

struct AttentionOptions {
  bool causal = true;
  std::int64_t q_offset = 0;
  std::int64_t k_offset = 0;
  double scale = 0;  // 0: 1 / sqrt(d)
  AttentionDropout dropout;
};

// Writes o and lse (natural log-sum-exp of each query row's scaled, masked scores, before
// dropout; -inf and a zero output for a row that sees no key).
template <typename T>
void attention_forward(const AttentionOptions& options, const BasicTensor<T>& q,
                       const BasicTensor<T>& k, const BasicTensor<T>& v, const BasicTensor<T>& o,
                       const BasicTensor<T>& lse);

// From the forward's o and lse and the output gradient do: writes dq; ACCUMULATES dk and dv
// (+=), since every query chunk adds to the same keys' and values' gradients. Uses
// D = rowsum(do * o) and recomputes the probabilities from lse.
template <typename T>
void attention_backward(const AttentionOptions& options, const BasicTensor<T>& q,
                        const BasicTensor<T>& k, const BasicTensor<T>& v, const BasicTensor<T>& o,
                        const BasicTensor<T>& lse, const BasicTensor<T>& d_o,
                        const BasicTensor<T>& dq, const BasicTensor<T>& dk,
                        const BasicTensor<T>& dv);

// bf16 attention: q, k, v, o, do and dq in bf16; lse in fp32; dk and dv in fp32, ACCUMULATED as
// above (the sums of many query chunks and ring steps, rounded once by the caller). The scores
// and context products, forward and backward, are bf16 products with fp32 sums (gemm_bf16); the
// softmax, lse and D = rowsum(do * o) are fp32; P and dS are rounded to bf16 as operands of the
// products they feed. Same options, masks and dropout draws as the fp32 kernel.
void attention_forward(const AttentionOptions& options, const Bf16Tensor& q, const Bf16Tensor& k,
                       const Bf16Tensor& v, const Bf16Tensor& o, const Tensor& lse);
void attention_backward(const AttentionOptions& options, const Bf16Tensor& q, const Bf16Tensor& k,
                        const Bf16Tensor& v, const Bf16Tensor& o, const Tensor& lse,
                        const Bf16Tensor& d_o, const Bf16Tensor& dq, const Tensor& dk,
                        const Tensor& dv);
// The same in fp16 (gemm_fp16): fp16 runs.
void attention_forward(const AttentionOptions& options, const Fp16Tensor& q, const Fp16Tensor& k,
                       const Fp16Tensor& v, const Fp16Tensor& o, const Tensor& lse);
void attention_backward(const AttentionOptions& options, const Fp16Tensor& q, const Fp16Tensor& k,
                        const Fp16Tensor& v, const Fp16Tensor& o, const Tensor& lse,
                        const Fp16Tensor& d_o, const Fp16Tensor& dq, const Tensor& dk,
                        const Tensor& dv);

}  // namespace weave::ops
