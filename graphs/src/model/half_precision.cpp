#include "model/half_precision.hpp"

#include <algorithm>
#include <span>
#include <string_view>

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

}  // namespace

void round_to_bf16(const ops::Tensor& from, const ops::Bf16Tensor& to) {
  convert_rows<float, ops::bf16>("round_to_bf16", "round_to_bf16 input", "round_to_bf16 output",
                                 from, to, ops::to_bf16);
}

void widen_to_fp32(const ops::Bf16Tensor& from, const ops::Tensor& to) {
  convert_rows<ops::bf16, float>("widen_to_fp32", "widen_to_fp32 input", "widen_to_fp32 output",
                                 from, to, ops::to_float);
}

void round_in_place(const ops::Tensor& x) {
  ops::check_rows("round_in_place", x);
  const std::int64_t cols = x.dim(x.rank() - 1);
  for_rows(x.rows(), cols, [&](std::int64_t r) {
    float* row = x.row(r);
    for (std::int64_t c = 0; c < cols; ++c)
      row[c] = static_cast<float>(ops::bf16(row[c]));
  });
}

}  // namespace weave::graphs
