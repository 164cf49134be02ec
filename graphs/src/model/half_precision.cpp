#include "model/half_precision.hpp"

#include <algorithm>
#include <span>
#include <string_view>

#include "weave/ops/linear.hpp"
#include "weave/runtime/parallel_for.hpp"

namespace weave::graphs {

namespace {

// Calls fn(row) for every row of `rows` rows of `cols` values, in blocks over the arena's cores
// once there is enough work to share.
template <typename Fn>
void for_rows(std::int64_t rows, std::int64_t cols, Fn&& fn) {
  constexpr std::int64_t kValuesPerBlock = 1 << 16;
  const std::int64_t block =
      std::max<std::int64_t>(1, kValuesPerBlock / std::max<std::int64_t>(cols, 1));
  const std::int64_t blocks = (rows + block - 1) / block;
  auto run = [&](std::int64_t b) {
    for (std::int64_t r = b * block; r < std::min(rows, (b + 1) * block); ++r)
      fn(r);
  };
  if (blocks <= 1) {
    for (std::int64_t b = 0; b < blocks; ++b)
      run(b);
    return;
  }
  rt::parallel_for(std::int64_t{0}, blocks, run);
}

// to = convert(from), row by row (same shape; views whose last dimension is contiguous).
template <typename From, typename To>
void convert_rows(std::string_view what, std::string_view input, std::string_view output,
                  const ops::BasicTensor<From>& from, const ops::BasicTensor<To>& to,
                  void (*convert)(std::span<const From>, std::span<To>)) {
  ops::check_shape(what, to.shape(), from.shape());
  ops::check_rows(input, from);
  ops::check_rows(output, to);
  const std::int64_t cols = from.dim(from.rank() - 1);
  const auto n = static_cast<std::size_t>(cols);
  for_rows(from.rows(), cols, [&](std::int64_t r) {
    convert(std::span<const From>(from.row(r), n), std::span<To>(to.row(r), n));
  });
}

ops::Fp16Tensor as_fp16(const ops::Bf16Tensor& t) {
  return t.bits_as<ops::fp16>();
}

bool is_fp16(Precision precision) {
  return precision == Precision::fp16;
}

}  // namespace

void round_to_half(Precision precision, const ops::Tensor& from, const ops::Bf16Tensor& to) {
  if (is_fp16(precision)) {
    convert_rows<float, ops::fp16>("round_to_half", "round_to_half input", "round_to_half output",
                                   from, as_fp16(to), ops::to_fp16);
    return;
  }
  convert_rows<float, ops::bf16>("round_to_half", "round_to_half input", "round_to_half output",
                                 from, to, ops::to_bf16);
}

void widen_to_fp32(Precision precision, const ops::Bf16Tensor& from, const ops::Tensor& to) {
  if (is_fp16(precision)) {
    convert_rows<ops::fp16, float>("widen_to_fp32", "widen_to_fp32 input", "widen_to_fp32 output",
                                   as_fp16(from), to, ops::to_float);
    return;
  }
  convert_rows<ops::bf16, float>("widen_to_fp32", "widen_to_fp32 input", "widen_to_fp32 output",
                                 from, to, ops::to_float);
}

void round_in_place(Precision precision, const ops::Tensor& x) {
  ops::check_rows("round_in_place", x);
  const std::int64_t cols = x.dim(x.rank() - 1);
  const bool fp16 = is_fp16(precision);
  for_rows(x.rows(), cols, [&](std::int64_t r) {
    float* row = x.row(r);
    for (std::int64_t c = 0; c < cols; ++c)
      row[c] = fp16 ? static_cast<float>(ops::fp16(row[c])) : static_cast<float>(ops::bf16(row[c]));
  });
}

void add_widened(Precision precision, const ops::bf16* from, float* to, std::int64_t n) {
  if (is_fp16(precision)) {
    for (std::int64_t c = 0; c < n; ++c)
      to[c] += static_cast<float>(ops::fp16::from_bits(from[c].bits));
    return;
  }
  for (std::int64_t c = 0; c < n; ++c)
    to[c] += static_cast<float>(from[c]);
}

void half_embedding_forward(Precision precision, std::span<const std::int32_t> ids,
                            const ops::Bf16Tensor& table, const ops::EmbeddingShard& shard,
                            const ops::Tensor& y) {
  if (is_fp16(precision)) {
    ops::embedding_forward_widened(ids, as_fp16(table), shard, y);
    return;
  }
  ops::embedding_forward_widened(ids, table, shard, y);
}

void half_linear_forward(Precision precision, const ops::Bf16Tensor& x, const ops::Bf16Tensor& w,
                         const ops::Bf16Tensor& b, const ops::Bf16Tensor& y) {
  if (is_fp16(precision))
    ops::linear_forward(as_fp16(x), as_fp16(w), as_fp16(b), as_fp16(y));
  else
    ops::linear_forward(x, w, b, y);
}

void half_linear_backward_input(Precision precision, const ops::Bf16Tensor& dy,
                                const ops::Bf16Tensor& w, const ops::Bf16Tensor& dx) {
  if (is_fp16(precision))
    ops::linear_backward_input(as_fp16(dy), as_fp16(w), as_fp16(dx));
  else
    ops::linear_backward_input(dy, w, dx);
}

void half_linear_backward_weight(Precision precision, const ops::Bf16Tensor& x,
                                 const ops::Bf16Tensor& dy, const ops::Tensor& dw,
                                 const ops::Tensor& db) {
  if (is_fp16(precision))
    ops::linear_backward_weight(as_fp16(x), as_fp16(dy), dw, db);
  else
    ops::linear_backward_weight(x, dy, dw, db);
}

void half_attention_forward(Precision precision, const ops::AttentionOptions& options,
                            const ops::Bf16Tensor& q, const ops::Bf16Tensor& k,
                            const ops::Bf16Tensor& v, const ops::Bf16Tensor& o,
                            const ops::Tensor& lse) {
  if (is_fp16(precision))
    ops::attention_forward(options, as_fp16(q), as_fp16(k), as_fp16(v), as_fp16(o), lse);
  else
    ops::attention_forward(options, q, k, v, o, lse);
}

void half_attention_backward(Precision precision, const ops::AttentionOptions& options,
                             const ops::Bf16Tensor& q, const ops::Bf16Tensor& k,
                             const ops::Bf16Tensor& v, const ops::Bf16Tensor& o,
                             const ops::Tensor& lse, const ops::Bf16Tensor& d_o,
                             const ops::Bf16Tensor& dq, const ops::Tensor& dk,
                             const ops::Tensor& dv) {
  if (is_fp16(precision))
    ops::attention_backward(options, as_fp16(q), as_fp16(k), as_fp16(v), as_fp16(o), lse,
                            as_fp16(d_o), as_fp16(dq), dk, dv);
  else
    ops::attention_backward(options, q, k, v, o, lse, d_o, dq, dk, dv);
}

}  // namespace weave::graphs
