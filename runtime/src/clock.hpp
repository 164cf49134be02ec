// Clocks for the executor: steady nanoseconds, and a cheaper tick counter for trace spans.
#pragma once

#include <chrono>
#include <cstdint>

#include "weave/runtime/types.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

namespace weave::rt::detail {

inline Nanos steady_now() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Reading the time stamp counter costs about a third of steady_clock here; traces read the
// clock twice per task, so spans are taken in ticks and converted once at the end.
class TickClock {
 public:
  static std::uint64_t ticks() {
#if defined(__x86_64__) || defined(__i386__)
    return __rdtsc();
#else
    return static_cast<std::uint64_t>(steady_now());
#endif
  }
  // Nanoseconds per tick, measured once against steady_clock.
  static double ns_per_tick();
};

}  // namespace weave::rt::detail
