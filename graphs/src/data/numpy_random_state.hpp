// The shuffles of NumPy's legacy numpy.random.RandomState(seed), which Megatron-LM's GPT
// dataset uses for its document and sample orders: MT19937 seeded with the integer seed (the
// generator std::mt19937 is), and shuffle() drawing each swap partner by masked rejection
// (NumPy's random_interval), from the last element down. The same seed then gives the same
// order of documents and samples Megatron gives.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <utility>

namespace weave::graphs::data {

class NumpyRandomState {
 public:
  explicit NumpyRandomState(std::uint32_t seed) : mt_(seed) {}

  // A uniform integer in [0, max].
  std::uint64_t interval(std::uint64_t max);

  template <typename T>
  void shuffle(std::span<T> values) {
    for (std::size_t i = values.size(); i-- > 1;)
      std::swap(values[i], values[static_cast<std::size_t>(interval(i))]);
  }

 private:
  std::mt19937 mt_;
};

}  // namespace weave::graphs::data
