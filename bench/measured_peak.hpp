// The host's arithmetic peak, measured in the benchmark's own run rather than derived from a
// table of CPU models (which was wrong on every host it did not list).
//
// Each loop issues independent multiply-add instructions on registers only, so nothing but the
// execution ports limits it. FLOP per instruction (a multiply-add counts 2):
//   fp32   vfmadd231ps zmm: 16 fp32 lanes x 1 multiply-add = 32 FLOP.
//   bf16   vdpbf16ps zmm (AVX512_BF16): 16 fp32 lanes, each += a0 b0 + a1 b1 of two bf16 pairs:
//          32 multiply-adds = 64 FLOP.
//   Both with 24 independent accumulators, more than latency x ports of either (12 accumulators
//   left vdpbf16ps 20 % short of its rate on an Intel Xeon with AMX).
//   AMX    tdpbf16ps: C[16 x 16 fp32] += A[16 x 32 bf16] B[32 x 16 bf16], 16 x 16 x 32 = 8,192
//          multiply-adds = 16,384 FLOP; 4 independent accumulator tiles (2 x 2 blocks of 2 A and
//          2 B tiles, as a GEMM kernel holds them).
// On an Intel Xeon family 6 model 207 (Emerald Rapids) these measure, per core and per cycle of
// its clock (timed by a chain of dependent register adds, 1 a cycle): fp32 64 FLOP (2 FMA ports),
// vdpbf16ps 32 FLOP (one instruction every 2 cycles: half the fp32 rate in FLOP, the same in
// instructions per 2 cycles), AMX 1,024 FLOP (one tdpbf16ps every 16 cycles: the "1,024 bf16
// operations a cycle" quoted for AMX, counted as FLOP, i.e. 512 multiply-adds, not 1,024). The
// AMX loop keeps the same rate with its 4 tiles reloaded from L1 each round, so operand loads do
// not lower the peak a blocked GEMM can reach.
//
// Each thread times itself on its own CPU clock (CLOCK_THREAD_CPUTIME_ID), not the wall clock: on
// a host where other processes share the cores, the wall clock counts the time the thread waited
// for a core, and halved the figure under a load of 2 processes a core. A product compared with
// the peak is timed on CPU time too (process_cpu_seconds()).
// Run on T threads at once (one per core), it gives the peak of T cores as they clock together.
// A loop the CPU cannot run (no AVX512_BF16, no AMX, or the kernel refuses AMX state) gives 0.
#pragma once

#include <cpuid.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace weave::bench {

enum class PeakKind { fp32_fma, bf16_dot, amx_bf16 };

// CPU seconds the whole process has run (all its threads), for timing work against the peak on
// a shared host: threads that spin waiting count, time spent waiting for a core does not.
inline double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

namespace detail {

inline double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

inline bool cpu_has(PeakKind kind) {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool avx512f = b & (1u << 16);
  if (kind == PeakKind::fp32_fma) return avx512f;
  if (kind == PeakKind::amx_bf16) return (d & (1u << 22)) && (d & (1u << 24));  // bf16, tile
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
  return avx512f && (a1 & (1u << 5));  // AVX512_BF16
}

// Linux hands out AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, feature 18).
inline bool request_amx() {
  constexpr int kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

// Zeroes the registers the loops use: garbage there could be subnormal, which some CPUs handle
// in slow microcode.
__attribute__((target("avx512f"))) inline void zero_loop_registers() {
  asm volatile(
      "vpxord %%zmm30, %%zmm30, %%zmm30\n\tvpxord %%zmm31, %%zmm31, %%zmm31\n\t"
      ".irp r,0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23\n\t"
      "vpxord %%zmm\\r, %%zmm\\r, %%zmm\\r\n\t"
      ".endr" ::
          : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
            "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19",
            "xmm20", "xmm21", "xmm22", "xmm23", "xmm30", "xmm31");
}

// FLOP done by `rounds` rounds of one loop on the calling thread.
__attribute__((target("avx512f,fma"))) inline double fma_rounds(std::int64_t rounds) {
  for (std::int64_t i = 0; i < rounds; ++i)
    asm volatile(
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm0\n\tvfmadd231ps %%zmm30, %%zmm31, %%zmm1\n\t"
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm2\n\tvfmadd231ps %%zmm30, %%zmm31, %%zmm3\n\t"
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm4\n\tvfmadd231ps %%zmm30, %%zmm31, %%zmm5\n\t"
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm6\n\tvfmadd231ps %%zmm30, %%zmm31, %%zmm7\n\t"
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm8\n\tvfmadd231ps %%zmm30, %%zmm31, %%zmm9\n\t"
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm10\n\tvfmadd231ps %%zmm30, %%zmm31, %%zmm11\n\t"
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm12\n\tvfmadd231ps %%zmm30, %%zmm31, %%zmm13\n\t"
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm14\n\tvfmadd231ps %%zmm30, %%zmm31, %%zmm15\n\t"
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm16\n\tvfmadd231ps %%zmm30, %%zmm31, %%zmm17\n\t"
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm18\n\tvfmadd231ps %%zmm30, %%zmm31, %%zmm19\n\t"
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm20\n\tvfmadd231ps %%zmm30, %%zmm31, %%zmm21\n\t"
        "vfmadd231ps %%zmm30, %%zmm31, %%zmm22\n\tvfmadd231ps %%zmm30, %%zmm31, %%zmm23\n\t" ::
            : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
              "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18",
              "xmm19", "xmm20", "xmm21", "xmm22", "xmm23");
  return static_cast<double>(rounds) * 24 * 32;
}

__attribute__((target("avx512f,avx512bf16"))) inline double dpbf16_rounds(std::int64_t rounds) {
  for (std::int64_t i = 0; i < rounds; ++i)
    asm volatile(
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm0\n\tvdpbf16ps %%zmm30, %%zmm31, %%zmm1\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm2\n\tvdpbf16ps %%zmm30, %%zmm31, %%zmm3\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm4\n\tvdpbf16ps %%zmm30, %%zmm31, %%zmm5\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm6\n\tvdpbf16ps %%zmm30, %%zmm31, %%zmm7\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm8\n\tvdpbf16ps %%zmm30, %%zmm31, %%zmm9\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm10\n\tvdpbf16ps %%zmm30, %%zmm31, %%zmm11\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm12\n\tvdpbf16ps %%zmm30, %%zmm31, %%zmm13\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm14\n\tvdpbf16ps %%zmm30, %%zmm31, %%zmm15\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm16\n\tvdpbf16ps %%zmm30, %%zmm31, %%zmm17\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm18\n\tvdpbf16ps %%zmm30, %%zmm31, %%zmm19\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm20\n\tvdpbf16ps %%zmm30, %%zmm31, %%zmm21\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm22\n\tvdpbf16ps %%zmm30, %%zmm31, %%zmm23\n\t" ::
            : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
              "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18",
              "xmm19", "xmm20", "xmm21", "xmm22", "xmm23");
  return static_cast<double>(rounds) * 24 * 64;
}

inline double amx_rounds(std::int64_t rounds) {
  // Palette 1; all 8 tiles 16 rows of 64 bytes (16 x 32 bf16 or 16 x 16 fp32).
  alignas(64) std::uint8_t config[64] = {};
  config[0] = 1;
  for (int t = 0; t < 8; ++t) {
    config[16 + 2 * t] = 64;
    config[48 + t] = 16;
  }
  asm volatile("ldtilecfg %0" ::"m"(config));
  alignas(64) static const std::uint16_t zeros[16 * 32] = {};
  asm volatile(
      "tilezero %%tmm0\n\ttilezero %%tmm1\n\ttilezero %%tmm2\n\ttilezero %%tmm3\n\t"
      "mov $64, %%rax\n\t"
      "tileloadd (%0,%%rax,1), %%tmm4\n\ttileloadd (%0,%%rax,1), %%tmm5\n\t"
      "tileloadd (%0,%%rax,1), %%tmm6\n\ttileloadd (%0,%%rax,1), %%tmm7" ::"r"(zeros)
      : "rax", "memory");
  for (std::int64_t i = 0; i < rounds; ++i)
    asm volatile(
        ".rept 4\n\t"
        "tdpbf16ps %%tmm6, %%tmm4, %%tmm0\n\ttdpbf16ps %%tmm7, %%tmm4, %%tmm1\n\t"
        "tdpbf16ps %%tmm6, %%tmm5, %%tmm2\n\ttdpbf16ps %%tmm7, %%tmm5, %%tmm3\n\t"
        ".endr" ::
            :);
  asm volatile("tilerelease" ::: "memory");
  return static_cast<double>(rounds) * 16 * 16384;
}

inline double rounds_of(PeakKind kind, std::int64_t rounds) {
  switch (kind) {
    case PeakKind::fp32_fma:
      zero_loop_registers();
      return fma_rounds(rounds);
    case PeakKind::bf16_dot:
      zero_loop_registers();
      return dpbf16_rounds(rounds);
    case PeakKind::amx_bf16:
      return amx_rounds(rounds);
  }
  return 0;
}

}  // namespace detail

// GFLOP/s of `threads` threads running the loop together, each on its own CPU time: the best of
// five tries of ~0.1 s each (a try that other processes interrupted often, flushing the caches,
// does not set the figure).
inline double measured_peak_gflops(PeakKind kind, int threads) {
  if (!detail::cpu_has(kind)) return 0;
  if (kind == PeakKind::amx_bf16 && !detail::request_amx()) return 0;
  const std::int64_t rounds = kind == PeakKind::amx_bf16 ? 2'000'000 : 10'000'000;
  double best = 0;
  for (int attempt = 0; attempt < 5; ++attempt) {
    std::atomic<int> ready{0};
    std::vector<double> rate(static_cast<std::size_t>(threads));
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        ready.fetch_add(1);
        while (ready.load() < threads) {
        }
        const double t0 = detail::thread_cpu_seconds();
        const double flops = detail::rounds_of(kind, rounds);
        rate[static_cast<std::size_t>(t)] = flops / (detail::thread_cpu_seconds() - t0);
      });
    for (auto& th : pool)
      th.join();
    double total = 0;
    for (double r : rate)
      total += r;
    best = std::max(best, total * 1e-9);
  }
  return best;
}

}  // namespace weave::bench
