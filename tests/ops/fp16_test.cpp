// fp16 storage and fp16 matrix products.
//
// The conversion is checked against a reference written independently of the one in
// float16.hpp: every finite fp16 value decoded with ldexp into a sorted table, and a float
// rounded by searching that table for its nearest neighbours (ties to the even bit pattern,
// 65520 and up to infinity). The vector (F16C) conversions are checked bit for bit against the
// scalar rule on the same inputs. The products are checked on integer data, where every fp32
// summation order is exact, so oneDNN's kernel and the fp32 fallback must give the same bits.
// The fp16 attention kernels keep their bits wherever the heap puts their scratch.
#include <gtest/gtest.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "weave/ops/attention.hpp"
#include "weave/ops/float16.hpp"
#include "weave/ops/gemm.hpp"
#include "weave/ops/gemm_bf16.hpp"

namespace weave::ops {
namespace {

// The value of fp16 bit pattern h, decoded from the IEEE layout with ldexp (finite h only).
double decode(std::uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) ? -v : v;
}

// Every finite non-negative fp16 pattern (0x0000 .. 0x7bff) in increasing order of value.
const std::vector<double>& positive_values() {
  static const std::vector<double> table = [] {
    std::vector<double> t;
    for (std::uint32_t h = 0; h < 0x7c00; ++h)
      t.push_back(decode(static_cast<std::uint16_t>(h)));
    return t;
  }();
  return table;
}

// Round-to-nearest-even to fp16 by search, for a finite or infinite (not NaN) float.
std::uint16_t reference_round(float f) {
  const std::uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7c00;  // half-way above 65504 and beyond: infinity
  const std::vector<double>& t = positive_values();
  const auto hi = std::lower_bound(t.begin(), t.end(), a);
  if (hi == t.end()) return sign | 0x7bff;  // between 65504 and 65520: down to 65504
  if (*hi == a) return static_cast<std::uint16_t>(sign | (hi - t.begin()));
  const auto lo = hi - 1;
  const double below = a - *lo, above = *hi - a;
  std::uint32_t pick = static_cast<std::uint32_t>(below < above ? lo - t.begin() : hi - t.begin());
  if (below == above) {  // a tie: the even pattern
    pick = static_cast<std::uint32_t>(lo - t.begin());
    if (pick & 1u) ++pick;
  }
  return static_cast<std::uint16_t>(sign | pick);
}

float from_bits(std::uint32_t u) {
  return std::bit_cast<float>(u);
}

// The inputs the conversions are checked on: every tie between neighbouring fp16 values, one
// fp32 ulp either side of it, and a sweep over all fp32 bit patterns (NaNs, infinities and fp32
// subnormals included).
std::vector<float> conversion_inputs() {
  std::vector<float> in;
  const std::vector<double>& t = positive_values();
  for (std::size_t i = 0; i + 1 < t.size(); ++i) {
    const float mid = static_cast<float>((t[i] + t[i + 1]) / 2);  // exact: 12 bits
    for (const float f : {mid, std::nextafter(mid, 0.f), std::nextafter(mid, 1e9f)}) {
      in.push_back(f);
      in.push_back(-f);
    }
  }
  for (std::uint64_t u = 0; u <= 0xffffffffu; u += 4099)
    in.push_back(from_bits(static_cast<std::uint32_t>(u)));
  return in;
}

TEST(Fp16Conversion, ExactCases) {
  EXPECT_EQ(fp16(1.0f).bits, 0x3c00);
  EXPECT_EQ(fp16(1.0f + 0x1p-11f).bits, 0x3c00);      // tie, even neighbour 1
  EXPECT_EQ(fp16(1.0f + 3 * 0x1p-11f).bits, 0x3c02);  // tie, up to the even neighbour
  EXPECT_EQ(fp16(2.0f - 0x1p-12f).bits, 0x4000);      // carry into the next binade
  EXPECT_EQ(fp16(65504.0f).bits, 0x7bff);             // largest finite
  EXPECT_EQ(fp16(std::nextafter(65520.0f, 0.f)).bits, 0x7bff);
  EXPECT_EQ(fp16(65520.0f).bits, 0x7c00);  // the tie above 65504 rounds to even: infinity
  EXPECT_EQ(fp16(-1e6f).bits, 0xfc00);
  EXPECT_EQ(fp16(std::numeric_limits<float>::infinity()).bits, 0x7c00);
  EXPECT_EQ(fp16(0x1p-14f).bits, 0x0400);             // smallest normal
  EXPECT_EQ(fp16(0x1p-14f - 0x1p-25f).bits, 0x0400);  // tie between 1023 and 1024 x 2^-24
  EXPECT_EQ(fp16(0x1p-24f).bits, 0x0001);             // smallest subnormal
  EXPECT_EQ(fp16(0x1p-25f).bits, 0x0000);             // tie with zero: zero
  EXPECT_EQ(fp16(0x1p-25f * (1 + 0x1p-23f)).bits, 0x0001);
  EXPECT_EQ(fp16(1.5f * 0x1p-24f).bits, 0x0002);  // tie between 1 and 2: 2
  EXPECT_EQ(fp16(2.5f * 0x1p-24f).bits, 0x0002);  // tie between 2 and 3: 2
  EXPECT_EQ(fp16(-0x1p-26f).bits, 0x8000);
  EXPECT_EQ(fp16(std::numeric_limits<float>::denorm_min()).bits, 0x0000);
  // NaN: quiet, sign and upper payload kept.
  EXPECT_EQ(fp16(from_bits(0x7fc00000u)).bits, 0x7e00);
  EXPECT_EQ(fp16(from_bits(0xff802000u)).bits, 0xfe01);  // signalling, payload bit 13
}

TEST(Fp16Conversion, WideningIsExactForEveryPattern) {
  std::vector<fp16> all(65536);
  for (std::uint32_t h = 0; h < 65536; ++h)
    all[h] = fp16::from_bits(static_cast<std::uint16_t>(h));
  std::vector<float> wide(all.size());
  to_float(all, wide);  // the vector path where the CPU has F16C
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const auto b = static_cast<std::uint16_t>(h);
    const float scalar = static_cast<float>(all[h]);
    ASSERT_EQ(std::bit_cast<std::uint32_t>(wide[h]), std::bit_cast<std::uint32_t>(scalar)) << h;
    if ((b & 0x7c00) == 0x7c00) {
      EXPECT_TRUE((b & 0x3ff) ? std::isnan(scalar) : std::isinf(scalar)) << h;
      continue;
    }
    ASSERT_EQ(static_cast<double>(scalar), decode(b)) << h;
    ASSERT_EQ(fp16(scalar).bits, b) << h;  // round trip
  }
}

TEST(Fp16Conversion, RoundingMatchesTheReferenceAndTheVectorPath) {
  const std::vector<float> in = conversion_inputs();
  std::vector<fp16> vec(in.size());
  to_fp16(in, vec);
  std::size_t checked = 0;
  for (std::size_t i = 0; i < in.size(); ++i) {
    const std::uint16_t scalar = fp16(in[i]).bits;
    ASSERT_EQ(vec[i].bits, scalar) << std::hexfloat << in[i];
    if (std::isnan(in[i])) {
      ASSERT_EQ(scalar & 0x7e00, 0x7e00);
      continue;
    }
    ASSERT_EQ(scalar, reference_round(in[i])) << std::hexfloat << in[i];
    ++checked;
  }
  EXPECT_GT(checked, 1000000u);
  RecordProperty("f16c", fp16_conversions_use_f16c() ? "yes" : "no");
}

TEST(Fp16Conversion, SpansCheckTheirLengths) {
  std::vector<float> f(3);
  std::vector<fp16> h(2);
  EXPECT_THROW(to_fp16(f, h), std::invalid_argument);
  EXPECT_THROW(to_float(h, f), std::invalid_argument);
}

// Integer matrices with small entries: products and every partial sum are exact in fp32 and in
// fp16 inputs, so the fp16 product must equal the fp32 product of the same values bitwise,
// whichever kernel runs (fp16_kernel()).
TEST(Fp16Gemm, ProductsOfFp16ValuesSummedInFp32) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> small(-8, 8);
  const std::int64_t m = 37, n = 29, k = 70;
  std::vector<fp16> a(static_cast<std::size_t>(k * m)), b(static_cast<std::size_t>(k * n));
  std::vector<float> af(a.size()), bf(b.size());
  for (std::size_t i = 0; i < a.size(); ++i)
    a[i] = fp16(af[i] = static_cast<float>(small(rng)));
  for (std::size_t i = 0; i < b.size(); ++i)
    b[i] = fp16(bf[i] = static_cast<float>(small(rng)));
  std::vector<float> want(static_cast<std::size_t>(m * n)), got(want.size(), 123.f);
  // op(A) = A^T with A [k, m]; B [k, n].
  gemm<float>(Transpose::yes, Transpose::no, 1.f, {af.data(), k, m, m}, {bf.data(), k, n, n}, 0.f,
              {want.data(), m, n, n});
  gemm_fp16(Transpose::yes, Transpose::no, 1.f, {a.data(), k, m, m}, {b.data(), k, n, n}, 0.f,
            {got.data(), m, n, n});
  EXPECT_EQ(got, want);
  // Into fp16: the fp32 result rounded once; alpha 1024 takes some entries past 65504.
  std::vector<fp16> c(want.size());
  gemm_fp16(Transpose::yes, Transpose::no, 1024.f, {a.data(), k, m, m}, {b.data(), k, n, n}, 0.f,
            MatrixView<fp16>{c.data(), m, n, n});
  int infinities = 0;
  for (std::size_t i = 0; i < c.size(); ++i) {
    ASSERT_EQ(c[i].bits, fp16(1024.f * want[i]).bits) << i;
    infinities += std::isinf(static_cast<float>(c[i]));
  }
  EXPECT_GT(infinities, 0);
  RecordProperty("fp16_kernel", to_string(fp16_kernel()));
}

// The 16-bit attention kernels give the same bits wherever the heap puts their scratch. Eigen's
// vectorised exp and sum over a row of scores start at its first packet-aligned element and
// take the elements before it one at a time, with other bits, so scores in a buffer at an
// address the heap chose (std::vector's 16 bytes of alignment) made a training step's gradients
// differ between runs with what other tasks had allocated. Here the kernels run on this thread
// alone, each time after holding one more block the size of a head's scores, so that the heap
// hands their scratch other addresses (glibc's malloc: other 16-byte offsets from a cache line),
// and every output must keep its bits.
TEST(Fp16Attention, BitsDoNotDependOnTheScratchAddress) {
  std::mt19937 gen(5);
  std::normal_distribution<float> dist(0.f, 1.f);
  const std::int64_t b = 1, s = 40, g = 1, n = 2, d = 16;  // one chunk of 40 x 40 scores a head
  auto random = [&](const Shape& shape) {
    Fp16Tensor t = Fp16Tensor::empty(shape);
    for (std::int64_t i = 0; i < t.numel(); ++i)
      t.data()[i] = fp16(dist(gen));
    return t;
  };
  const Fp16Tensor q = random({b, s, g, n * d}), k = random({b, s, g, d}), v = random({b, s, g, d}),
                   d_o = random({b, s, g, n * d});
  struct Outputs {
    std::vector<fp16> o, dq;
    std::vector<float> lse, dk, dv;
  };
  auto bits = [](const std::vector<fp16>& x) {
    std::vector<std::uint16_t> out;
    for (const fp16 h : x)
      out.push_back(h.bits);
    return out;
  };
  std::vector<std::vector<float>> held;
  std::vector<Outputs> runs;
  tbb::task_arena one_thread(1);
  for (int run = 0; run < 8; ++run) {
    held.emplace_back(static_cast<std::size_t>(s * s));
    const Fp16Tensor o = Fp16Tensor::empty(q.shape()), dq = Fp16Tensor::empty(q.shape());
    const Tensor lse = Tensor::empty({b, g * n, s}), dk = Tensor::zeros(k.shape()),
                 dv = Tensor::zeros(v.shape());
    one_thread.execute([&] {
      attention_forward({}, q, k, v, o, lse);
      attention_backward({}, q, k, v, o, lse, d_o, dq, dk, dv);
    });
    runs.push_back(
        {o.to_vector(), dq.to_vector(), lse.to_vector(), dk.to_vector(), dv.to_vector()});
  }
  for (std::size_t r = 1; r < runs.size(); ++r) {
    SCOPED_TRACE(r);
    EXPECT_EQ(runs[r].lse, runs[0].lse);
    EXPECT_EQ(bits(runs[r].o), bits(runs[0].o));
    EXPECT_EQ(bits(runs[r].dq), bits(runs[0].dq));
    EXPECT_EQ(runs[r].dk, runs[0].dk);
    EXPECT_EQ(runs[r].dv, runs[0].dv);
  }
}

}  // namespace
}  // namespace weave::ops
