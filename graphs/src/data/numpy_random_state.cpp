#include "data/numpy_random_state.hpp"

namespace weave::graphs::data {

std::uint64_t NumpyRandomState::interval(std::uint64_t max) {
  if (max == 0) return 0;
  std::uint64_t mask = max;  // the smallest all-ones mask covering max
  for (int shift = 1; shift <= 32; shift *= 2)
    mask |= mask >> shift;
  std::uint64_t value;
  if (max <= 0xffffffffull) {
    while ((value = (static_cast<std::uint64_t>(mt_()) & mask)) > max) {
    }
  } else {
    auto next64 = [this] {
      const std::uint64_t high = mt_();
      return (high << 32) | mt_();
    };
    while ((value = (next64() & mask)) > max) {
    }
  }
  return value;
}

}  // namespace weave::graphs::data
