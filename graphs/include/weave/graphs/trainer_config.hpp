// What a training run is: the model, how it is split over devices, the optimizer and its
// learning-rate schedule, how long to train, when to evaluate and save, and which clock times
// the steps. A Trainer (trainer.hpp) runs it; every field is plain data a program can fill from
// its own settings (`weave train` fills it from Megatron-LM's flags, named beside each field).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "weave/devices/cluster.hpp"
#include "weave/graphs/batch_rampup.hpp"
#include "weave/graphs/learning_rate.hpp"
#include "weave/graphs/loss_scaler.hpp"
#include "weave/graphs/model_config.hpp"
#include "weave/graphs/parallel_plan.hpp"
#include "weave/graphs/training_step.hpp"

namespace weave::graphs {

// Which clock an iteration's time is read from.
enum class Timing {
  // Real threads on this host: the step runs on the executor and its time is measured.
  wall,
  // The step is replayed on the virtual clock (--timing model): each task lasts what its cost
  // hints say on the modelled machine, the kernels run one at a time for the real losses, and
  // the time is the replay's makespan. Gives the timeline accelerators would show, the same on
  // every host.
  virtual_clock,
};

// The hardware the virtual clock assumes, and the link the wall clock holds transfers to.
struct ModelledMachine {
  double device_flops = 1e11;  // --device-flops: FLOP/s of every device on the virtual clock
  // --device-memory-bandwidth: bytes/s every device streams on the virtual clock, which prices
  // the element-wise work (norms, residuals, dropout, the optimizer); the default is about what
  // a core of a recent server streams, as the default FLOP/s is about what it computes.
  double device_memory_bandwidth = 2e10;
  // The device's peak FLOP/s, which MFU is measured against; 0: device_flops (--accelerator
  // sets it to the preset's peak and device_flops to what its matrix products sustain).
  double peak_flops = 0;
  // The kernel model (devices::KernelRates), on when attention_flops > 0 (--accelerator, or a
  // calibrated host preset, sets both): matrix products at device_flops slowed by their shapes'
  // small dimensions (matmul_overhead_dimension rows), attention at attention_flops, streaming
  // at device_memory_bandwidth, summed per task. Off: the roofline of device_flops and the
  // memory bandwidth.
  double attention_flops = 0;
  double attention_backward_flops = 0;  // 0: attention_flops
  double matmul_overhead_dimension = 0;
  // What each kernel a compute task stands for costs beyond its work, in the kernel model.
  double kernel_launch_seconds = 0;
  // --link: a devices::LinkModel preset (`weave topo --links`) or "GBPS:MICROSECONDS". On the
  // wall clock a link other than "none" holds each transfer to its modelled time.
  std::string link = "none";
  // The nodes the devices sit in and the links between them (--accelerator's node, or
  // --devices-per-node, --node-link, --network): on the virtual clock collectives are then costed
  // by the algorithm their group would use there. None: every collective is a ring over `link`.
  std::optional<devices::Cluster> cluster;
};

struct TrainerConfig {
  ModelConfig model;
  // The Trainer validates the plan itself (see validate below); data_parallel is part of the
  // plan, so the devices used are plan.devices().
  ParallelPlan plan;
  OptimizerConfig optimizer{
      .adamw = {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1}};
  // --loss-scale, --initial-loss-scale, --min-loss-scale, --loss-scale-window, --hysteresis: the
  // loss scaler of 16-bit runs (loss_scaler.hpp).
  LossScaleConfig loss_scale;
  // `optimizer` as the steps run it: with loss_scaling when the run has a loss scaler.
  OptimizerConfig step_optimizer() const {
    OptimizerConfig o = optimizer;
    o.loss_scaling = has_loss_scaler(model.precision, loss_scale);
    return o;
  }
  // decay_iters 0 means train_iters (validate fills it in).
  LearningRateSchedule learning_rate{.lr = 3e-3, .min_lr = 3e-4, .warmup_iters = 10};

  std::int64_t train_iters = 100;  // --train-iters: the last iteration to train (from 1)
  // --train-samples: > 0 trains by samples, as Megatron-LM does: train_iters is derived from it
  // (iterations_for_samples of batch_rampup.hpp) and the learning rate follows the samples
  // consumed (warmup_samples and decay_samples; warmup_iters and decay_iters must be 0).
  std::int64_t train_samples = 0;
  // --rampup-batch-size START INCREMENT SAMPLES: the global batch grows from START to
  // plan.global_batch_size (batch_rampup.hpp); needs train_samples, as in Megatron-LM.
  BatchRampup rampup;
  // --eval-interval: evaluate every this many iterations (0: never); each evaluation runs
  // eval_iters global batches of the validation data (--eval-iters) and reports their mean loss.
  int eval_interval = 0;
  int eval_iters = 2;
  // --save: the checkpoint written at the end of run() and, with save_interval > 0
  // (--save-interval), every save_interval iterations; with a batch ramp-up also before each
  // iteration whose batch grows, as Megatron-LM saves. "": no checkpoints.
  std::string save_path;
  int save_interval = 0;
  // --load: a checkpoint to resume from when the Trainer is built (its iteration and consumed
  // samples included). "": start from the initial weights.
  std::string load_path;

  Timing timing = Timing::wall;  // --timing wall|model
  ModelledMachine machine;
  // Iterations measured from a trace (exposed communication, pipeline bubble): every multiple of
  // metrics_interval (--log-interval) and trace_iteration. On the virtual clock every iteration
  // is measured, the trace being free.
  int metrics_interval = 10;
  // --trace: Chrome trace-event JSON of iteration trace_iteration (--trace-iteration) is
  // written here. "": none.
  std::string trace_path;
  std::int64_t trace_iteration = 2;
  // Pin each device's worker threads to its cores (when the Trainer builds its own DeviceSet).
  bool pin_devices = true;
  // Build the steps with StepBuildOptions::record_memory (weave train --report charts each
  // device's memory over the step from TrainingStep::memory_events). Changes no result.
  bool record_step_memory = false;
};

// Checks every rule of a training run before anything runs: the plan's size rules (validate of
// parallel_plan.hpp, which also derives the virtual stages and switches off what cannot apply),
// the learning-rate schedule, the iteration counts and intervals, the link preset and the device
// rate, and a batch ramp-up's rules with each of its batches' plan. Fills learning_rate.decay_iters
// when 0; trained by samples, fills train_iters and learning_rate.decay_samples (when 0). Returns
// the warnings (what was switched off); throws ConfigError naming the rule, the value and the
// setting to change. Idempotent: a second call finds nothing more to switch off and returns no
// warnings.
std::vector<std::string> validate(TrainerConfig& config);

}  // namespace weave::graphs
