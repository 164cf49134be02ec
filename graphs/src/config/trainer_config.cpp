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
  if (!(c.learning_rate.lr >= 0) || !std::isfinite(c.learning_rate.lr))
    refuse("--lr must be a finite number >= 0, got {}", c.learning_rate.lr);
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
    refuse(
        "--save-interval {} saves a checkpoint every {} iterations, but there is no --save: "
        "name the checkpoint file with --save, or drop --save-interval",
        c.save_interval, c.save_interval);
  if (c.metrics_interval < 1) refuse("--log-interval must be >= 1, got {}", c.metrics_interval);
  if (c.trace_iteration < 1) refuse("--trace-iteration must be >= 1, got {}", c.trace_iteration);
  if (!c.trace_path.empty() && c.trace_iteration > c.train_iters)
    refuse(
        "--trace-iteration {} is beyond the run's last iteration, --train-iters {}: the trace "
        "would never be written; choose an iteration from 1 to {}",
        c.trace_iteration, c.train_iters, c.train_iters);
  // AdamW's moments decay by beta each step: 1 or more never forgets, below 0 oscillates.
  const ops::AdamWOptions& adam = c.optimizer.adamw;
  if (!(adam.beta1 >= 0 && adam.beta1 < 1))
    refuse("--adam-beta1 must be in [0, 1), got {}: it is the first moment's decay (0.9 is usual)",
           adam.beta1);
  if (!(adam.beta2 >= 0 && adam.beta2 < 1))
    refuse(
        "--adam-beta2 must be in [0, 1), got {}: it is the second moment's decay (0.95 or "
        "0.999 are usual)",
        adam.beta2);
  if (!(adam.eps > 0) || !std::isfinite(adam.eps))
    refuse(
        "--adam-eps must be a finite number > 0, got {}: it keeps the update's denominator "
        "away from 0 (1e-8 is usual)",
        adam.eps);
  if (!(adam.weight_decay >= 0) || !std::isfinite(adam.weight_decay))
    refuse("--weight-decay must be >= 0, got {}", adam.weight_decay);
  if (!(c.optimizer.clip_grad >= 0) || !std::isfinite(c.optimizer.clip_grad))
    refuse("--clip-grad must be >= 0 (0: no clipping), got {}", c.optimizer.clip_grad);
  if (!(c.model.moe_aux_loss_coeff >= 0) || !std::isfinite(c.model.moe_aux_loss_coeff))
    refuse("--moe-aux-loss-coeff must be >= 0, got {}: a negative weight rewards imbalance",
           c.model.moe_aux_loss_coeff);
  if (!(c.model.moe_z_loss_coeff >= 0) || !std::isfinite(c.model.moe_z_loss_coeff))
    refuse(
        "--moe-z-loss-coeff must be >= 0, got {}: a negative weight rewards large router "
        "logits",
        c.model.moe_z_loss_coeff);
  if (!(c.model.init_method_std > 0) || !std::isfinite(c.model.init_method_std))
    refuse("--init-method-std must be a finite number > 0, got {}", c.model.init_method_std);
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
