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

// A decay length of 0 (not given) decays over the whole run.
void derive_decay_iters(TrainerConfig& c) {
  if (c.train_samples > 0) {
    if (c.learning_rate.decay_samples == 0) c.learning_rate.decay_samples = c.train_samples;
    return;
  }
  if (c.learning_rate.decay_iters == 0) c.learning_rate.decay_iters = c.train_iters;
}

// Training by samples (Megatron-LM's rules of --train-samples beside the iteration flags), and a
// batch ramp-up, which needs it; fills train_iters from the samples.
void derive_sample_training(TrainerConfig& c) {
  const LearningRateSchedule& lr = c.learning_rate;
  if (c.train_samples < 0) refuse("--train-samples must be >= 1, got {}", c.train_samples);
  if (lr.warmup_samples < 0 || lr.decay_samples < 0)
    refuse("--lr-warmup-samples ({}) and --lr-decay-samples ({}) must be >= 0", lr.warmup_samples,
           lr.decay_samples);
  if (c.train_samples == 0) {
    if (c.rampup.enabled())
      refuse(
          "--rampup-batch-size {} {} {} needs a run trained by samples, as Megatron-LM requires "
          "(it refuses ramp-up with --train-iters): give --train-samples, and the schedule in "
          "samples (--lr-warmup-samples, --lr-decay-samples), instead of --train-iters",
          c.rampup.start, c.rampup.increment, c.rampup.samples);
    if (lr.warmup_samples > 0 || lr.decay_samples > 0)
      refuse(
          "--lr-warmup-samples ({}) and --lr-decay-samples ({}) apply to a run trained by "
          "samples: give --train-samples, or the schedule in iterations (--lr-warmup-iters, "
          "--lr-decay-iters)",
          lr.warmup_samples, lr.decay_samples);
    return;
  }
  if (lr.warmup_iters != 0 || lr.decay_iters != 0)
    refuse(
        "--train-samples {} trains by samples and the schedule is given in iterations "
        "(--lr-warmup-iters {}, --lr-decay-iters {}), which Megatron-LM refuses: give "
        "--lr-warmup-samples and --lr-decay-samples instead",
        c.train_samples, lr.warmup_iters, lr.decay_iters);
  const ParallelPlan& p = c.plan;
  if (c.rampup.enabled()) {
    check_batch_rampup(c.rampup, p.global_batch_size,
                       std::int64_t{p.micro_batch_size} * p.data_parallel);
    // Every batch of the ramp must suit the plan (a pipeline schedule's micro-batch rules).
    for (std::int64_t b = c.rampup.start; b < p.global_batch_size; b += c.rampup.increment) {
      TrainerConfig at = c;
      at.plan.global_batch_size = static_cast<int>(b);
      try {
        (void)validate(at.model, at.plan);
      } catch (const ConfigError& e) {
        refuse("--rampup-batch-size {} {} {}: the ramp's global batch {} breaks a rule: {}",
               c.rampup.start, c.rampup.increment, c.rampup.samples, b, e.what());
      }
    }
  }
  c.train_iters = iterations_for_samples(c.rampup, p.global_batch_size, c.train_samples);
  if (c.train_iters < 1)
    refuse(
        "--train-samples {} is less than one global batch ({}): train at least one batch's "
        "samples",
        c.train_samples, c.rampup.enabled() ? c.rampup.start : p.global_batch_size);
}

void check_train_iters(const TrainerConfig& c) {
  if (c.train_iters < 1)
    refuse("--train-iters must be >= 1, got {}: set how many iterations to train", c.train_iters);
}

void check_learning_rate(const LearningRateSchedule& schedule) {
  try {
    schedule.at(1);  // refuses an unknown decay style and min_lr outside [0, lr]
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  }
  if (!(schedule.lr >= 0) || !std::isfinite(schedule.lr))
    refuse("--lr must be a finite number >= 0, got {}", schedule.lr);
  if (schedule.warmup_iters < 0)
    refuse("--lr-warmup-iters must be >= 0, got {}", schedule.warmup_iters);
}

// Megatron-LM saves at --save-interval only with --save (training.py): a script giving the
// interval without the path saves nothing, and runs.
void drop_save_interval_without_save(TrainerConfig& c, std::vector<std::string>& warnings) {
  if (c.save_interval <= 0 || !c.save_path.empty()) return;
  warnings.push_back(fmt::format(
      "--save-interval {} has no effect without --save, as in Megatron-LM: name the checkpoint "
      "file with --save to save every {} iterations",
      c.save_interval, c.save_interval));
  c.save_interval = 0;
}

void check_eval_and_save_intervals(const TrainerConfig& c) {
  if (c.eval_interval < 0)
    refuse("--eval-interval must be >= 0 (0: no evaluation), got {}", c.eval_interval);
  if (c.eval_iters < 1)
    refuse("--eval-iters must be >= 1, got {}: an evaluation averages that many batches",
           c.eval_iters);
  if (c.save_interval < 0)
    refuse("--save-interval must be >= 0 (0: save at the end only), got {}", c.save_interval);
}

void check_log_and_trace(const TrainerConfig& c) {
  if (c.metrics_interval < 1) refuse("--log-interval must be >= 1, got {}", c.metrics_interval);
  if (c.trace_iteration < 1) refuse("--trace-iteration must be >= 1, got {}", c.trace_iteration);
  if (!c.trace_path.empty() && c.trace_iteration > c.train_iters)
    refuse(
        "--trace-iteration {} is beyond the run's last iteration, --train-iters {}: the trace "
        "would never be written; choose an iteration from 1 to {}",
        c.trace_iteration, c.train_iters, c.train_iters);
}

void check_optimizer(const OptimizerConfig& optimizer) {
  // AdamW's moments decay by beta each step: 1 or more never forgets, below 0 oscillates.
  const ops::AdamWOptions& adam = optimizer.adamw;
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
  if (!(optimizer.clip_grad >= 0) || !std::isfinite(optimizer.clip_grad))
    refuse("--clip-grad must be >= 0 (0: no clipping), got {}", optimizer.clip_grad);
}

// The loss terms' weights and the initialisation's spread.
void check_loss_weights_and_init(const ModelConfig& m) {
  if (!(m.moe_aux_loss_coeff >= 0) || !std::isfinite(m.moe_aux_loss_coeff))
    refuse("--moe-aux-loss-coeff must be >= 0, got {}: a negative weight rewards imbalance",
           m.moe_aux_loss_coeff);
  if (!(m.moe_z_loss_coeff >= 0) || !std::isfinite(m.moe_z_loss_coeff))
    refuse(
        "--moe-z-loss-coeff must be >= 0, got {}: a negative weight rewards large router "
        "logits",
        m.moe_z_loss_coeff);
  if (!(m.init_method_std > 0) || !std::isfinite(m.init_method_std))
    refuse("--init-method-std must be a finite number > 0, got {}", m.init_method_std);
}

// The modelled device's rates and link preset.
void check_machine(const ModelledMachine& machine) {
  if (!std::isfinite(machine.device_flops) || machine.device_flops <= 0)
    refuse("--device-flops must be a finite number > 0, got {}", machine.device_flops);
  if (!std::isfinite(machine.device_memory_bandwidth) || machine.device_memory_bandwidth <= 0)
    refuse("--device-memory-bandwidth must be a finite number of bytes/s > 0, got {}",
           machine.device_memory_bandwidth);
  try {
    devices::LinkModel::preset(machine.link);
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  }
}

}  // namespace

std::vector<std::string> validate(TrainerConfig& c) {
  std::vector<std::string> warnings = validate(c.model, c.plan);
  derive_sample_training(c);
  check_train_iters(c);
  derive_decay_iters(c);
  check_learning_rate(c.learning_rate);
  check_eval_and_save_intervals(c);
  drop_save_interval_without_save(c, warnings);
  check_log_and_trace(c);
  check_optimizer(c.optimizer);
  check_loss_weights_and_init(c.model);
  check_machine(c.machine);
  return warnings;
}

}  // namespace weave::graphs
