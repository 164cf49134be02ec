#include "weave/ops/gemm_bf16.hpp"

#include <omp.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
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
template <typename Out>
void onednn_gemm(bool ta, bool tb, float alpha, MatrixView<const bf16> a, MatrixView<const bf16> b,
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
  dnnl::memory am(a_md, engine, const_cast<bf16*>(a.data));
  dnnl::memory bm(b_md, engine, const_cast<bf16*>(b.data));
  dnnl::memory cm(c_md, engine, c.data);
  matmul.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
  stream.wait();
}

// The same product without bf16 instructions: the operands widened to fp32 (exact) and
// multiplied by gemm<float>, one thread.
std::vector<float> widened(MatrixView<const bf16> m) {
  std::vector<float> out(static_cast<std::size_t>(m.rows * m.cols));
  for (std::int64_t r = 0; r < m.rows; ++r)
    to_float({m.data + r * m.stride, static_cast<std::size_t>(m.cols)},
             {out.data() + r * m.cols, static_cast<std::size_t>(m.cols)});
  return out;
}

template <typename Out>
void fallback_gemm(bool ta, bool tb, float alpha, MatrixView<const bf16> a,
                   MatrixView<const bf16> b, float beta, MatrixView<Out> c) {
  const std::vector<float> af = widened(a), bf = widened(b);
  const MatrixView<const float> av{af.data(), a.rows, a.cols, a.cols};
  const MatrixView<const float> bv{bf.data(), b.rows, b.cols, b.cols};
  const Transpose ta_ = ta ? Transpose::yes : Transpose::no;
  const Transpose tb_ = tb ? Transpose::yes : Transpose::no;
  if constexpr (std::is_same_v<Out, float>) {
    gemm<float>(ta_, tb_, alpha, av, bv, beta, c);
  } else {
    std::vector<float> cf(static_cast<std::size_t>(c.rows * c.cols), 0.f);
    if (beta != 0.f) cf = widened({c.data, c.rows, c.cols, c.stride});
    gemm<float>(ta_, tb_, alpha, av, bv, beta, {cf.data(), c.rows, c.cols, c.cols});
    for (std::int64_t r = 0; r < c.rows; ++r)
      to_bf16({cf.data() + r * c.cols, static_cast<std::size_t>(c.cols)},
              {c.data + r * c.stride, static_cast<std::size_t>(c.cols)});
  }
}

void note_fallback_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    std::fputs(
        "weave: this CPU has no AVX512_BF16 (or oneDNN was limited below it with "
        "DNNL_MAX_CPU_ISA): bf16 matrix products run as fp32 products of the bf16 values, with "
        "the same accuracy at fp32's speed\n",
        stderr);
  });
}

template <typename Out>
void serial_gemm(bool ta, bool tb, float alpha, MatrixView<const bf16> a, MatrixView<const bf16> b,
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
    onednn_gemm<Out>(ta, tb, alpha, a, b, beta, c);
  else
    fallback_gemm<Out>(ta, tb, alpha, a, b, beta, c);
}

template <typename Out>
void gemm_bf16_impl(Transpose trans_a, Transpose trans_b, float alpha, MatrixView<const bf16> a,
                    MatrixView<const bf16> b, float beta, MatrixView<Out> c) {
  const bool ta = trans_a == Transpose::yes, tb = trans_b == Transpose::yes;
  const GemmShape shape = gemm_shape("gemm_bf16", ta, tb, a, b, c);
  const std::int64_t m = shape.m, n = shape.n, k = shape.k;
  const bool native = bf16_kernel() != Bf16Kernel::fp32_fallback;
  if (!native) {
    note_fallback_once();
    // gemm<float> splits over the arena itself.
    serial_gemm<Out>(ta, tb, alpha, a, b, beta, c, native);
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
    serial_gemm<Out>(ta, tb, alpha, a, b, beta, c, native);
    return;
  }
  // Pieces of equal size in multiples of 16 rows or columns (oneDNN's register and tile blocks).
  const std::int64_t step = (extent / pieces + 15) / 16 * 16;
  rt::parallel_for(std::int64_t{0}, (extent + step - 1) / step, [&](std::int64_t p) {
    const std::int64_t lo = p * step, hi = std::min(extent, lo + step);
    if (split_rows)
      serial_gemm<Out>(ta, tb, alpha, op_rows(a, ta, lo, hi), b, beta,
                       {c.data + lo * c.stride, hi - lo, c.cols, c.stride}, native);
    else
      serial_gemm<Out>(ta, tb, alpha, a, op_cols(b, tb, lo, hi), beta,
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
  gemm_bf16_impl<float>(trans_a, trans_b, alpha, a, b, beta, c);
}

void gemm_bf16(Transpose trans_a, Transpose trans_b, float alpha, MatrixView<const bf16> a,
               MatrixView<const bf16> b, float beta, MatrixView<bf16> c) {
  gemm_bf16_impl<bf16>(trans_a, trans_b, alpha, a, b, beta, c);
}

}  // namespace weave::ops
