// 16-bit values (bf16, or fp16's bits) through an all-gather: two values packed in each 4-byte
// element the collective moves. The values are handed over as bytes (std::byte, which may view
// storage of any type) and the all-gather moves its elements' bytes without reading any of them
// as a float (devices/src/collective_kernels.hpp; MPI's transfers between processes of one host
// move bytes too), so the bits arrive unchanged, NaN payloads included. A collective over n
// 16-bit values then moves n / 2 elements, 2 bytes a value, and costs that at the elements' 4
// bytes (CollectiveOptions::element_bytes). Reductions must not be given packed values: they
// would add the pairs as floats.
#pragma once

#include <cstddef>
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

// `halves`' bytes, which make whole 4-byte elements; `what` names the buffer in the error an odd
// count or a misaligned address gets.
inline std::span<std::byte> packed_halves(std::span<std::uint16_t> halves, const char* what) {
  packed_halves_detail::check(halves, what);
  return std::as_writable_bytes(halves);
}
inline std::span<const std::byte> packed_halves(std::span<const std::uint16_t> halves,
                                                const char* what) {
  packed_halves_detail::check(halves, what);
  return std::as_bytes(halves);
}

// An all-gather member's buffer given as packed bytes: the span of 4-byte elements the member
// gives the collective (CollectiveMember, Communicator::all_gather). Only the address and the
// count are taken: the all-gather copies the elements as bytes and never reads one as a float.
inline std::span<float> gathered_elements(std::span<std::byte> bytes) {
  return {reinterpret_cast<float*>(bytes.data()), bytes.size() / sizeof(float)};
}
inline std::span<const float> gathered_elements(std::span<const std::byte> bytes) {
  return {reinterpret_cast<const float*>(bytes.data()), bytes.size() / sizeof(float)};
}

}  // namespace weave::devices
