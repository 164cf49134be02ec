#include "data/blending_index.hpp"

#include <algorithm>

namespace weave::graphs::data {

BlendingIndex build_blending_index(std::span<const double> weights, std::int64_t size) {
  BlendingIndex index;
  index.dataset.resize(static_cast<std::size_t>(size));
  index.sample.resize(static_cast<std::size_t>(size));
  std::vector<std::int64_t> given(weights.size(), 0);
  for (std::int64_t i = 0; i < size; ++i) {
    const double scale = std::max(static_cast<double>(i), 1.0);
    std::size_t behind = 0;
    double most = weights[0] * scale - static_cast<double>(given[0]);
    for (std::size_t d = 1; d < weights.size(); ++d) {
      const double error = weights[d] * scale - static_cast<double>(given[d]);
      if (error > most) {
        most = error;
        behind = d;
      }
    }
    index.dataset[static_cast<std::size_t>(i)] = static_cast<std::int16_t>(behind);
    index.sample[static_cast<std::size_t>(i)] = given[behind]++;
  }
  return index;
}

}  // namespace weave::graphs::data
