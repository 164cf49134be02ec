// Megatron-LM's blending rule (build_blending_indices in megatron/core/datasets/helpers.cpp):
// sample i of a blend comes from the dataset furthest behind its share, the one whose
// weight x max(i, 1) exceeds the samples it has given so far by the most (the first on a tie),
// and is that dataset's next sample. The blend then follows the weights at every prefix.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace weave::graphs::data {

struct BlendingIndex {
  std::vector<std::int16_t> dataset;  // which dataset gives sample i
  std::vector<std::int64_t> sample;   // its sample number there
};

// `weights` normalised to sum 1.
BlendingIndex build_blending_index(std::span<const double> weights, std::int64_t size);

}  // namespace weave::graphs::data
