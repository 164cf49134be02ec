#include "clock.hpp"

namespace weave::rt::detail {

double TickClock::ns_per_tick() {
#if defined(__x86_64__) || defined(__i386__)
  static const double value = [] {
    const Nanos t0 = steady_now();
    const std::uint64_t c0 = ticks();
    while (steady_now() - t0 < 2'000'000) {
    }
    const Nanos t1 = steady_now();
    const std::uint64_t c1 = ticks();
    return static_cast<double>(t1 - t0) / static_cast<double>(c1 - c0);
  }();
  return value;
#else
  return 1.0;
#endif
}

}  // namespace weave::rt::detail
