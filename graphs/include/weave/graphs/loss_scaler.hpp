// The loss scaler of 16-bit training, as Megatron-LM's grad_scaler.py has it. An fp16 gradient
// underflows to zero below 2^-24 and overflows to infinity above 65504; the loss is multiplied
// by a scale before the backward, so the gradients land in fp16's range, and the fp32 main
// gradients are multiplied by its inverse before the optimizer reads them. A step whose
// gradients hold an infinity or a NaN on any rank (found_inf, all-reduced) is skipped: no
// parameter or Adam moment changes.
//
//   constant (--loss-scale S): the scale is S for the whole run (Megatron-LM's
//     ConstantGradScaler), with --bf16 or --fp16.
//   dynamic (--fp16 without --loss-scale; Megatron-LM's DynamicGradScaler): from
//     --initial-loss-scale; each step with found_inf takes one off a hysteresis counter
//     (starting at --hysteresis) and zeroes the growth counter; when the hysteresis counter is
//     at zero or below, the scale halves (never below --min-loss-scale). A step without found_inf
//     adds one to the growth counter; at --loss-scale-window clean steps in a row the scale
//     doubles and both counters restart. Megatron-LM's growth and backoff factors are 2 and 0.5,
//     fixed in its optimizer setup.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "weave/graphs/model_config.hpp"

namespace weave::graphs {

// The flags of loss scaling, with Megatron-LM's defaults.
struct LossScaleConfig {
  // --loss-scale: a constant scale; 0 (Megatron-LM's None) gives none, as Megatron-LM's
  // `if config.loss_scale` reads it.
  double loss_scale = 0;
  double initial_loss_scale = 4294967296.0;  // --initial-loss-scale, 2^32
  double min_loss_scale = 1.0;               // --min-loss-scale
  std::int64_t loss_scale_window = 1000;     // --loss-scale-window
  int hysteresis = 2;                        // --hysteresis
};

// Whether a run of `precision` with these flags has a loss scaler (for_run without the checks).
bool has_loss_scaler(Precision precision, const LossScaleConfig& config);

// What a checkpoint keeps of a scaler (Megatron-LM's state_dict: scale, growth_tracker,
// hysteresis_tracker; a constant scaler's trackers stay 0).
struct LossScalerState {
  float scale = 1;
  std::int64_t growth_tracker = 0;
  int hysteresis_tracker = 0;
  friend bool operator==(const LossScalerState&, const LossScalerState&) = default;
};

class LossScaler {
 public:
  // The scaler a run of `precision` has, as Megatron-LM's optimizer setup picks it: constant
  // with --loss-scale in 16-bit runs, dynamic for fp16 without it, none otherwise (fp32, and
  // bf16 without --loss-scale). Throws ConfigError for a value Megatron-LM's asserts refuse
  // (scales not positive, --min-loss-scale above --initial-loss-scale, a window or hysteresis
  // below 1).
  static std::optional<LossScaler> for_run(Precision precision, const LossScaleConfig& config);

  bool dynamic() const { return dynamic_; }
  // The scale the next step multiplies its loss by (fp32, as Megatron-LM keeps it).
  float scale() const { return state_.scale; }
  // 1 / scale in double, rounded to fp32 (Megatron-LM's inv_scale).
  float inverse_scale() const;
  // After a step: whether any rank's gradients were not finite.
  void update(bool found_inf);

  const LossScalerState& state() const { return state_; }
  // Throws std::invalid_argument for a scale that is not positive and finite or negative
  // counters.
  void restore(const LossScalerState& state);

 private:
  LossScaler(bool dynamic, const LossScaleConfig& config, float initial);
  bool dynamic_;
  float min_scale_;
  std::int64_t window_;
  int hysteresis_;
  LossScalerState state_;
};

}  // namespace weave::graphs
