// bf16 storage and bf16 matrix products.
//
// The conversion is checked on exact cases (ties, overflow, NaN, infinities, subnormals) and
// against oneDNN's own reorder. The products are checked against a double-precision product of
// the unrounded fp32 inputs, within a bound derived below, and on integer data where any fp32
// summation order is exact but a bf16 accumulator is not.
//
// The same program runs a second time with DNNL_MAX_CPU_ISA=AVX512_CORE (tests/ops/CMakeLists.txt)
// so the fp32 fallback of a CPU without AVX512_BF16 passes the same checks.
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

#include "weave/ops/attention.hpp"
#include "weave/ops/bfloat16.hpp"
#include "weave/ops/gemm_bf16.hpp"
#include "weave/ops/linear.hpp"

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
// Negative zero: oneDNN's reorder on a CPU without AVX-512 gives +0 (seen on AMD Zen 3), so there
// only the magnitude is compared with it; our conversion keeping the sign is checked on its own.
TEST(Bf16Conversion, AgreesWithOneDnnReorder) {
  const std::vector<std::uint32_t> normal = {
      0x3f800000u, 0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f807fffu, 0xbf818000u,
      0x3fffff80u, 0x7f7f7fffu, 0x7f7f8000u, 0x7f7fffffu, 0x7f800000u, 0xff800000u,
      0x00800000u, 0x00808000u, 0x12345678u, 0xc0490fdbu, 0x00000000u};
  const std::vector<std::uint32_t> subnormal = {0x00018000u, 0x00010000u, 0x007fffffu, 0x80008001u};
  constexpr std::uint32_t negative_zero = 0x80000000u;
  std::vector<std::uint32_t> all = normal;
  all.insert(all.end(), subnormal.begin(), subnormal.end());
  all.push_back(negative_zero);
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
  EXPECT_EQ(bits_of(from_bits(negative_zero)), 0x8000);
  EXPECT_EQ(dst.back() & 0x7fff, 0) << std::hex << "-0 gave 0x" << dst.back();
  for (std::size_t i = normal.size(); i + 1 < all.size(); ++i) {
    const std::uint16_t flushed = all[i] >> 31 ? 0x8000 : 0x0000;
    EXPECT_TRUE(dst[i] == bits_of(src[i]) || dst[i] == flushed)
        << std::hex << "fp32 bits 0x" << all[i] << " gave 0x" << dst[i];
  }
}

// ---- Products ----
//
// Tolerance. The reference is the product of the unrounded fp32 inputs a, b computed in double
// (its own error, ~k 2^-53, is negligible). The bf16 product sees a' = a(1 + d1), b' = b(1 + d2)
// with |d1|, |d2| <= u = 2^-8 (round to nearest with 8 significant bits), so each term differs
// by |a'b' - ab| <= (2u + u^2) |a||b|. The term a'b' itself is exact in fp32 (8 + 8 significant
// bits <= 24). Summing k terms in fp32, in any order (a blocked or tiled kernel's), adds at most
// gamma_k sum |a'b'| with gamma_k = k 2^-24 / (1 - k 2^-24) (Higham, Accuracy and Stability of
// Numerical Algorithms, 2nd ed., eq. 3.5). So per element of C = alpha op(A) op(B) + beta C0:
//   |C - ref| <= |alpha| [(2u + u^2) + gamma_k (1 + u)^2] S + 2^-24 |ref|,  S = sum_p |a_ip||b_pj|,
// the last term for adding beta C0 in fp32. Rounding C to bf16 adds u (|ref| + that bound). The
// input rounding dominates: 2u = 2^-7 per unit of S; k 2^-24 is 2^-14 at k = 1024. A bf16
// accumulator would add up to k u S instead (the Accumulation test below fails it).
double tolerance(std::int64_t k, double s, double ref, float alpha, bool bf16_out) {
  const double u = 0x1p-8, kk = static_cast<double>(k) * 0x1p-24;
  const double gamma = kk / (1 - kk);
  double bound =
      std::abs(alpha) * ((2 * u + u * u) + gamma * (1 + u) * (1 + u)) * s + 0x1p-24 * std::abs(ref);
  if (bf16_out) bound += u * (std::abs(ref) + bound);
  return bound;
}

struct Stored {
  std::vector<float> f;  // fp32 values as generated
  std::vector<bf16> h;   // the same rounded to bf16
  std::int64_t rows, cols, stride;
  float at(std::int64_t r, std::int64_t c) const {
    return f[static_cast<std::size_t>(r * stride + c)];
  }
  MatrixView<const bf16> view() const { return {h.data(), rows, cols, stride}; }
};

// A rows x cols matrix in a buffer with `pad` extra columns per row (a strided view).
Stored random_matrix(std::int64_t rows, std::int64_t cols, std::int64_t pad, std::mt19937& gen) {
  std::normal_distribution<float> dist(0.f, 1.f);
  Stored m{{}, {}, rows, cols, cols + pad};
  m.f.resize(static_cast<std::size_t>(rows * m.stride));
  for (float& x : m.f)
    x = dist(gen);
  m.h.resize(m.f.size());
  to_bf16(m.f, m.h);
  return m;
}

struct Case {
  std::int64_t m, n, k;
  bool ta, tb;
  float alpha, beta;
};

template <typename Out>
void check_product(const Case& c, std::int64_t pad, unsigned seed) {
  std::mt19937 gen(seed);
  // op(A) [m, k] is A [m, k] or A^T with A [k, m]; likewise op(B) [k, n].
  const Stored a = c.ta ? random_matrix(c.k, c.m, pad, gen) : random_matrix(c.m, c.k, pad, gen);
  const Stored b = c.tb ? random_matrix(c.n, c.k, pad, gen) : random_matrix(c.k, c.n, pad, gen);
  const Stored c0 = random_matrix(c.m, c.n, pad, gen);
  std::vector<Out> out(c0.f.size());
  for (std::size_t i = 0; i < out.size(); ++i)
    out[i] = Out(c0.f[i]);
  // C0 as the kernel sees it (rounded when C is bf16).
  auto c0_at = [&](std::int64_t i, std::int64_t j) {
    return static_cast<double>(
        static_cast<float>(out[static_cast<std::size_t>(i * c0.stride + j)]));
  };
  std::vector<double> c0_seen(static_cast<std::size_t>(c.m * c.n));
  for (std::int64_t i = 0; i < c.m; ++i)
    for (std::int64_t j = 0; j < c.n; ++j)
      c0_seen[static_cast<std::size_t>(i * c.n + j)] = c0_at(i, j);
  tbb::task_arena(2).execute([&] {
    gemm_bf16(c.ta ? Transpose::yes : Transpose::no, c.tb ? Transpose::yes : Transpose::no, c.alpha,
              a.view(), b.view(), c.beta, MatrixView<Out>{out.data(), c.m, c.n, c0.stride});
  });
  auto op_a = [&](std::int64_t i, std::int64_t p) { return c.ta ? a.at(p, i) : a.at(i, p); };
  auto op_b = [&](std::int64_t p, std::int64_t j) { return c.tb ? b.at(j, p) : b.at(p, j); };
  double worst = 0;
  for (std::int64_t i = 0; i < c.m; ++i)
    for (std::int64_t j = 0; j < c.n; ++j) {
      double dot = 0, s = 0;
      for (std::int64_t p = 0; p < c.k; ++p) {
        dot += static_cast<double>(op_a(i, p)) * op_b(p, j);
        s += std::abs(static_cast<double>(op_a(i, p)) * op_b(p, j));
      }
      const double ref = c.alpha * dot + c.beta * c0_seen[static_cast<std::size_t>(i * c.n + j)];
      const double got = static_cast<float>(out[static_cast<std::size_t>(i * c0.stride + j)]);
      const double tol = tolerance(c.k, s, ref, c.alpha, std::is_same_v<Out, bf16>);
      ASSERT_LE(std::abs(got - ref), tol)
          << "C(" << i << ", " << j << ") of m=" << c.m << " n=" << c.n << " k=" << c.k
          << " ta=" << c.ta << " tb=" << c.tb;
      worst = std::max(worst, std::abs(got - ref) / tol);
    }
  // The bound is not vacuous: the inputs' rounding shows (a product of the unrounded fp32 inputs
  // would be far tighter), yet stays inside it.
  EXPECT_GT(worst, 0.01);
}

// The layouts of a linear layer: forward y = x w^T (no, yes), input gradient dx = dy w (no, no),
// weight gradient dw += dy^T x (yes, no); and (yes, yes) for completeness. Sizes include odd
// ones, views with padded rows, and products large enough to be split over two threads.
TEST(GemmBf16, MatchesFp32ReferenceWithinDerivedBound) {
  const std::vector<Case> cases = {
      {7, 5, 3, false, true, 1.f, 0.f},          {64, 96, 128, false, true, 1.f, 0.f},
      {200, 136, 96, false, false, 1.f, 0.f},    {96, 80, 300, true, false, 1.f, 1.f},
      {33, 47, 65, true, true, 0.5f, -2.f},      {256, 192, 160, false, true, 1.f, 1.f},
      {160, 256, 200, false, false, -1.5f, 0.f}, {128, 320, 256, true, false, 1.f, 1.f},
  };
  unsigned seed = 1;
  for (const Case& c : cases) {
    check_product<float>(c, 0, seed++);
    check_product<float>(c, 3, seed++);
    check_product<bf16>(c, 0, seed++);
  }
}

// Small integers are exact in bf16, their products and every partial sum below 2^24 exact in
// fp32: whatever the order, an fp32 accumulator gives exactly the integer result. A bf16
// accumulator cannot: 8 significant bits hold the integers only up to 256.
TEST(GemmBf16, AccumulatesInFp32) {
  const std::int64_t m = 48, n = 40, k = 1024;
  std::mt19937 gen(7);
  std::uniform_int_distribution<int> small(-3, 3);
  std::vector<bf16> a(static_cast<std::size_t>(m * k)), b(static_cast<std::size_t>(k * n));
  for (auto& x : a)
    x = bf16(static_cast<float>(small(gen)));
  for (auto& x : b)
    x = bf16(static_cast<float>(small(gen)));
  std::vector<float> c(static_cast<std::size_t>(m * n));
  gemm_bf16(Transpose::no, Transpose::no, 1.f, {a.data(), m, k, k}, {b.data(), k, n, n}, 0.f,
            MatrixView<float>{c.data(), m, n, n});
  std::vector<bf16> ch(c.size());
  gemm_bf16(Transpose::no, Transpose::no, 1.f, {a.data(), m, k, k}, {b.data(), k, n, n}, 0.f,
            MatrixView<bf16>{ch.data(), m, n, n});
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      std::int64_t exact = 0;
      for (std::int64_t p = 0; p < k; ++p)
        exact += static_cast<std::int64_t>(static_cast<float>(a[i * k + p])) *
                 static_cast<std::int64_t>(static_cast<float>(b[p * n + j]));
      ASSERT_EQ(c[i * n + j], static_cast<float>(exact)) << i << ", " << j;
      // A bf16 C is the exact sum rounded once.
      ASSERT_EQ(ch[i * n + j], bf16(static_cast<float>(exact))) << i << ", " << j;
    }
  // k ones sum to k exactly; a bf16 accumulator stalls at 256 (256 + 1 rounds back to 256).
  std::vector<bf16> ones(static_cast<std::size_t>(k), bf16(1.f));
  float sum = 0;
  gemm_bf16(Transpose::no, Transpose::no, 1.f, {ones.data(), 1, k, k}, {ones.data(), k, 1, 1}, 0.f,
            MatrixView<float>{&sum, 1, 1, 1});
  EXPECT_EQ(sum, static_cast<float>(k));
}

TEST(GemmBf16, BetaZeroIgnoresNaNsAndEmptyKScales) {
  std::vector<bf16> a(6, bf16(1.f)), b(6, bf16(2.f));
  std::vector<float> c(4, std::numeric_limits<float>::quiet_NaN());
  gemm_bf16(Transpose::no, Transpose::no, 1.f, {a.data(), 2, 3, 3}, {b.data(), 3, 2, 2}, 0.f,
            MatrixView<float>{c.data(), 2, 2, 2});
  EXPECT_EQ(c, std::vector<float>(4, 6.f));
  gemm_bf16(Transpose::no, Transpose::no, 1.f, {a.data(), 2, 0, 3}, {b.data(), 0, 2, 2}, 0.5f,
            MatrixView<float>{c.data(), 2, 2, 2});
  EXPECT_EQ(c, std::vector<float>(4, 3.f));
}

TEST(GemmBf16, RejectsMismatchedShapesByName) {
  std::vector<bf16> a(6), b(6);
  std::vector<float> c(4);
  try {
    gemm_bf16(Transpose::no, Transpose::no, 1.f, {a.data(), 2, 3, 3}, {b.data(), 2, 3, 3}, 0.f,
              MatrixView<float>{c.data(), 2, 2, 2});
    FAIL() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("op(B) [k, n]"), std::string::npos) << e.what();
  }
}

std::size_t thread_count() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/task"))
    ++n;
  return n;
}

// oneDNN runs on the threads of the caller's arena, starting no OpenMP team of its own: after
// products on both threads of a two-thread arena the process has the threads an fp32 product
// there leaves, TBB's only. (ctest runs each test in a process of its own.)
TEST(GemmBf16, StartsNoThreadsOfItsOwn) {
  tbb::task_arena arena(2);
  std::mt19937 gen(3);
  const std::int64_t n = 256;
  const Stored a = random_matrix(n, n, 0, gen), b = random_matrix(n, n, 0, gen);
  std::vector<float> c(static_cast<std::size_t>(n * n));
  arena.execute([&] {
    gemm<float>(Transpose::no, Transpose::yes, 1.f, {a.f.data(), n, n, n}, {b.f.data(), n, n, n},
                0.f, {c.data(), n, n, n});
  });
  const std::size_t with_tbb = thread_count();
  for (int i = 0; i < 3; ++i)
    arena.execute([&] {
      gemm_bf16(Transpose::no, Transpose::yes, 1.f, a.view(), b.view(), 0.f,
                MatrixView<float>{c.data(), n, n, n});
    });
  EXPECT_EQ(thread_count(), with_tbb);
}

TEST(GemmBf16, KernelFollowsTheCpu) {
  const char* limit = std::getenv("DNNL_MAX_CPU_ISA");
  if (limit && std::string(limit) == "AVX512_CORE") {
    EXPECT_EQ(bf16_kernel(), Bf16Kernel::fp32_fallback);
  }
  std::printf("bf16 kernels: %s\n", to_string(bf16_kernel()).c_str());
}

// ---- Linear layers in bf16 ----
//
// The reference is the double linear layer on the same bf16 values widened (exactly), so input
// rounding is out of the comparison and the bound is the fp32 summation's alone:
// |sum - ref| <= gamma_k S (S = the sum of |terms|, k terms; gamma_k as above), plus u (|ref| +
// gamma_k S) where the result is rounded to bf16, plus 2^-24 |ref| where it is added into an
// fp32 gradient. The bias's k is the number of rows of dy (its sum runs in fp32 too).
BasicTensor<double> widened(const Bf16Tensor& t) {
  BasicTensor<double> out = BasicTensor<double>::empty(t.shape());
  const std::vector<bf16> v = t.to_vector();
  for (std::size_t i = 0; i < v.size(); ++i)
    out.data()[i] = static_cast<float>(v[i]);
  return out;
}

Bf16Tensor random_bf16(const Shape& shape, std::mt19937& gen) {
  std::normal_distribution<float> dist(0.f, 1.f);
  Bf16Tensor t = Bf16Tensor::empty(shape);
  for (std::int64_t i = 0; i < t.numel(); ++i)
    t.data()[i] = bf16(dist(gen));
  return t;
}

// Per element, S of the double product computed on absolute values.
template <typename Got>
void expect_within_sum_bound(const BasicTensor<Got>& got, const BasicTensor<double>& ref,
                             const BasicTensor<double>& abs_sum, std::int64_t k, bool rounded,
                             bool accumulated, const char* what) {
  const double u = 0x1p-8, kk = static_cast<double>(k) * 0x1p-24, gamma = kk / (1 - kk);
  const auto g = got.to_vector();
  const auto r = ref.to_vector();
  const auto s = abs_sum.to_vector();
  for (std::size_t i = 0; i < g.size(); ++i) {
    double tol = gamma * s[i] + (accumulated ? 0x1p-24 * std::abs(r[i]) : 0.0);
    if (rounded) tol += u * (std::abs(r[i]) + tol);
    ASSERT_LE(std::abs(static_cast<double>(static_cast<float>(g[i])) - r[i]), tol)
        << what << " element " << i;
  }
}

BasicTensor<double> abs_of(const BasicTensor<double>& t) {
  BasicTensor<double> out = t.clone();
  for (std::int64_t i = 0; i < out.numel(); ++i)
    out.data()[i] = std::abs(out.data()[i]);
  return out;
}

TEST(LinearBf16, MatchesDoubleLayerOnTheSameValues) {
  std::mt19937 gen(11);
  const std::int64_t batch = 2, seq = 96, in = 160, out = 192;
  const Bf16Tensor x = random_bf16({batch, seq, in}, gen), w = random_bf16({out, in}, gen),
                   b = random_bf16({out}, gen), dy = random_bf16({batch, seq, out}, gen);
  const Bf16Tensor y = Bf16Tensor::empty({batch, seq, out}), dx = Bf16Tensor::empty(x.shape());
  const Tensor dw = Tensor::zeros(w.shape()), db = Tensor::zeros(b.shape());
  tbb::task_arena(2).execute([&] {
    linear_forward(x, w, b, y);
    linear_backward_input(dy, w, dx);
    linear_backward_weight(x, dy, dw, db);
  });
  using D = BasicTensor<double>;
  const D xd = widened(x), wd = widened(w), bd = widened(b), dyd = widened(dy);
  const D yd = D::empty(y.shape()), dxd = D::empty(x.shape()), dwd = D::zeros(w.shape()),
          dbd = D::zeros(b.shape());
  linear_forward(xd, wd, bd, yd);
  linear_backward_input(dyd, wd, dxd);
  linear_backward_weight(xd, dyd, dwd, dbd);
  // The same on absolute values: S per element.
  const D ys = D::empty(y.shape()), dxs = D::empty(x.shape()), dws = D::zeros(w.shape()),
          dbs = D::zeros(b.shape());
  linear_forward(abs_of(xd), abs_of(wd), abs_of(bd), ys);
  linear_backward_input(abs_of(dyd), abs_of(wd), dxs);
  linear_backward_weight(abs_of(xd), abs_of(dyd), dws, dbs);
  expect_within_sum_bound(y, yd, ys, in + 1, true, false, "y");
  expect_within_sum_bound(dx, dxd, dxs, out, true, false, "dx");
  expect_within_sum_bound(dw, dwd, dws, batch * seq, false, true, "dw");
  expect_within_sum_bound(db, dbd, dbs, batch * seq, false, true, "db");
}

TEST(LinearBf16, RejectsMismatchedWeightByName) {
  const Bf16Tensor x = Bf16Tensor::zeros({4, 8}), w = Bf16Tensor::zeros({6, 7}),
                   y = Bf16Tensor::empty({4, 6});
  try {
    linear_forward(x, w, Bf16Tensor{}, y);
    FAIL() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("linear input"), std::string::npos) << e.what();
  }
}

// ---- Attention in bf16 ----
//
// The reference is the fp32 kernel on the same bf16 values widened, so input rounding is out of
// the comparison; what remains is bf16's rounding of P, dS and the outputs (u = 2^-8 relative
// each), the fp32 sums (gamma_k), and fp32 noise in the scores, exp and log, which two fp32
// kernels summing in different orders share (< 2^-14 relative here: d = 32 products of normal
// values, scale 1/sqrt(32)). Per element, with Vmax, Kmax, Qmax, Omax the largest |v|, |k|,
// |q|, |o| and P the probabilities (kept ones scaled by 1/(1 - p) under dropout, factor f):
//   o:  o = sum_j P_j v_j / l with P rounded: |error| <= (2u + gamma_sk + 2^-14) Vmax
//       (u for P, u for the rounded output, both relative to sum_j P_j |v_j| / l <= Vmax);
//   dv: sum_i P_ij dO_i with P rounded: (u + gamma_sq n + 2^-14) sum_i P_ij |dO_i|, the last
//       factor the fp32 backward's dv for |dO|;
//   dq: scale sum_j dS_ij K_j, dS = P (dP - D) rounded to bf16 (u), dP and D fp32 sums of d terms
//       (gamma_d each): |dS_ij| <= P_ij R_i with R_i = ||dO_i||_1 (Vmax + Omax), so
//       |error| <= scale Kmax (2u + gamma_sk + 2 gamma_d + 2^-14) f R_i + u |dq|;
//   dk: scale sum_i dS_ij Q_i, likewise: scale Qmax (2u + gamma_sq n + 2 gamma_d + 2^-14)
//       f sum_i P_ij R_i, the last factor the fp32 backward's dv for rows of dO set to R_i.
struct AttentionData {
  Bf16Tensor q, k, v, d_o;
};

double max_abs(const Bf16Tensor& t) {
  double m = 0;
  for (const bf16 x : t.to_vector())
    m = std::max(m, std::abs(static_cast<double>(static_cast<float>(x))));
  return m;
}

Tensor widened_f(const Bf16Tensor& t) {
  Tensor out = Tensor::empty(t.shape());
  const std::vector<bf16> v = t.to_vector();
  for (std::size_t i = 0; i < v.size(); ++i)
    out.data()[i] = static_cast<float>(v[i]);
  return out;
}

void check_attention_bf16(const AttentionOptions& opt) {
  std::mt19937 gen(21);
  const std::int64_t b = 2, s = 200, g = 2, n = 2, d = 32;
  const AttentionData in{random_bf16({b, s, g, n * d}, gen), random_bf16({b, s, g, d}, gen),
                         random_bf16({b, s, g, d}, gen), random_bf16({b, s, g, n * d}, gen)};
  const Bf16Tensor o = Bf16Tensor::empty(in.q.shape()), dq = Bf16Tensor::empty(in.q.shape());
  const Tensor lse = Tensor::empty({b, g * n, s}), dk = Tensor::zeros(in.k.shape()),
               dv = Tensor::zeros(in.v.shape());
  tbb::task_arena(2).execute([&] {
    attention_forward(opt, in.q, in.k, in.v, o, lse);
    attention_backward(opt, in.q, in.k, in.v, o, lse, in.d_o, dq, dk, dv);
  });
  const Tensor qf = widened_f(in.q), kf = widened_f(in.k), vf = widened_f(in.v),
               dof = widened_f(in.d_o), of = widened_f(o);
  const Tensor o_ref = Tensor::empty(qf.shape()), lse_ref = Tensor::empty(lse.shape());
  attention_forward(opt, qf, kf, vf, o_ref, lse_ref);
  // The backward reference from the same (bf16) o, so D is the same.
  const Tensor dq_ref = Tensor::empty(qf.shape()), dk_ref = Tensor::zeros(kf.shape()),
               dv_ref = Tensor::zeros(vf.shape());
  attention_backward(opt, qf, kf, vf, of, lse_ref, dof, dq_ref, dk_ref, dv_ref);
  // sum_i P_ij |dO_i| and sum_i P_ij R_i from the fp32 backward's dv for |dO| and for R.
  const double vmax = max_abs(in.v), kmax = max_abs(in.k), qmax = max_abs(in.q), omax = max_abs(o);
  const Tensor abs_do = dof.clone(), r_do = dof.clone();
  std::vector<double> r(static_cast<std::size_t>(b * s * g * n));
  for (std::int64_t row = 0; row < b * s * g; ++row)
    for (std::int64_t head = 0; head < n; ++head) {
      double l1 = 0;
      for (std::int64_t c = 0; c < d; ++c) {
        float& x = abs_do.data()[row * n * d + head * d + c];
        x = std::abs(x);
        l1 += x;
      }
      const double ri = l1 * (vmax + omax);
      r[static_cast<std::size_t>(row * n + head)] = ri;
      for (std::int64_t c = 0; c < d; ++c)
        r_do.data()[row * n * d + head * d + c] = static_cast<float>(ri);
    }
  const Tensor unused_dq = Tensor::empty(qf.shape()), unused_dk = Tensor::zeros(kf.shape());
  const Tensor dv_abs = Tensor::zeros(vf.shape()), dv_r = Tensor::zeros(vf.shape());
  attention_backward(opt, qf, kf, vf, of, lse_ref, abs_do, unused_dq, unused_dk, dv_abs);
  attention_backward(opt, qf, kf, vf, of, lse_ref, r_do, unused_dq, unused_dk, dv_r);

  const double u = 0x1p-8, noise = 0x1p-14;
  auto gamma = [](double k) { return k * 0x1p-24 / (1 - k * 0x1p-24); };
  const double f = 1.0 / (1.0 - opt.dropout.probability);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const auto o_got = o.to_vector();
  const auto o_want = o_ref.to_vector();
  for (std::size_t i = 0; i < o_got.size(); ++i)
    ASSERT_LE(std::abs(static_cast<float>(o_got[i]) - o_want[i]),
              (2 * u + gamma(s) + noise) * f * vmax)
        << "o element " << i;
  const auto lse_got = lse.to_vector(), lse_want = lse_ref.to_vector();
  for (std::size_t i = 0; i < lse_got.size(); ++i)
    ASSERT_LE(std::abs(lse_got[i] - lse_want[i]), noise * (1 + std::abs(lse_want[i])))
        << "lse element " << i;
  const auto dv_got = dv.to_vector(), dv_want = dv_ref.to_vector(), dv_s = dv_abs.to_vector();
  for (std::size_t i = 0; i < dv_got.size(); ++i)
    ASSERT_LE(std::abs(dv_got[i] - dv_want[i]), (u + gamma(s * n) + noise) * dv_s[i] + 1e-30)
        << "dv element " << i;
  const auto dq_got = dq.to_vector();
  const auto dq_want = dq_ref.to_vector();
  for (std::size_t i = 0; i < dq_got.size(); ++i) {
    const double ri = r[i / static_cast<std::size_t>(d)];
    const double tol = scale * kmax * (2 * u + gamma(s) + 2 * gamma(d) + noise) * f * ri +
                       u * std::abs(dq_want[i]);
    ASSERT_LE(std::abs(static_cast<float>(dq_got[i]) - dq_want[i]), tol) << "dq element " << i;
  }
  const auto dk_got = dk.to_vector(), dk_want = dk_ref.to_vector(), dk_s = dv_r.to_vector();
  for (std::size_t i = 0; i < dk_got.size(); ++i) {
    const double tol =
        scale * qmax * (2 * u + gamma(s * n) + 2 * gamma(d) + noise) * f * dk_s[i] + 1e-30;
    ASSERT_LE(std::abs(dk_got[i] - dk_want[i]), tol) << "dk element " << i;
  }
}

// A tight check without dropout: a plain double-precision attention on the same bf16 values
// gives P, dP, D and dS exactly, and each error term above per element rather than through
// maxima. With the kernel's rounding of dS (u), its fp32 sums (gamma) and the fp32 noise of the
// scores and exp (2^-14 relative, twice: forward lse and backward P):
//   o_ic:  (2u + gamma_s + 2^-14) sum_j P_ij |v_jc|
//   dv_jc: (u + gamma_sn + 2^-13) sum_i P_ij |dO_ic|
//   dq_ic: scale sum_j [(u + gamma_s + 2^-13) |dS_ij| + gamma_d P_ij (A_ij + B_i)] |k_jc| + u
//   |dq_ic| dk_jc: scale sum_i [(u + gamma_sn + 2^-13) |dS_ij| + gamma_d P_ij (A_ij + B_i)] |q_ic|
// with A_ij = sum_c |dO_ic||v_jc| and B_i = sum_c |dO_ic||o_ic| bounding dP's and D's fp32 sums.
TEST(AttentionBf16, MatchesExactAttentionWithinPerElementBounds) {
  std::mt19937 gen(23);
  const std::int64_t B = 2, s = 200, G = 2, n = 2, d = 32, q_offset = 37;
  AttentionOptions opt;
  opt.q_offset = q_offset;
  const Bf16Tensor q = random_bf16({B, s, G, n * d}, gen), k = random_bf16({B, s, G, d}, gen),
                   v = random_bf16({B, s, G, d}, gen), d_o = random_bf16({B, s, G, n * d}, gen);
  const Bf16Tensor o = Bf16Tensor::empty(q.shape()), dq = Bf16Tensor::empty(q.shape());
  const Tensor lse = Tensor::empty({B, G * n, s}), dk = Tensor::zeros(k.shape()),
               dv = Tensor::zeros(v.shape());
  tbb::task_arena(2).execute([&] {
    attention_forward(opt, q, k, v, o, lse);
    attention_backward(opt, q, k, v, o, lse, d_o, dq, dk, dv);
  });
  const double u = 0x1p-8, noise = 0x1p-14, scale = 1.0 / std::sqrt(static_cast<double>(d));
  auto gamma = [](double m) { return m * 0x1p-24 / (1 - m * 0x1p-24); };
  auto at = [](const Bf16Tensor& t, std::int64_t b, std::int64_t i, std::int64_t g,
               std::int64_t c) { return static_cast<double>(static_cast<float>(t(b, i, g, c))); };
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t g = 0; g < G; ++g) {
      std::vector<double> dk_want(static_cast<std::size_t>(s * d)), dk_tol(dk_want.size());
      std::vector<double> dv_want(dk_want.size()), dv_tol(dk_want.size());
      for (std::int64_t head = 0; head < n; ++head)
        for (std::int64_t i = 0; i < s; ++i) {
          const std::int64_t seen = std::clamp<std::int64_t>(q_offset + i + 1, 0, s);
          const std::int64_t qc = head * d;
          std::vector<double> p(static_cast<std::size_t>(seen));
          double m = -std::numeric_limits<double>::infinity(), l = 0;
          for (std::int64_t j = 0; j < seen; ++j) {
            double dot = 0;
            for (std::int64_t c = 0; c < d; ++c)
              dot += at(q, b, i, g, qc + c) * at(k, b, j, g, c);
            p[static_cast<std::size_t>(j)] = scale * dot;
            m = std::max(m, scale * dot);
          }
          for (double& x : p) {
            x = std::exp(x - m);
            l += x;
          }
          for (double& x : p)
            x /= l;
          double D = 0, Bi = 0;
          for (std::int64_t c = 0; c < d; ++c) {
            D += at(d_o, b, i, g, qc + c) * at(o, b, i, g, qc + c);
            Bi += std::abs(at(d_o, b, i, g, qc + c) * at(o, b, i, g, qc + c));
          }
          std::vector<double> ds(p.size()), ds_tol(p.size());
          for (std::int64_t j = 0; j < seen; ++j) {
            double dp = 0, A = 0;
            for (std::int64_t c = 0; c < d; ++c) {
              dp += at(d_o, b, i, g, qc + c) * at(v, b, j, g, c);
              A += std::abs(at(d_o, b, i, g, qc + c) * at(v, b, j, g, c));
            }
            const double pj = p[static_cast<std::size_t>(j)];
            ds[static_cast<std::size_t>(j)] = pj * (dp - D);
            ds_tol[static_cast<std::size_t>(j)] = gamma(d) * pj * (A + Bi);
          }
          for (std::int64_t c = 0; c < d; ++c) {
            double o_want = 0, o_s = 0, dq_want = 0, dq_tol = 0;
            for (std::int64_t j = 0; j < seen; ++j) {
              const double pj = p[static_cast<std::size_t>(j)], vj = at(v, b, j, g, c);
              const double kj = at(k, b, j, g, c), dsj = ds[static_cast<std::size_t>(j)];
              o_want += pj * vj;
              o_s += pj * std::abs(vj);
              dq_want += scale * dsj * kj;
              dq_tol += scale *
                        ((u + gamma(s) + 2 * noise) * std::abs(dsj) +
                         ds_tol[static_cast<std::size_t>(j)]) *
                        std::abs(kj);
              const auto jc = static_cast<std::size_t>(j * d + c);
              const double qi = at(q, b, i, g, qc + c), doi = at(d_o, b, i, g, qc + c);
              dk_want[jc] += scale * dsj * qi;
              dk_tol[jc] += scale *
                            ((u + gamma(s * n) + 2 * noise) * std::abs(dsj) +
                             ds_tol[static_cast<std::size_t>(j)]) *
                            std::abs(qi);
              dv_want[jc] += pj * doi;
              dv_tol[jc] += (u + gamma(s * n) + 2 * noise) * pj * std::abs(doi);
            }
            ASSERT_LE(std::abs(at(o, b, i, g, qc + c) - o_want), (2 * u + gamma(s) + noise) * o_s)
                << "o " << b << " " << i << " " << g << " " << qc + c;
            dq_tol += u * std::abs(dq_want);
            ASSERT_LE(std::abs(at(dq, b, i, g, qc + c) - dq_want), dq_tol)
                << "dq " << b << " " << i << " " << g << " " << qc + c;
          }
          ASSERT_NEAR(lse(b, g * n + head, i), m + std::log(l), noise * (1 + std::abs(m)));
        }
      for (std::int64_t j = 0; j < s; ++j)
        for (std::int64_t c = 0; c < d; ++c) {
          const auto jc = static_cast<std::size_t>(j * d + c);
          ASSERT_LE(std::abs(dk(b, j, g, c) - dk_want[jc]), dk_tol[jc] + 1e-30)
              << "dk " << b << " " << j << " " << g << " " << c;
          ASSERT_LE(std::abs(dv(b, j, g, c) - dv_want[jc]), dv_tol[jc] + 1e-30)
              << "dv " << b << " " << j << " " << g << " " << c;
        }
    }
}

TEST(AttentionBf16, CausalGroupedQueryMatchesFp32WithinDerivedBounds) {
  check_attention_bf16({});
}

TEST(AttentionBf16, OffsetsAndDropoutMatchFp32WithinDerivedBounds) {
  AttentionOptions opt;
  opt.q_offset = 37;  // a chunk of queries further along than its keys start
  opt.dropout.probability = 0.1;
  opt.dropout.key = RandomKey{5, 1, 2};
  opt.dropout.sequence_length = 300;
  check_attention_bf16(opt);
}

}  // namespace
}  // namespace weave::ops
