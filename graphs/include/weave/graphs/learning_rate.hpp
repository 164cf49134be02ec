// Megatron's learning-rate schedule: linear warm-up, then cosine (or linear, or constant)
// decay from lr to min_lr over the decay iterations.
#pragma once

#include <cstdint>
#include <string>

namespace weave::graphs {

struct LearningRateSchedule {
  double lr = 1e-3;               // --lr
  double min_lr = 0;              // --min-lr
  std::int64_t warmup_iters = 0;  // --lr-warmup-iters
  std::int64_t decay_iters = 0;   // --lr-decay-iters; 0: the training iterations
  std::string style = "cosine";   // --lr-decay-style: cosine, linear or constant

  // The rate for iteration `iteration` (from 1). Throws std::invalid_argument for an unknown
  // style or min_lr > lr.
  double at(std::int64_t iteration) const;
};

}  // namespace weave::graphs
