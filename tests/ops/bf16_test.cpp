// bf16 storage: the conversion on exact cases (ties, overflow, NaN, infinities, subnormals) and
// against oneDNN's own reorder.
#include <gtest/gtest.h>
#include <tbb/task_arena.h>

#include <bit>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <oneapi/dnnl/dnnl.hpp>
#include <random>
#include <string>
#include <vector>

#include "weave/ops/bfloat16.hpp"

namespace weave::ops {
namespace {

std::uint16_t bits_of(float f) {
  return bf16(f).bits;
}
float from_bits(std::uint32_t u) {
  return std::bit_cast<float>(u);
}

TEST(Bf16Conversion, RoundsToNearestWithTiesToEven) {
  EXPECT_EQ(bits_of(1.0f), 0x3f80);
  // 1 + 2^-8 is half-way between 1 and 1 + 2^-7: to the even one, 1.
  EXPECT_EQ(bits_of(1.0f + 0x1p-8f), 0x3f80);
  // 1 + 3 2^-8 is half-way between 1 + 2^-7 (odd) and 1 + 2^-6 (even): up.
  EXPECT_EQ(bits_of(1.0f + 3 * 0x1p-8f), 0x3f82);
  // Just above and below half-way.
  EXPECT_EQ(bits_of(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);
  EXPECT_EQ(bits_of(1.0f + 0x1p-8f - 0x1p-20f), 0x3f80);
  EXPECT_EQ(bits_of(-(1.0f + 3 * 0x1p-8f)), 0xbf82);
  // A carry out of the mantissa moves to the next binade: 2 - 2^-9 rounds to 2.
  EXPECT_EQ(bits_of(2.0f - 0x1p-9f), 0x4000);
  EXPECT_EQ(bits_of(0.0f), 0x0000);
  EXPECT_EQ(bits_of(-0.0f), 0x8000);
}

TEST(Bf16Conversion, OverflowInfinityAndNaN) {
  // The largest float is above bf16's largest finite value's rounding boundary: infinity.
  EXPECT_EQ(bits_of(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(bits_of(from_bits(0x7f7f7fffu)), 0x7f7f);  // just below the boundary
  EXPECT_EQ(bits_of(from_bits(0x7f7f8000u)), 0x7f80);  // the tie, odd neighbour: up, to inf
  EXPECT_EQ(bits_of(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(bits_of(-std::numeric_limits<float>::infinity()), 0xff80);
  // NaNs stay NaNs (quiet), even those whose payload lies only in the dropped bits, which plain
  // rounding would turn into infinity.
  EXPECT_EQ(bits_of(std::numeric_limits<float>::quiet_NaN()), 0x7fc0);
  EXPECT_EQ(bits_of(from_bits(0x7f800001u)), 0x7fc0);
  EXPECT_EQ(bits_of(from_bits(0xffffffffu)), 0xffff);
  EXPECT_TRUE(std::isnan(static_cast<float>(bf16(from_bits(0x7f800001u)))));
}

TEST(Bf16Conversion, SubnormalsRoundLikeOtherValues) {
  EXPECT_EQ(bits_of(from_bits(0x00000001u)), 0x0000);  // far below half of bf16's smallest
  EXPECT_EQ(bits_of(from_bits(0x00008000u)), 0x0000);  // tie, to the even 0
  EXPECT_EQ(bits_of(from_bits(0x00018000u)), 0x0002);  // tie, odd 1 -> even 2
  EXPECT_EQ(bits_of(from_bits(0x00010000u)), 0x0001);  // bf16's smallest subnormal, exact
  EXPECT_EQ(bits_of(from_bits(0x007fffffu)), 0x0080);  // up into the smallest normal
  EXPECT_EQ(bits_of(from_bits(0x80008001u)), 0x8001);  // negative, above the tie
}

TEST(Bf16Conversion, WideningIsExactAndRoundTrips) {
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const bf16 v = bf16::from_bits(static_cast<std::uint16_t>(b));
    const float f = static_cast<float>(v);
    ASSERT_EQ(std::bit_cast<std::uint32_t>(f), b << 16);
    if (!std::isnan(f)) {
      ASSERT_EQ(bf16(f).bits, b);
    }
  }
}

TEST(Bf16Conversion, SpansCheckTheirLengths) {
  std::vector<float> f{1.5f, -2.25f};
  std::vector<bf16> h(2);
  to_bf16(f, h);
  std::vector<float> back(2);
  to_float(h, back);
  EXPECT_EQ(back, f);
  std::vector<bf16> short_h(1);
  EXPECT_THROW(to_bf16(f, short_h), std::invalid_argument);
}

// oneDNN's reorder (fp32 -> bf16, what its kernels do to fp32 data) agrees with ours on the
// normal, tie, overflow and infinite cases. Subnormals: the reorder may flush them to zero (the
// AVX512_BF16 instruction vcvtneps2bf16 does) or round them as we do: either result is allowed.
TEST(Bf16Conversion, AgreesWithOneDnnReorder) {
  const std::vector<std::uint32_t> normal = {
      0x3f800000u, 0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f807fffu, 0xbf818000u,
      0x3fffff80u, 0x7f7f7fffu, 0x7f7f8000u, 0x7f7fffffu, 0x7f800000u, 0xff800000u,
      0x00800000u, 0x00808000u, 0x12345678u, 0xc0490fdbu, 0x00000000u, 0x80000000u};
  const std::vector<std::uint32_t> subnormal = {0x00018000u, 0x00010000u, 0x007fffffu, 0x80008001u};
  std::vector<std::uint32_t> all = normal;
  all.insert(all.end(), subnormal.begin(), subnormal.end());
  const auto n = static_cast<dnnl::memory::dim>(all.size());
  std::vector<float> src(all.size());
  for (std::size_t i = 0; i < all.size(); ++i)
    src[i] = from_bits(all[i]);
  std::vector<std::uint16_t> dst(all.size());
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  dnnl::memory s({{n}, dnnl::memory::data_type::f32, {1}}, engine, src.data());
  dnnl::memory d({{n}, dnnl::memory::data_type::bf16, {1}}, engine, dst.data());
  dnnl::reorder(s, d).execute(stream, s, d);
  stream.wait();
  for (std::size_t i = 0; i < normal.size(); ++i)
    EXPECT_EQ(dst[i], bits_of(src[i])) << std::hex << "fp32 bits 0x" << all[i];
  for (std::size_t i = normal.size(); i < all.size(); ++i) {
    const std::uint16_t flushed = all[i] >> 31 ? 0x8000 : 0x0000;
    EXPECT_TRUE(dst[i] == bits_of(src[i]) || dst[i] == flushed)
        << std::hex << "fp32 bits 0x" << all[i] << " gave 0x" << dst[i];
  }
}

}  // namespace
}  // namespace weave::ops
