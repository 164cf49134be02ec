// 16-bit values (bf16, or fp16's bits) through the collectives that only copy what they are given
// (all-gather, broadcast, all-to-all, send/recv): two values packed in each 4-byte element, whose
// bits every backend moves unchanged (the shared-memory kernels' loads and stores, MPI's
// transfers between processes of one host). A collective over n 16-bit values then moves n / 2
// elements, 2 bytes a value, and costs that at the elements' 4 bytes
// (CollectiveOptions::element_bytes). Reductions must not be given packed values: they would add
// the pairs as floats.
#pragma once

#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>

namespace weave::devices {

namespace packed_halves_detail {

template <typename Half>
void check(std::span<Half> halves, const char* what) {
  if (halves.size() % 2 != 0 || reinterpret_cast<std::uintptr_t>(halves.data()) % 4 != 0)
    throw std::invalid_argument(
        std::string(what) + ": 16-bit values are moved two to a 4-byte element, so a buffer of " +
        std::to_string(halves.size()) +
        " of them must hold an even count at a 4-byte aligned address; pad it to an even count "
        "(a bucket's padding to 16 values a replica does)");
}

}  // namespace packed_halves_detail

// `halves`' values as the 4-byte elements a collective moves; `what` names the buffer in the
// error an odd count or a misaligned address gets.
inline std::span<float> packed_halves(std::span<std::uint16_t> halves, const char* what) {
  packed_halves_detail::check(halves, what);
  return {reinterpret_cast<float*>(halves.data()), halves.size() / 2};
}
inline std::span<const float> packed_halves(std::span<const std::uint16_t> halves,
                                            const char* what) {
  packed_halves_detail::check(halves, what);
  return {reinterpret_cast<const float*>(halves.data()), halves.size() / 2};
}

}  // namespace weave::devices
