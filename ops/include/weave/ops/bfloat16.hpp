// bfloat16: the upper 16 bits of an IEEE fp32 (1 sign, 8 exponent, 7 mantissa bits), the
// storage type of 16-bit training. Same range as fp32, 8 significant bits: a value rounded to
// bf16 has a relative error of at most 2^-8 (half a unit in the last place).
//
// Conversions:
//   fp32 -> bf16 rounds to nearest, ties to even (the rounding of oneDNN's reorders and of the
//   AVX512_BF16 instruction vcvtneps2bf16). Infinities stay infinities; a NaN stays a NaN (made
//   quiet, its sign and upper payload bits kept), never rounded up into an infinity. Values too
//   large round to infinity as IEEE rounding says (above 0x1.fffffp+127 in magnitude). Subnormal
//   fp32 inputs round like any other value here; the hardware instruction instead treats them
//   as zero (it ignores MXCSR and flushes), so bf16 matrix products on AVX512_BF16 may read a
//   subnormal as zero: a difference below 2^-126, far under bf16's tolerance.
//   bf16 -> fp32 is exact (appends 16 zero bits).
#pragma once

#include <bit>
#include <cstdint>
#include <span>

namespace weave::ops {

struct bf16 {
  std::uint16_t bits = 0;

  bf16() = default;
  // Rounds to nearest, ties to even.
  explicit bf16(float value) : bits(round_bits(value)) {}
  explicit operator float() const {
    return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
  }

  static constexpr bf16 from_bits(std::uint16_t b) {
    bf16 v;
    v.bits = b;
    return v;
  }
  friend bool operator==(bf16, bf16) = default;  // bitwise (so NaN == the same NaN)

  static constexpr std::uint16_t round_bits(float value) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(value);
    if ((u & 0x7fffffffu) > 0x7f800000u)  // NaN: keep it one, quiet
      return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
    // Adding 0x7fff plus the lowest kept bit rounds half-way cases to the even neighbour; a
    // carry out of the mantissa moves to the next binade (or to infinity) as it should.
    const std::uint32_t lsb = (u >> 16) & 1u;
    return static_cast<std::uint16_t>((u + 0x7fffu + lsb) >> 16);
  }
};

inline float to_float(bf16 v) {
  return static_cast<float>(v);
}

// Element-wise conversions of equal-length spans (std::invalid_argument otherwise).
void to_bf16(std::span<const float> from, std::span<bf16> to);
void to_float(std::span<const bf16> from, std::span<float> to);

}  // namespace weave::ops
