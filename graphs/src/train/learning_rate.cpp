#include "weave/graphs/learning_rate.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <stdexcept>

namespace weave::graphs {

double LearningRateSchedule::at(std::int64_t iteration) const {
  if (min_lr > lr || min_lr < 0)
    throw std::invalid_argument(
        fmt::format("--min-lr ({}) must be between 0 and --lr ({})", min_lr, lr));
  if (warmup_iters > 0 && iteration <= warmup_iters)
    return lr * static_cast<double>(iteration) / static_cast<double>(warmup_iters);
  if (style == "constant") return lr;
  const std::int64_t span = std::max<std::int64_t>(decay_iters - warmup_iters, 1);
  const double progress = std::clamp(
      static_cast<double>(iteration - warmup_iters) / static_cast<double>(span), 0.0, 1.0);
  if (style == "linear") return min_lr + (lr - min_lr) * (1 - progress);
  if (style == "cosine")
    return min_lr + (lr - min_lr) * 0.5 * (1 + std::cos(std::numbers::pi * progress));
  throw std::invalid_argument(
      fmt::format("--lr-decay-style must be cosine, linear or constant, got '{}'", style));
}

}  // namespace weave::graphs
