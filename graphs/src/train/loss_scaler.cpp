#include "weave/graphs/loss_scaler.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "weave/graphs/parallel_plan.hpp"

namespace weave::graphs {

namespace {

// Megatron-LM's optimizer setup fixes these (growth_factor=2.0, backoff_factor=0.5).
constexpr float kGrowthFactor = 2.0f;
constexpr float kBackoffFactor = 0.5f;

void check_positive(const char* flag, double value) {
  if (!(value > 0) || !std::isfinite(value))
    throw ConfigError(
        fmt::format("{} is {}: a loss scale must be positive and finite", flag, value));
}

}  // namespace

bool has_loss_scaler(Precision precision, const LossScaleConfig& c) {
  return precision == Precision::fp16 || (precision == Precision::bf16 && c.loss_scale != 0);
}

std::optional<LossScaler> LossScaler::for_run(Precision precision, const LossScaleConfig& c) {
  if (!has_loss_scaler(precision, c)) return std::nullopt;
  if (c.loss_scale != 0) {
    check_positive("--loss-scale", c.loss_scale);
    return LossScaler(false, c, static_cast<float>(c.loss_scale));
  }
  check_positive("--initial-loss-scale", c.initial_loss_scale);
  check_positive("--min-loss-scale", c.min_loss_scale);
  if (c.min_loss_scale > c.initial_loss_scale)
    throw ConfigError(fmt::format(
        "--min-loss-scale {} is above --initial-loss-scale {}: the scale starts at the initial one "
        "and never goes below the minimum; lower --min-loss-scale",
        c.min_loss_scale, c.initial_loss_scale));
  if (c.loss_scale_window < 1)
    throw ConfigError(fmt::format(
        "--loss-scale-window is {}: the scale doubles after that many steps without an overflow, "
        "at least 1",
        c.loss_scale_window));
  if (c.hysteresis < 1)
    throw ConfigError(fmt::format(
        "--hysteresis is {}: the scale halves after that many steps with an overflow, at least 1",
        c.hysteresis));
  return LossScaler(true, c, static_cast<float>(c.initial_loss_scale));
}

LossScaler::LossScaler(bool dynamic, const LossScaleConfig& c, float initial)
    : dynamic_(dynamic),
      min_scale_(static_cast<float>(c.min_loss_scale)),
      window_(c.loss_scale_window),
      hysteresis_(c.hysteresis) {
  state_.scale = initial;
  if (dynamic_) state_.hysteresis_tracker = hysteresis_;
}

float LossScaler::inverse_scale() const {
  return static_cast<float>(1.0 / static_cast<double>(state_.scale));
}

void LossScaler::update(bool found_inf) {
  if (!dynamic_) return;
  if (found_inf) {
    state_.growth_tracker = 0;
    state_.hysteresis_tracker -= 1;
    if (state_.hysteresis_tracker <= 0)
      state_.scale = std::max(state_.scale * kBackoffFactor, min_scale_);
    return;
  }
  state_.growth_tracker += 1;
  if (state_.growth_tracker == window_) {
    state_.growth_tracker = 0;
    state_.hysteresis_tracker = hysteresis_;
    state_.scale = state_.scale * kGrowthFactor;
  }
}

void LossScaler::restore(const LossScalerState& s) {
  if (!(s.scale > 0) || !std::isfinite(s.scale) || s.growth_tracker < 0)
    throw std::invalid_argument(fmt::format(
        "a loss scaler's state needs a positive finite scale and a growth counter of at least 0; "
        "got scale {} and growth counter {}",
        s.scale, s.growth_tracker));
  state_ = s;
}

}  // namespace weave::graphs
