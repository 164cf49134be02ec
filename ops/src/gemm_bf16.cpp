#include "weave/ops/gemm_bf16.hpp"

#include <omp.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <span>
#include <type_traits>
#include <vector>

#include "gemm_views.hpp"
#include "weave/runtime/parallel_for.hpp"

namespace weave::ops {
namespace {

// Below this many multiply-adds a product runs on the calling thread: splitting costs more.
constexpr double kParallelMacs = 1 << 21;
// Each parallel piece keeps at least this many rows or columns of C, so oneDNN's blocked kernels
// (16-row AMX tiles, 64-column panels) still run at speed.
constexpr std::int64_t kMinPiece = 64;

// Debian's oneDNN is built with OpenMP threading, and an OpenMP parallel region opened from a
// thread outside any team (a TBB worker running a device's task) starts a team of its own of
// omp_get_max_threads() threads: every core of the host, per device task, on top of TBB's
// workers, which spin while oneDNN's threads spin too. The threadpool interop (oneDNN running
// on the caller's TBB threads) exists only in oneDNN builds with the threadpool runtime, not
// this one, and oneDNN 2.6 has no call to cap its own threads. So each thread that calls oneDNN
// sets its OpenMP thread count to 1 (libgomp keeps that setting per thread, so other OpenMP
// users are unaffected): oneDNN then runs its kernel on the calling thread, starting no thread,
// and weave splits a large product over the device's arena itself, as for gemm<float>.
void run_onednn_on_this_thread_only() {
  thread_local bool done = false;
  if (done) return;
  omp_set_num_threads(1);
  done = true;
}

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

template <typename T>
constexpr dnnl::memory::data_type data_type_of() {
  if constexpr (std::is_same_v<T, float>)
    return dnnl::memory::data_type::f32;
  else if constexpr (std::is_same_v<T, fp16>)
    return dnnl::memory::data_type::f16;
  else
    return dnnl::memory::data_type::bf16;
}

// op(M) as an [rows, cols] oneDNN descriptor over M's memory: a transpose is a swap of strides.
template <typename T>
dnnl::memory::desc op_desc(MatrixView<const T> m, bool trans) {
  using dims = dnnl::memory::dims;
  if (!trans) return {dims{m.rows, m.cols}, data_type_of<T>(), dims{m.stride, 1}};
  return {dims{m.cols, m.rows}, data_type_of<T>(), dims{1, m.stride}};
}

// One oneDNN matmul on the calling thread. oneDNN's primitive cache keeps the compiled kernel of
// each shape, so a training step's repeated shapes are compiled once.
template <typename Half, typename Out>
void onednn_gemm(bool ta, bool tb, float alpha, MatrixView<const Half> a, MatrixView<const Half> b,
                 float beta, MatrixView<Out> c) {
  run_onednn_on_this_thread_only();
  const MatrixView<const Out> cc{c.data, c.rows, c.cols, c.stride};
  const auto a_md = op_desc(a, ta), b_md = op_desc(b, tb), c_md = op_desc(cc, false);
  dnnl::primitive_attr attr;
  if (alpha != 1.f) attr.set_output_scales(0, {alpha});
  if (beta != 0.f) {
    dnnl::post_ops ops;
    ops.append_sum(beta);
    attr.set_post_ops(ops);
  }
  dnnl::engine& engine = cpu_engine();
  const dnnl::matmul::primitive_desc pd({a_md, b_md, c_md}, attr, engine);
  const dnnl::matmul matmul(pd);
  dnnl::stream stream(engine);
  dnnl::memory am(a_md, engine, const_cast<Half*>(a.data));
  dnnl::memory bm(b_md, engine, const_cast<Half*>(b.data));
  dnnl::memory cm(c_md, engine, c.data);
  matmul.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
  stream.wait();
}

// The same product without 16-bit instructions: the operands widened to fp32 (exact) and
// multiplied by gemm<float>, one thread.
template <typename Half>
std::vector<float> widened(MatrixView<const Half> m) {
  std::vector<float> out(static_cast<std::size_t>(m.rows * m.cols));
  for (std::int64_t r = 0; r < m.rows; ++r)
    to_float({m.data + r * m.stride, static_cast<std::size_t>(m.cols)},
             {out.data() + r * m.cols, static_cast<std::size_t>(m.cols)});
  return out;
}

void round_row(std::span<const float> from, std::span<bf16> to) {
  to_bf16(from, to);
}
void round_row(std::span<const float> from, std::span<fp16> to) {
  to_fp16(from, to);
}

template <typename Half, typename Out>
void fallback_gemm(bool ta, bool tb, float alpha, MatrixView<const Half> a,
                   MatrixView<const Half> b, float beta, MatrixView<Out> c) {
  const std::vector<float> af = widened(a), bf = widened(b);
  const MatrixView<const float> av{af.data(), a.rows, a.cols, a.cols};
  const MatrixView<const float> bv{bf.data(), b.rows, b.cols, b.cols};
  const Transpose ta_ = ta ? Transpose::yes : Transpose::no;
  const Transpose tb_ = tb ? Transpose::yes : Transpose::no;
  if constexpr (std::is_same_v<Out, float>) {
    gemm<float>(ta_, tb_, alpha, av, bv, beta, c);
  } else {
    std::vector<float> cf(static_cast<std::size_t>(c.rows * c.cols), 0.f);
    if (beta != 0.f) cf = widened<Half>({c.data, c.rows, c.cols, c.stride});
    gemm<float>(ta_, tb_, alpha, av, bv, beta, {cf.data(), c.rows, c.cols, c.cols});
    for (std::int64_t r = 0; r < c.rows; ++r)
      round_row({cf.data() + r * c.cols, static_cast<std::size_t>(c.cols)},
                {c.data + r * c.stride, static_cast<std::size_t>(c.cols)});
  }
}

template <typename Half>
void note_fallback_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    if constexpr (std::is_same_v<Half, bf16>)
      std::fputs(
          "weave: this CPU has no AVX512_BF16 (or oneDNN was limited below it with "
          "DNNL_MAX_CPU_ISA): bf16 matrix products run as fp32 products of the bf16 values, with "
          "the same accuracy at fp32's speed\n",
          stderr);
    else
      std::fputs(
          "weave: oneDNN has no fp16 matrix product on this CPU: fp16 matrix products run as "
          "fp32 products of the fp16 values, with the same accuracy at fp32's speed\n",
          stderr);
  });
}

template <typename Half, typename Out>
void serial_gemm(bool ta, bool tb, float alpha, MatrixView<const Half> a, MatrixView<const Half> b,
                 float beta, MatrixView<Out> c, bool native) {
  if (c.rows == 0 || c.cols == 0) return;
  const std::int64_t k = ta ? a.rows : a.cols;
  if (k == 0) {
    // No products: C = beta C (and zero for beta == 0, whatever C held).
    for (std::int64_t r = 0; r < c.rows; ++r)
      for (std::int64_t j = 0; j < c.cols; ++j) {
        Out& x = c.data[r * c.stride + j];
        x = Out(beta == 0.f ? 0.f : beta * static_cast<float>(x));
      }
    return;
  }
  if (native)
    onednn_gemm<Half, Out>(ta, tb, alpha, a, b, beta, c);
  else
    fallback_gemm<Half, Out>(ta, tb, alpha, a, b, beta, c);
}

bool native_kernel(bf16) {
  return bf16_kernel() != Bf16Kernel::fp32_fallback;
}
bool native_kernel(fp16) {
  return fp16_kernel() != Fp16Kernel::fp32_fallback;
}

template <typename Half, typename Out>
void gemm_half_impl(const char* name, Transpose trans_a, Transpose trans_b, float alpha,
                    MatrixView<const Half> a, MatrixView<const Half> b, float beta,
                    MatrixView<Out> c) {
  const bool ta = trans_a == Transpose::yes, tb = trans_b == Transpose::yes;
  const GemmShape shape = gemm_shape(name, ta, tb, a, b, c);
  const std::int64_t m = shape.m, n = shape.n, k = shape.k;
  const bool native = native_kernel(Half{});
  if (!native) {
    note_fallback_once<Half>();
    // gemm<float> splits over the arena itself.
    serial_gemm<Half, Out>(ta, tb, alpha, a, b, beta, c, native);
    return;
  }
  const int threads = tbb::this_task_arena::max_concurrency();
  const double macs = static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  // Split C by rows whenever there are enough: a block of rows keeps every operand's rows dense,
  // while a block of columns is a strided view of B and C, which oneDNN's fast matmuls (brgemm,
  // AMX) do not take: it falls back to a kernel several times slower.
  const bool split_rows = m >= n || m >= 2 * kMinPiece;
  const std::int64_t extent = split_rows ? m : n;
  const std::int64_t pieces =
      std::min<std::int64_t>(threads, std::max<std::int64_t>(1, extent / kMinPiece));
  if (threads <= 1 || macs < kParallelMacs || pieces <= 1) {
    serial_gemm<Half, Out>(ta, tb, alpha, a, b, beta, c, native);
    return;
  }
  // A weight gradient's pieces (rows of op(A) = A^T: blocks of A's columns, a strided transposed
  // source) run oneDNN 2.6's gemm:jit rather than its AMX brgemm matmul, which takes a transposed
  // source only when dense. Left so: copying each block dense to get brgemm measured 25-35 %
  // slower at a layer's weight-gradient shapes (2048 tokens, 2 threads), gemm:jit being the
  // faster of the two there.
  // Pieces of equal size in multiples of 16 rows or columns (oneDNN's register and tile blocks).
  const std::int64_t step = (extent / pieces + 15) / 16 * 16;
  rt::parallel_for(std::int64_t{0}, (extent + step - 1) / step, [&](std::int64_t p) {
    const std::int64_t lo = p * step, hi = std::min(extent, lo + step);
    if (split_rows)
      serial_gemm<Half, Out>(ta, tb, alpha, op_rows(a, ta, lo, hi), b, beta,
                             {c.data + lo * c.stride, hi - lo, c.cols, c.stride}, native);
    else
      serial_gemm<Half, Out>(ta, tb, alpha, a, op_cols(b, tb, lo, hi), beta,
                             {c.data + lo, c.rows, hi - lo, c.stride}, native);
  });
}

}  // namespace

Bf16Kernel bf16_kernel() {
  static const Bf16Kernel kernel = [] {
    const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
    const auto has = [isa](dnnl::cpu_isa want) {
      const auto bits = static_cast<unsigned>(want);
      return (isa & bits) == bits;
    };
    if (has(dnnl::cpu_isa::avx512_core_amx)) return Bf16Kernel::amx;
    if (has(dnnl::cpu_isa::avx512_core_bf16)) return Bf16Kernel::avx512_bf16;
    return Bf16Kernel::fp32_fallback;
  }();
  return kernel;
}

std::string to_string(Bf16Kernel kernel) {
  switch (kernel) {
    case Bf16Kernel::amx:
      return "amx";
    case Bf16Kernel::avx512_bf16:
      return "avx512_bf16";
    case Bf16Kernel::fp32_fallback:
      return "fp32_fallback";
  }
  return "unknown";
}

void gemm_bf16(Transpose trans_a, Transpose trans_b, float alpha, MatrixView<const bf16> a,
               MatrixView<const bf16> b, float beta, MatrixView<float> c) {
  gemm_half_impl<bf16, float>("gemm_bf16", trans_a, trans_b, alpha, a, b, beta, c);
}

void gemm_bf16(Transpose trans_a, Transpose trans_b, float alpha, MatrixView<const bf16> a,
               MatrixView<const bf16> b, float beta, MatrixView<bf16> c) {
  gemm_half_impl<bf16, bf16>("gemm_bf16", trans_a, trans_b, alpha, a, b, beta, c);
}

Fp16Kernel fp16_kernel() {
  // oneDNN says by refusing a primitive whether it has an fp16 matmul for this CPU (and
  // DNNL_MAX_CPU_ISA): oneDNN 2.6 has none on x86, later versions use AVX512_FP16 and AMX-FP16.
  static const Fp16Kernel kernel = [] {
    try {
      using dt = dnnl::memory::data_type;
      const dnnl::memory::dims dims{16, 16};
      const dnnl::memory::desc in(dims, dt::f16, dnnl::memory::format_tag::ab);
      const dnnl::memory::desc out(dims, dt::f32, dnnl::memory::format_tag::ab);
      const dnnl::matmul::primitive_desc pd({in, in, out}, cpu_engine());
      (void)pd;
      return Fp16Kernel::onednn_f16;
    } catch (const dnnl::error&) {
      return Fp16Kernel::fp32_fallback;
    }
  }();
  return kernel;
}

std::string to_string(Fp16Kernel kernel) {
  switch (kernel) {
    case Fp16Kernel::onednn_f16:
      return "onednn_f16";
    case Fp16Kernel::fp32_fallback:
      return "fp32_fallback";
  }
  return "unknown";
}

void gemm_fp16(Transpose trans_a, Transpose trans_b, float alpha, MatrixView<const fp16> a,
               MatrixView<const fp16> b, float beta, MatrixView<float> c) {
  gemm_half_impl<fp16, float>("gemm_fp16", trans_a, trans_b, alpha, a, b, beta, c);
}

void gemm_fp16(Transpose trans_a, Transpose trans_b, float alpha, MatrixView<const fp16> a,
               MatrixView<const fp16> b, float beta, MatrixView<fp16> c) {
  gemm_half_impl<fp16, fp16>("gemm_fp16", trans_a, trans_b, alpha, a, b, beta, c);
}

}  // namespace weave::ops
