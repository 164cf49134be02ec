#include "weave/graphs/batch_rampup.hpp"

#include <fmt/format.h>

#include "weave/graphs/parallel_plan.hpp"

namespace weave::graphs {

std::int64_t BatchRampup::batch_at(std::uint64_t consumed, std::int64_t global_batch_size) const {
  if (!enabled() || consumed > static_cast<std::uint64_t>(samples)) return global_batch_size;
  // Megatron-LM divides in floating point: SAMPLES over the increments, then the samples consumed
  // over that, truncated.
  const double increments = static_cast<double>((global_batch_size - start) / increment);
  const double samples_per_increment = static_cast<double>(samples) / increments;
  const auto steps =
      static_cast<std::int64_t>(static_cast<double>(consumed) / samples_per_increment);
  return start + steps * increment;
}

void check_batch_rampup(const BatchRampup& ramp, std::int64_t global_batch_size,
                        std::int64_t per_step) {
  const auto refuse = [](std::string message) { throw ConfigError(std::move(message)); };
  if (ramp.start < 1 || ramp.increment < 1)
    refuse(fmt::format(
        "--rampup-batch-size {} {} {}: START and INCREMENT must be >= 1 (the first global batch "
        "and what it grows by)",
        ramp.start, ramp.increment, ramp.samples));
  if (ramp.samples < 1)
    refuse(fmt::format(
        "--rampup-batch-size {} {} {}: SAMPLES must be >= 1, the samples over which the batch "
        "grows (Megatron-LM divides by it); without a ramp, drop the flag",
        ramp.start, ramp.increment, ramp.samples));
  if (ramp.start >= global_batch_size)
    refuse(fmt::format(
        "--rampup-batch-size START ({}) must be below --global-batch-size ({}), the batch the "
        "ramp grows to: lower START, or drop the flag to train every iteration at {}",
        ramp.start, global_batch_size, global_batch_size));
  if ((global_batch_size - ramp.start) % ramp.increment != 0)
    refuse(fmt::format(
        "--global-batch-size - START ({} - {} = {}) must be divisible by --rampup-batch-size "
        "INCREMENT ({}), as Megatron-LM requires: the ramp reaches the full batch in whole "
        "increments; choose an INCREMENT that divides {}",
        global_batch_size, ramp.start, global_batch_size - ramp.start, ramp.increment,
        global_batch_size - ramp.start));
  for (const auto& [name, value] : {std::pair{"START", ramp.start}, {"INCREMENT", ramp.increment}})
    if (value % per_step != 0)
      refuse(fmt::format(
          "--rampup-batch-size {} ({}) must be a multiple of --micro-batch-size x data-parallel "
          "size ({}): every batch of the ramp (START + k x INCREMENT) is a whole number of "
          "micro-batches per replica, as Megatron-LM checks each step's; make START and "
          "INCREMENT multiples of {}",
          name, value, per_step, per_step));
}

std::int64_t iterations_for_samples(const BatchRampup& ramp, std::int64_t global_batch_size,
                                    std::int64_t train_samples) {
  if (!ramp.enabled()) return train_samples / global_batch_size;
  std::int64_t iterations = 0, consumed = 0;
  while (consumed <= ramp.samples && consumed <= train_samples) {
    consumed += ramp.batch_at(static_cast<std::uint64_t>(consumed), global_batch_size);
    ++iterations;
  }
  // Python's floor division, as Megatron-LM adds (train_samples - consumed) // global_batch_size:
  // a ramp that passed --train-samples gives back the iterations it overshot by.
  const std::int64_t rest = train_samples - consumed;
  iterations +=
      rest >= 0 ? rest / global_batch_size : -((-rest + global_batch_size - 1) / global_batch_size);
  return iterations;
}

}  // namespace weave::graphs
