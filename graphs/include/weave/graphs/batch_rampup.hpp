// Megatron-LM's batch ramp-up (--rampup-batch-size START INCREMENT SAMPLES, its
// RampupBatchsizeNumMicroBatchesCalculator): the global batch starts at START and grows by
// INCREMENT each time SAMPLES / ((--global-batch-size - START) / INCREMENT) more samples have been
// consumed, reaching --global-batch-size once more than SAMPLES have been; the number of
// micro-batches of a step is that batch / (--micro-batch-size x data-parallel size). Ramp-up
// trains by samples (--train-samples), as Megatron-LM requires: the iteration count follows
// from the ramp.
#pragma once

#include <cstdint>

namespace weave::graphs {

struct BatchRampup {
  std::int64_t start = 0;      // START: the first global batch; 0: no ramp-up
  std::int64_t increment = 0;  // INCREMENT: what the batch grows by at each step of the ramp
  std::int64_t samples = 0;    // SAMPLES: the samples over which it grows to the full batch

  bool enabled() const { return start > 0; }
  // The global batch of an iteration that starts after `consumed` samples, for a full batch of
  // `global_batch_size` (the rule above; the rules of check_batch_rampup hold).
  std::int64_t batch_at(std::uint64_t consumed, std::int64_t global_batch_size) const;
};

// Megatron-LM's rules of a ramp: START, INCREMENT > 0, SAMPLES >= 0, START below the full batch
// and the full batch reached by whole increments, and each batch of the ramp a whole number of
// micro-batches per data-parallel replica (START and INCREMENT multiples of micro-batch x
// data-parallel size, `per_step`). Throws ConfigError naming the rule, the values and the fix.
void check_batch_rampup(const BatchRampup& ramp, std::int64_t global_batch_size,
                        std::int64_t per_step);

// The iterations of a run of `train_samples` samples (Megatron-LM's update_train_iters): each
// iteration of the ramp (while at most ramp.samples and train_samples are consumed) at its batch,
// then whole full batches of what remains (a partial last batch is not trained).
std::int64_t iterations_for_samples(const BatchRampup& ramp, std::int64_t global_batch_size,
                                    std::int64_t train_samples);

}  // namespace weave::graphs
