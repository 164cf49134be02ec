#include "weave/ops/rotary.hpp"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "parallel_rows.hpp"

namespace weave::ops {

namespace {

template <typename T>
void check_rotary(const RotarySpec& spec, const BasicTensor<T>& x,
                  std::span<const std::int64_t> positions) {
  check_rows("rotary embedding", x);
  if (x.rank() != 4)
    throw std::invalid_argument(fmt::format(
        "rotary embedding input must be [sequence, batch, heads, dims], got {}", x.shape().str()));
  if (spec.head_dim < 1 || x.dim(3) % spec.head_dim != 0)
    throw std::invalid_argument(fmt::format(
        "rotary embedding: the last dimension {} must hold whole heads of {} dimensions", x.dim(3),
        spec.head_dim));
  if (spec.rotary_dims < 2 || spec.rotary_dims % 2 != 0 || spec.rotary_dims > spec.head_dim)
    throw std::invalid_argument(fmt::format(
        "rotary embedding: the rotated dimensions ({}) must be even, at least 2 and at most the "
        "head's {}",
        spec.rotary_dims, spec.head_dim));
  if (!(spec.base > 0))
    throw std::invalid_argument(
        fmt::format("rotary embedding: base must be > 0, got {}", spec.base));
  if (static_cast<std::int64_t>(positions.size()) != x.dim(0))
    throw std::invalid_argument(fmt::format("rotary embedding: {} positions for {} sequence rows",
                                            positions.size(), x.dim(0)));
}

// sign +1 rotates by +angle (forward), -1 by -angle (the transpose).
template <typename T>
void rotate(const RotarySpec& spec, const BasicTensor<T>& x,
            std::span<const std::int64_t> positions, int sign) {
  check_rotary(spec, x, positions);
  const std::int64_t S = x.dim(0), B = x.dim(1), N = x.dim(2), M = x.dim(3);
  const std::int64_t half = spec.rotary_dims / 2, heads = M / spec.head_dim;
  // The angle's frequencies in double, then each row's cos and sin rounded once to T.
  std::vector<double> frequency(static_cast<std::size_t>(half));
  for (std::int64_t i = 0; i < half; ++i)
    frequency[static_cast<std::size_t>(i)] =
        std::pow(spec.base, -2.0 * static_cast<double>(i) / static_cast<double>(spec.rotary_dims));
  detail::for_row_blocks(S, 8, 4.0 * B * N * M, [&](std::int64_t s0, std::int64_t s1) {
    std::vector<T> c(static_cast<std::size_t>(half)), sn(static_cast<std::size_t>(half));
    for (std::int64_t s = s0; s < s1; ++s) {
      const double position = static_cast<double>(positions[static_cast<std::size_t>(s)]);
      for (std::int64_t i = 0; i < half; ++i) {
        const double angle = position * frequency[static_cast<std::size_t>(i)];
        c[static_cast<std::size_t>(i)] = static_cast<T>(std::cos(angle));
        sn[static_cast<std::size_t>(i)] = static_cast<T>(sign * std::sin(angle));
      }
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t n = 0; n < N; ++n) {
          T* row = x.data() + s * x.stride(0) + b * x.stride(1) + n * x.stride(2);
          for (std::int64_t head = 0; head < heads; ++head) {
            T* v = row + head * spec.head_dim;
            for (std::int64_t i = 0; i < half; ++i) {
              const T a = v[i], z = v[i + half];
              v[i] = a * c[static_cast<std::size_t>(i)] - z * sn[static_cast<std::size_t>(i)];
              v[i + half] =
                  z * c[static_cast<std::size_t>(i)] + a * sn[static_cast<std::size_t>(i)];
            }
          }
        }
    }
  });
}

}  // namespace

template <typename T>
void rotary_forward(const RotarySpec& spec, const BasicTensor<T>& x,
                    std::span<const std::int64_t> positions) {
  rotate(spec, x, positions, 1);
}

template <typename T>
void rotary_backward(const RotarySpec& spec, const BasicTensor<T>& dx,
                     std::span<const std::int64_t> positions) {
  rotate(spec, dx, positions, -1);
}

#define WEAVE_INSTANTIATE(T)                                              \
  template void rotary_forward(const RotarySpec&, const BasicTensor<T>&,  \
                               std::span<const std::int64_t>);            \
  template void rotary_backward(const RotarySpec&, const BasicTensor<T>&, \
                                std::span<const std::int64_t>);
WEAVE_INSTANTIATE(float)
WEAVE_INSTANTIATE(double)

}  // namespace weave::ops
