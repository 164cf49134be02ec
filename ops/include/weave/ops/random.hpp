// Counter-based random numbers (Philox-4x32-10 from Random123).
//
// A draw is a pure function of (seed, layer, site, global token index, feature index): no
// generator state advances, so splitting a sequence into Ampipe chunks, sharding it over
// sequence- or tensor-parallel ranks, or replaying a step draws exactly the same numbers.
#pragma once

#include <cstdint>

namespace weave::ops {

struct RandomKey {
  std::uint64_t seed = 0;
  std::uint32_t layer = 0;  // < 2^24
  std::uint32_t site = 0;   // which draw within the layer (attention dropout, MLP dropout, ...),
                            // < 256
};

// Throws std::invalid_argument when layer or site exceed their ranges.
void check_random_key(const RandomKey& key);

// Four uniform floats in [0, 1) for features 4q .. 4q+3 of `token` (q = feature / 4).
void uniform4(const RandomKey& key, std::uint64_t token, std::uint64_t feature_quad, float out[4]);

// The uniform float in [0, 1) for (key, token, feature).
float uniform(const RandomKey& key, std::uint64_t token, std::uint64_t feature);

}  // namespace weave::ops
