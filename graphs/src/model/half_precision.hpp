// 16-bit mixed-precision training's conversions between the fp32 tensors of the residual
// stream, the norms and the loss and the 16-bit tensors the products read and the layers keep,
// and its products. One code path for bf16 and fp16 runs, the format a parameter: the 16-bit
// tensors are held as ops::Bf16Tensor storage, whose bits an fp16 run reads as fp16
// (ops::BasicTensor::bits_as).
#pragma once

#include <cstdint>
#include <span>
#include "weave/graphs/model_config.hpp"

#include "weave/ops/attention.hpp"
#include "weave/ops/embedding.hpp"
#include "weave/ops/tensor.hpp"

namespace weave::graphs {

// to = from rounded to nearest even in `precision` (bf16 or fp16), element by element (same
// shape; views whose last dimension is contiguous), split over the cores of the caller's arena.
void round_to_half(Precision precision, const ops::Tensor& from, const ops::Bf16Tensor& to);
// to = from widened to fp32 (exact).
void widen_to_fp32(Precision precision, const ops::Bf16Tensor& from, const ops::Tensor& to);
// x = x rounded to `precision` and kept in fp32: the value a 16-bit tensor would hold.
void round_in_place(Precision precision, const ops::Tensor& x);
// to[c] += from[c] widened to fp32, c < n: a row of a 16-bit table added into an fp32 row.
void add_widened(Precision precision, const ops::bf16* from, float* to, std::int64_t n);

// ops::embedding_forward on a 16-bit table, its rows widened into the fp32 output.
void half_embedding_forward(Precision precision, std::span<const std::int32_t> ids,
                            const ops::Bf16Tensor& table, const ops::EmbeddingShard& shard,
                            const ops::Tensor& y);

// ops::linear_* and ops::attention_* on the 16-bit tensors in `precision`.
void half_linear_forward(Precision precision, const ops::Bf16Tensor& x, const ops::Bf16Tensor& w,
                         const ops::Bf16Tensor& b, const ops::Bf16Tensor& y);
void half_linear_backward_input(Precision precision, const ops::Bf16Tensor& dy,
                                const ops::Bf16Tensor& w, const ops::Bf16Tensor& dx);
void half_linear_backward_weight(Precision precision, const ops::Bf16Tensor& x,
                                 const ops::Bf16Tensor& dy, const ops::Tensor& dw,
                                 const ops::Tensor& db = {});
void half_attention_forward(Precision precision, const ops::AttentionOptions& options,
                            const ops::Bf16Tensor& q, const ops::Bf16Tensor& k,
                            const ops::Bf16Tensor& v, const ops::Bf16Tensor& o,
                            const ops::Tensor& lse);
void half_attention_backward(Precision precision, const ops::AttentionOptions& options,
                             const ops::Bf16Tensor& q, const ops::Bf16Tensor& k,
                             const ops::Bf16Tensor& v, const ops::Bf16Tensor& o,
                             const ops::Tensor& lse, const ops::Bf16Tensor& d_o,
                             const ops::Bf16Tensor& dq, const ops::Tensor& dk,
                             const ops::Tensor& dv);

}  // namespace weave::graphs
