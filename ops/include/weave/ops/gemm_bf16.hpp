// Matrix products of bf16 or fp16 matrices, accumulated in fp32: the products of 16-bit
// training.
//
// Where the CPU has AVX512_BF16 (or AMX), they run as oneDNN matmuls; elsewhere the bf16 values
// are widened to fp32 (exactly) and multiplied by the fp32 gemm, after a one-time note on
// stderr. Either way every product of two bf16 values is exact in fp32 and the sums are fp32
// sums, so the two paths differ only in summation order.
//
// Like gemm(), a product is split over the cores of the arena the caller runs in (blocks of C's
// rows or columns, each one oneDNN call on one thread); oneDNN starts no threads of its own.
#pragma once

#include <string>

#include "weave/ops/bfloat16.hpp"
#include "weave/ops/float16.hpp"
#include "weave/ops/gemm.hpp"

namespace weave::ops {

// C = alpha * op(A) op(B) + beta * C, with A and B in bf16 and the sums in fp32. With beta == 0,
// C's old contents are ignored (NaNs too). A bf16 C receives the fp32 result rounded to nearest
// even, once. Throws std::invalid_argument naming the three shapes if they do not fit together.
void gemm_bf16(Transpose trans_a, Transpose trans_b, float alpha, MatrixView<const bf16> a,
               MatrixView<const bf16> b, float beta, MatrixView<float> c);
void gemm_bf16(Transpose trans_a, Transpose trans_b, float alpha, MatrixView<const bf16> a,
               MatrixView<const bf16> b, float beta, MatrixView<bf16> c);

// Which kernels gemm_bf16 runs on this CPU (oneDNN's view of it, so DNNL_MAX_CPU_ISA lowers it).
enum class Bf16Kernel {
  amx,            // oneDNN, AMX tiles (and AVX512_BF16)
  avx512_bf16,    // oneDNN, vdpbf16ps
  fp32_fallback,  // no bf16 instructions: widened to fp32 and multiplied by gemm<float>
};
Bf16Kernel bf16_kernel();
// "amx", "avx512_bf16" or "fp32_fallback".
std::string to_string(Bf16Kernel kernel);

// The same products of fp16 matrices: a oneDNN f16 matmul where oneDNN has one for this CPU;
// elsewhere the fp16 values widened to fp32 (exactly) and multiplied by gemm<float>, which gives
// the same products (two 11-bit significands multiply exactly in fp32's 24) summed in fp32. A
// fp16 C receives the fp32 result rounded to nearest even fp16 once (overflowing to infinity
// beyond 65504).
void gemm_fp16(Transpose trans_a, Transpose trans_b, float alpha, MatrixView<const fp16> a,
               MatrixView<const fp16> b, float beta, MatrixView<float> c);
void gemm_fp16(Transpose trans_a, Transpose trans_b, float alpha, MatrixView<const fp16> a,
               MatrixView<const fp16> b, float beta, MatrixView<fp16> c);

// gemm_bf16 or gemm_fp16 by the operands' type: for code written once for both formats.
inline void gemm_half(Transpose ta, Transpose tb, float alpha, MatrixView<const bf16> a,
                      MatrixView<const bf16> b, float beta, MatrixView<float> c) {
  gemm_bf16(ta, tb, alpha, a, b, beta, c);
}
inline void gemm_half(Transpose ta, Transpose tb, float alpha, MatrixView<const bf16> a,
                      MatrixView<const bf16> b, float beta, MatrixView<bf16> c) {
  gemm_bf16(ta, tb, alpha, a, b, beta, c);
}
inline void gemm_half(Transpose ta, Transpose tb, float alpha, MatrixView<const fp16> a,
                      MatrixView<const fp16> b, float beta, MatrixView<float> c) {
  gemm_fp16(ta, tb, alpha, a, b, beta, c);
}
inline void gemm_half(Transpose ta, Transpose tb, float alpha, MatrixView<const fp16> a,
                      MatrixView<const fp16> b, float beta, MatrixView<fp16> c) {
  gemm_fp16(ta, tb, alpha, a, b, beta, c);
}

// Which kernels gemm_fp16 runs on this CPU: oneDNN is asked for an f16 matmul once.
enum class Fp16Kernel {
  onednn_f16,     // oneDNN's f16 matmul (AVX512_FP16 or AMX-FP16 in oneDNN versions with one)
  fp32_fallback,  // widened to fp32 and multiplied by gemm<float>
};
Fp16Kernel fp16_kernel();
// "onednn_f16" or "fp32_fallback".
std::string to_string(Fp16Kernel kernel);

}  // namespace weave::ops
