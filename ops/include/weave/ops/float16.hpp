// fp16: IEEE 754 half precision (1 sign, 5 exponent, 10 mantissa bits), the storage type of fp16
// mixed-precision training. 11 significant bits (a value rounded to fp16 has a relative error of
// at most u = 2^-11) but a narrow range: the largest finite value is 65504, the smallest normal
// 2^-14 and the smallest subnormal 2^-24, which is why fp16 training scales its loss.
//
// Conversions:
//   fp32 -> fp16 rounds to nearest, ties to even, as IEEE says and as the F16C instruction
//   vcvtps2ph does with round-to-nearest: magnitudes from 65520 (half-way between 65504 and the
//   next binade, which rounds to even: up) become infinities; below 2^-14 the result is a
//   subnormal multiple of 2^-24, rounded the same way (2^-25 is a tie: to zero). A NaN stays a
//   NaN, made quiet, its sign and upper 10 payload bits kept (vcvtps2ph's rule). Spans convert
//   with F16C where the CPU has it and with the scalar rule below elsewhere: the same bits.
//   fp16 -> fp32 is exact (a NaN made quiet, as vcvtph2ps does).
#pragma once

#include <bit>
#include <cstdint>
#include <span>

namespace weave::ops {

struct fp16 {
  std::uint16_t bits = 0;

  fp16() = default;
  // Rounds to nearest, ties to even.
  explicit fp16(float value) : bits(round_bits(value)) {}
  explicit operator float() const { return widen_bits(bits); }

  static constexpr fp16 from_bits(std::uint16_t b) {
    fp16 v;
    v.bits = b;
    return v;
  }
  friend bool operator==(fp16, fp16) = default;  // bitwise (so NaN == the same NaN)

  // The scalar rule: the reference the vector conversions are checked against.
  static constexpr std::uint16_t round_bits(float value) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(value);
    const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
    const std::uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)  // NaN: quiet, upper payload kept
      return static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u)  // from 65520 up (and infinity): infinity
      return static_cast<std::uint16_t>(sign | 0x7c00u);
    if (a >= 0x38800000u) {  // a normal fp16: rebias the exponent (127 - 15), round 13 bits off
      const std::uint32_t v = a - (112u << 23);
      const std::uint32_t lsb = (v >> 13) & 1u;
      // A carry out of the mantissa moves to the next binade, as it should.
      return static_cast<std::uint16_t>(sign | ((v + 0xfffu + lsb) >> 13));
    }
    // Below 2^-14: the multiple m of 2^-24 nearest to the value mant 2^(e - 150).
    const std::uint32_t e = a >> 23;
    if (e == 0) return sign;  // an fp32 subnormal is far below 2^-25: zero
    const std::uint32_t mant = (a & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - e;  // >= 14
    if (shift > 24) return sign;           // below 2^-25: zero
    std::uint32_t m = mant >> shift;
    const std::uint32_t rest = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (m & 1u))) ++m;  // 1024 is 2^-14, the smallest normal
    return static_cast<std::uint16_t>(sign | m);
  }
  static constexpr float widen_bits(std::uint16_t h) {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f)  // infinity, or a NaN made quiet as vcvtph2ps makes it
      return std::bit_cast<float>(sign | 0x7f800000u | (m << 13) | (m != 0 ? 0x400000u : 0u));
    if (e == 0) {  // zero or m 2^-24, exact in fp32
      const float v = static_cast<float>(m) * 0x1p-24f;
      return sign ? -v : v;
    }
    return std::bit_cast<float>(sign | ((e + 112u) << 23) | (m << 13));
  }
};

inline float to_float(fp16 v) {
  return static_cast<float>(v);
}

// Element-wise conversions of equal-length spans (std::invalid_argument otherwise), with F16C
// where the CPU has it.
void to_fp16(std::span<const float> from, std::span<fp16> to);
void to_float(std::span<const fp16> from, std::span<float> to);
// Whether the span conversions run F16C's vcvtps2ph / vcvtph2ps here.
bool fp16_conversions_use_f16c();

}  // namespace weave::ops
