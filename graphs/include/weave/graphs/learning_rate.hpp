// Megatron's learning-rate schedule: linear warm-up, then cosine (or linear, or constant)
// decay from lr to min_lr over the decay iterations, or, in a run trained by samples
// (--train-samples), over the decay samples: Megatron-LM's scheduler counts samples either way
// (iterations x --global-batch-size when trained by iterations), so that a run whose batch ramps
// up decays by the samples it has consumed.
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
  // A run trained by samples: --lr-warmup-samples and --lr-decay-samples (0: the training
  // samples), read by at_samples in place of the iteration counts.
  std::int64_t warmup_samples = 0;
  std::int64_t decay_samples = 0;

  // The rate for iteration `iteration` (from 1). Throws std::invalid_argument for an unknown
  // style or min_lr > lr.
  double at(std::int64_t iteration) const;
  // The rate once `samples` samples are consumed (weave reads it with this iteration's batch
  // counted, as at() reads iteration n for the n-th iteration), by warmup_samples and
  // decay_samples.
  double at_samples(std::int64_t samples) const;
};

}  // namespace weave::graphs
