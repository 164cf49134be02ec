#include "model/half_norm.hpp"

#include <algorithm>

#include "model/half_precision.hpp"
#include "model/norm.hpp"
#include "weave/runtime/parallel_for.hpp"

namespace weave::graphs {

namespace {

// Rows of the [S, B, h] layout normed together: the scratch is a few rows of the layout, the
// size of a kernel's working set rather than an activation's.
constexpr std::int64_t kBlockRows = 8;

}  // namespace

void norm_forward_to_half(const ModelConfig& m, const ops::Tensor& x, const Parameter& weight,
                          const Parameter* bias, const ops::Bf16Tensor& y16,
                          const ops::Tensor& mean, const ops::Tensor& rstd) {
  ops::check_shape("norm_forward_to_half output", y16.shape(), x.shape());
  const std::int64_t rows = x.dim(0);
  const std::int64_t stats_per_row = mean.numel() / std::max<std::int64_t>(rows, 1);
  const std::int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  rt::parallel_for(std::int64_t{0}, blocks, [&](std::int64_t b) {
    const std::int64_t first = b * kBlockRows, n = std::min(kBlockRows, rows - first);
    const ops::Tensor y = ops::Tensor::empty(x.slice(0, first, n).shape());
    norm_forward(m, x.slice(0, first, n), weight, bias, y,
                 mean.slice(0, first * stats_per_row, n * stats_per_row),
                 rstd.slice(0, first * stats_per_row, n * stats_per_row));
    round_to_half(m.precision, y, y16.slice(0, first, n));
  });
}

}  // namespace weave::graphs
