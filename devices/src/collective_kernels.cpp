#include "collective_kernels.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace weave::devices::detail {

namespace {

// Sixteen floats: one AVX-512 register, two AVX or four SSE ones; GCC lowers the generic vector
// to whatever the target has. Four of them form a strip whose partial result lives in
// registers while every rank's contribution is added, so each element is read once from each
// source and written once to each destination, with nothing staged in between.
constexpr std::size_t kLanes = 16;
using Vec = float __attribute__((vector_size(kLanes * sizeof(float))));
// Without AVX-512, GCC notes that passing such a vector by value changes the calling convention.
// Every function taking one here has internal linkage, so no caller outside this file sees it.
#pragma GCC diagnostic ignored "-Wpsabi"
constexpr std::size_t kStrip = 4 * kLanes;

// Streaming stores go through an L1-sized staging block: the reduction of a block is finished
// before any of it is written, and a single source is read from memory once however many
// destinations it is copied to.
constexpr std::size_t kBlock = 2048;

// memcpy because buffers are only float-aligned and a vector load must not assume more.
Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

void store(float* p, Vec v) {
  std::memcpy(p, &v, sizeof v);
}

// The same expression for vectors and for the scalar tail, so every element reduces alike.
struct Sum {
  template <typename T>
  T operator()(T a, T b) const {
    return a + b;
  }
};
struct Max {
  template <typename T>
  T operator()(T a, T b) const {
    return a < b ? b : a;
  }
};

template <typename Op>
void reduce_direct(std::span<const float* const> sources, std::size_t source_offset,
                   std::span<float* const> destinations, std::size_t destination_offset,
                   std::size_t count) {
  const Op op;
  const bool copy_only = sources.size() == 1;
  std::size_t i = 0;
  for (; i + kStrip <= count; i += kStrip) {
    const float* x = sources[0] + source_offset + i;
    Vec a0 = load(x), a1 = load(x + kLanes), a2 = load(x + 2 * kLanes), a3 = load(x + 3 * kLanes);
    for (std::size_t s = 1; s < sources.size(); ++s) {
      x = sources[s] + source_offset + i;
      a0 = op(a0, load(x));
      a1 = op(a1, load(x + kLanes));
      a2 = op(a2, load(x + 2 * kLanes));
      a3 = op(a3, load(x + 3 * kLanes));
    }
    for (float* d : destinations) {
      float* y = d + destination_offset + i;
      if (copy_only && y == sources[0] + source_offset + i) continue;
      store(y, a0);
      store(y + kLanes, a1);
      store(y + 2 * kLanes, a2);
      store(y + 3 * kLanes, a3);
    }
  }
  if (copy_only) {  // bytes moved, never read as floats (collective_kernels.hpp)
    for (float* d : destinations) {
      float* y = d + destination_offset + i;
      const float* x = sources[0] + source_offset + i;
      if (y != x) std::memcpy(y, x, (count - i) * sizeof(float));
    }
    return;
  }
  for (; i < count; ++i) {
    float a = sources[0][source_offset + i];
    for (std::size_t s = 1; s < sources.size(); ++s)
      a = op(a, sources[s][source_offset + i]);
    for (float* d : destinations)
      d[destination_offset + i] = a;
  }
}

#if defined(__SSE2__)
// A strip written around the caches; y must be 16-byte aligned.
void stream_strip(float* y, const Vec (&a)[4]) {
  __m128 parts[4 * sizeof(Vec) / sizeof(__m128)];
  std::memcpy(parts, a, sizeof parts);
  for (std::size_t k = 0; k < std::size(parts); ++k)
    _mm_stream_ps(y + 4 * k, parts[k]);
}

// One destination: the reduction goes from registers straight to memory, with no staging.
template <typename Op>
void reduce_streaming_one(std::span<const float* const> sources, std::size_t source_offset,
                          float* destination, std::size_t count) {
  std::size_t head = 0;
  while (head < count && reinterpret_cast<std::uintptr_t>(destination + head) % 16 != 0)
    ++head;
  float* const first[] = {destination};
  reduce_direct<Op>(sources, source_offset, first, 0, head);
  const Op op;
  std::size_t i = head;
  for (; i + kStrip <= count; i += kStrip) {
    const float* x = sources[0] + source_offset + i;
    Vec a[4] = {load(x), load(x + kLanes), load(x + 2 * kLanes), load(x + 3 * kLanes)};
    for (std::size_t s = 1; s < sources.size(); ++s) {
      x = sources[s] + source_offset + i;
      for (std::size_t k = 0; k < 4; ++k)
        a[k] = op(a[k], load(x + k * kLanes));
    }
    stream_strip(destination + i, a);
  }
  float* const rest[] = {destination + i};
  reduce_direct<Op>(sources, source_offset + i, rest, 0, count - i);
  _mm_sfence();
}
#endif

template <typename Op>
void reduce_streaming(std::span<const float* const> sources, std::size_t source_offset,
                      std::span<float* const> destinations, std::size_t destination_offset,
                      std::size_t count) {
#if defined(__SSE2__)
  if (destinations.size() == 1)
    return reduce_streaming_one<Op>(sources, source_offset, destinations[0] + destination_offset,
                                    count);
#endif
  alignas(64) float block[kBlock];
  float* const staging[] = {block};
  for (std::size_t at = 0; at < count; at += kBlock) {
    const std::size_t n = std::min(kBlock, count - at);
    reduce_direct<Op>(sources, source_offset + at, staging, 0, n);
    for (float* d : destinations) {
      float* y = d + destination_offset + at;
      if (sources.size() == 1 && y == sources[0] + source_offset + at) continue;
      copy_floats(y, block, n, true);
    }
  }
}

}  // namespace

void reduce_to_all(ReduceOp op, std::span<const float* const> sources, std::size_t source_offset,
                   std::span<float* const> destinations, std::size_t destination_offset,
                   std::size_t count, bool streaming) {
  if (count == 0 || sources.empty()) return;
  const auto run = [&]<typename Op>(Op) {
    if (streaming)
      reduce_streaming<Op>(sources, source_offset, destinations, destination_offset, count);
    else
      reduce_direct<Op>(sources, source_offset, destinations, destination_offset, count);
  };
  if (op == ReduceOp::sum)
    run(Sum{});
  else
    run(Max{});
}

void copy_floats(float* to, const float* from, std::size_t count, bool streaming) {
  if (count == 0 || to == from) return;
#if defined(__SSE2__)
  if (streaming) {
    std::size_t i = 0;
    while (i < count && reinterpret_cast<std::uintptr_t>(to + i) % 16 != 0)
      ++i;
    std::memcpy(to, from, i * sizeof(float));
    for (; i + 16 <= count; i += 16) {
      _mm_stream_ps(to + i, _mm_loadu_ps(from + i));
      _mm_stream_ps(to + i + 4, _mm_loadu_ps(from + i + 4));
      _mm_stream_ps(to + i + 8, _mm_loadu_ps(from + i + 8));
      _mm_stream_ps(to + i + 12, _mm_loadu_ps(from + i + 12));
    }
    std::memcpy(to + i, from + i, (count - i) * sizeof(float));
    // Non-temporal stores are weakly ordered: fence them before the task's completion
    // publishes the data to the other members.
    _mm_sfence();
    return;
  }
#endif
  (void)streaming;
  std::memcpy(to, from, count * sizeof(float));
}

}  // namespace weave::devices::detail
