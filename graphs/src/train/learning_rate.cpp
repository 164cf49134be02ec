#include "weave/graphs/learning_rate.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <stdexcept>

namespace weave::graphs {

namespace {

// The schedule at `step` of a warm-up of `warmup` steps and a decay ending at step `decay`
// (iterations or samples alike).
double rate_at(const LearningRateSchedule& s, std::int64_t step, std::int64_t warmup,
               std::int64_t decay) {
  const double lr = s.lr, min_lr = s.min_lr;
  const std::string& style = s.style;
  if (min_lr > lr || min_lr < 0)
    throw std::invalid_argument(
        fmt::format("--min-lr ({}) must be between 0 and --lr ({})", min_lr, lr));
  if (warmup > 0 && step <= warmup)
    return lr * static_cast<double>(step) / static_cast<double>(warmup);
  if (style == "constant") return lr;
  const std::int64_t span = std::max<std::int64_t>(decay - warmup, 1);
  const double progress =
      std::clamp(static_cast<double>(step - warmup) / static_cast<double>(span), 0.0, 1.0);
  if (style == "linear") return min_lr + (lr - min_lr) * (1 - progress);
  if (style == "cosine")
    return min_lr + (lr - min_lr) * 0.5 * (1 + std::cos(std::numbers::pi * progress));
  throw std::invalid_argument(
      fmt::format("--lr-decay-style must be cosine, linear or constant, got '{}'", style));
}

}  // namespace

double LearningRateSchedule::at(std::int64_t iteration) const {
  return rate_at(*this, iteration, warmup_iters, decay_iters);
}

double LearningRateSchedule::at_samples(std::int64_t samples) const {
  return rate_at(*this, samples, warmup_samples, decay_samples);
}

}  // namespace weave::graphs
