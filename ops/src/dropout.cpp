#include "weave/ops/dropout.hpp"

#include <fmt/format.h>

#include <stdexcept>

#include "parallel_rows.hpp"

namespace weave::ops {

namespace {

template <typename T>
void apply_mask(const char* op, const DropoutSpec& spec, const BasicTensor<T>& in,
                const BasicTensor<T>& out) {
  check_rows(op, in);
  check_rows(op, out);
  check_shape(op, out.shape(), in.shape());
  if (!(spec.probability >= 0 && spec.probability < 1))
    throw std::invalid_argument(
        fmt::format("dropout probability must be in [0, 1), got {}", spec.probability));
  check_random_key(spec.key);
  const std::int64_t n = in.dim(-1);
  const std::int64_t s = in.rank() >= 2 ? in.dim(-2) : 1;
  const std::int64_t length = spec.sequence_length > 0 ? spec.sequence_length : s;
  if (spec.sequence_offset < 0 || spec.sequence_offset + s > length)
    throw std::invalid_argument(
        fmt::format("dropout: positions [{}, {}) do not fit in a sequence of length {}",
                    spec.sequence_offset, spec.sequence_offset + s, length));
  const float p = static_cast<float>(spec.probability);
  const T scale = T(1) / (T(1) - static_cast<T>(spec.probability));
  detail::for_row_blocks(in.rows(), 64, 8.0 * n, [&](std::int64_t r0, std::int64_t r1) {
    for (std::int64_t r = r0; r < r1; ++r) {
      const auto token = static_cast<std::uint64_t>((spec.batch_offset + r / s) * length +
                                                    spec.sequence_offset + r % s);
      const T* ir = in.row(r);
      T* orow = out.row(r);
      float u[4];
      std::uint64_t quad = ~std::uint64_t{0};
      for (std::int64_t i = 0; i < n; ++i) {
        const auto f = static_cast<std::uint64_t>(spec.feature_offset + i);
        if (f / 4 != quad) {
          quad = f / 4;
          uniform4(spec.key, token, quad, u);
        }
        orow[i] = u[f % 4] >= p ? ir[i] * scale : T(0);
      }
    }
  });
}

}  // namespace

template <typename T>
void dropout_forward(const DropoutSpec& spec, const BasicTensor<T>& x, const BasicTensor<T>& y) {
  apply_mask("dropout output", spec, x, y);
}

template <typename T>
void dropout_backward(const DropoutSpec& spec, const BasicTensor<T>& dy, const BasicTensor<T>& dx) {
  apply_mask("dropout input gradient", spec, dy, dx);
}

template void dropout_forward(const DropoutSpec&, const BasicTensor<float>&,
                              const BasicTensor<float>&);
template void dropout_forward(const DropoutSpec&, const BasicTensor<double>&,
                              const BasicTensor<double>&);
template void dropout_backward(const DropoutSpec&, const BasicTensor<float>&,
                               const BasicTensor<float>&);
template void dropout_backward(const DropoutSpec&, const BasicTensor<double>&,
                               const BasicTensor<double>&);

}  // namespace weave::ops
