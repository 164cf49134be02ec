#include "weave/ops/float16.hpp"

#include <fmt/format.h>

#include <stdexcept>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define WEAVE_HAVE_F16C_PATH 1
#endif

namespace weave::ops {
namespace {

void check_lengths(const char* what, std::size_t from, std::size_t to) {
  if (from != to)
    throw std::invalid_argument(
        fmt::format("{}: the source has {} elements and the destination {}: they must be equal",
                    what, from, to));
}

#ifdef WEAVE_HAVE_F16C_PATH
// Eight values at a time; the tail by the scalar rule, which gives the same bits.
__attribute__((target("avx,f16c"))) void to_fp16_f16c(const float* from, fp16* to, std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h =
        _mm256_cvtps_ph(_mm256_loadu_ps(from + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(to + i), h);
  }
  for (; i < n; ++i)
    to[i] = fp16(from[i]);
}

__attribute__((target("avx,f16c"))) void to_float_f16c(const fp16* from, float* to, std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(to + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i))));
  for (; i < n; ++i)
    to[i] = static_cast<float>(from[i]);
}
#endif

#ifdef WEAVE_HAVE_F16C_PATH
// CPUID leaf 1: F16C and AVX, and the OS saving the YMM registers (XGETBV), read directly:
// clang's __builtin_cpu_supports has no "f16c".
bool cpu_has_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28), f16c = c & (1u << 29);
  if (!osxsave || !avx || !f16c) return false;
  unsigned lo = 0, hi = 0;
  __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & 0x6u) == 0x6u;  // XMM and YMM state enabled
}
#endif

}  // namespace

bool fp16_conversions_use_f16c() {
#ifdef WEAVE_HAVE_F16C_PATH
  static const bool has = cpu_has_f16c();
  return has;
#else
  return false;
#endif
}

void to_fp16(std::span<const float> from, std::span<fp16> to) {
  check_lengths("to_fp16", from.size(), to.size());
#ifdef WEAVE_HAVE_F16C_PATH
  if (fp16_conversions_use_f16c()) {
    to_fp16_f16c(from.data(), to.data(), from.size());
    return;
  }
#endif
  for (std::size_t i = 0; i < from.size(); ++i)
    to[i] = fp16(from[i]);
}

void to_float(std::span<const fp16> from, std::span<float> to) {
  check_lengths("to_float", from.size(), to.size());
#ifdef WEAVE_HAVE_F16C_PATH
  if (fp16_conversions_use_f16c()) {
    to_float_f16c(from.data(), to.data(), from.size());
    return;
  }
#endif
  for (std::size_t i = 0; i < from.size(); ++i)
    to[i] = static_cast<float>(from[i]);
}

}  // namespace weave::ops
