#include "weave/graphs/trainer_config.hpp"

#include <fmt/format.h>

#include <cmath>

#include "weave/devices/link_model.hpp"

namespace weave::graphs {

namespace {

template <typename... Args>
[[noreturn]] void refuse(fmt::format_string<Args...> format, Args&&... args) {
  throw ConfigError(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace

std::vector<std::string> validate(TrainerConfig& c) {
  std::vector<std::string> warnings = validate(c.model, c.plan);
  if (c.train_iters < 1)
    refuse("--train-iters must be >= 1, got {}: set how many iterations to train", c.train_iters);
  if (c.learning_rate.decay_iters == 0) c.learning_rate.decay_iters = c.train_iters;
  try {
    c.learning_rate.at(1);  // refuses an unknown decay style and min_lr outside [0, lr]
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  }
  if (c.learning_rate.lr < 0) refuse("--lr must be >= 0, got {}", c.learning_rate.lr);
  if (c.learning_rate.warmup_iters < 0)
    refuse("--lr-warmup-iters must be >= 0, got {}", c.learning_rate.warmup_iters);
  if (c.eval_interval < 0)
    refuse("--eval-interval must be >= 0 (0: no evaluation), got {}", c.eval_interval);
  if (c.eval_iters < 1)
    refuse("--eval-iters must be >= 1, got {}: an evaluation averages that many batches",
           c.eval_iters);
  if (c.save_interval < 0)
    refuse("--save-interval must be >= 0 (0: save at the end only), got {}", c.save_interval);
  if (c.save_interval > 0 && c.save_path.empty())
    warnings.push_back(fmt::format(
        "--save-interval {} has no effect without --save: no checkpoint path", c.save_interval));
  if (c.metrics_interval < 1) refuse("--log-interval must be >= 1, got {}", c.metrics_interval);
  if (c.trace_iteration < 1) refuse("--trace-iteration must be >= 1, got {}", c.trace_iteration);
  if (!std::isfinite(c.machine.device_flops) || c.machine.device_flops <= 0)
    refuse("--device-flops must be a finite number > 0, got {}", c.machine.device_flops);
  if (!std::isfinite(c.machine.device_memory_bandwidth) || c.machine.device_memory_bandwidth <= 0)
    refuse("--device-memory-bandwidth must be a finite number of bytes/s > 0, got {}",
           c.machine.device_memory_bandwidth);
  try {
    devices::LinkModel::preset(c.machine.link);
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  }
  return warnings;
}

}  // namespace weave::graphs
