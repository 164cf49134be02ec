#include "weave/ops/bfloat16.hpp"

#include <fmt/format.h>

#include <stdexcept>

namespace weave::ops {
namespace {

void check_lengths(const char* what, std::size_t from, std::size_t to) {
  if (from != to)
    throw std::invalid_argument(
        fmt::format("{}: the source has {} elements and the destination {}: they must be equal",
                    what, from, to));
}

}  // namespace

void to_bf16(std::span<const float> from, std::span<bf16> to) {
  check_lengths("to_bf16", from.size(), to.size());
  for (std::size_t i = 0; i < from.size(); ++i)
    to[i] = bf16(from[i]);
}

void to_float(std::span<const bf16> from, std::span<float> to) {
  check_lengths("to_float", from.size(), to.size());
  for (std::size_t i = 0; i < from.size(); ++i)
    to[i] = static_cast<float>(from[i]);
}

}  // namespace weave::ops
