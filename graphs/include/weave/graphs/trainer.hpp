// The training loop as a library type: the way to train from C++. A Trainer owns one
// TrainingStep over its devices and runs it iteration after iteration: it lays the data's
// samples into the micro-batches, sets the learning rate from the schedule, times each step on
// the wall clock or the virtual clock, measures communication and the pipeline bubble from
// traces, evaluates on the validation samples, saves and resumes checkpoints and reports every
// iteration to the caller's callbacks.
//
//   weave::graphs::TrainerConfig config;
//   config.model = {.num_layers = 2, .hidden_size = 64, .num_attention_heads = 4};
//   config.plan = {.tensor_parallel = 2, .micro_batch_size = 4, .global_batch_size = 8};
//   config.train_iters = 50;
//   weave::graphs::Trainer trainer(config, weave::graphs::TrainingData::from(
//       weave::graphs::TokenDataset::mock(config.model.seq_length, config.model.seed)));
//   const weave::graphs::TrainingSummary done = trainer.run({
//       .iteration = [](const weave::graphs::IterationMetrics& m) {
//         std::printf("%lld %.4f\n", static_cast<long long>(m.iteration), m.loss);
//         return weave::graphs::TrainingControl::proceed;
//       }});
//
// A run is deterministic: the same configuration and data give bitwise the same losses, on
// either clock, and a run resumed from a checkpoint continues with the losses the uninterrupted
// run had.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "weave/devices/device_set.hpp"
#include "weave/graphs/trainer_config.hpp"
#include "weave/graphs/training_data.hpp"
#include "weave/graphs/training_step.hpp"
#include "weave/runtime/graph.hpp"
#include "weave/runtime/trace.hpp"

namespace weave::graphs {

// What one training iteration did.
struct IterationMetrics {
  std::int64_t iteration = 0;  // from 1
  double loss = 0;             // language-model loss, mean over the global batch's tokens
  double aux_loss = 0;         // MoE load-balancing plus z-loss
  double grad_norm = 0;        // before clipping
  double learning_rate = 0;    // the schedule's rate for this iteration
  double seconds = 0;          // the step's time: measured (wall) or modelled (virtual clock)
  std::int64_t tokens = 0;     // trained on: global batch x seq_length
  // The iteration's global batch (with --rampup-batch-size, the ramp's) and the samples consumed
  // with it, over the whole run (Megatron-LM's "consumed samples").
  std::int64_t global_batch_size = 0;
  std::uint64_t consumed_samples = 0;
  // Exposed communication over the devices' busy time, on iterations measured from a trace
  // (TrainerConfig::metrics_interval).
  std::optional<double> exposed_comm_share;
  // With pipeline parallelism, on measured iterations: compute idle over compute busy, summed
  // over the devices (what the schedules' bubble formulas give).
  std::optional<double> pipeline_bubble;
  // MoE token-to-expert picks of the step, and those full experts dropped: set when routing has
  // a capacity (moe_expert_capacity_factor > 0), dropless routing dropping nothing.
  std::int64_t routed_picks = 0;
  std::optional<std::int64_t> dropped_picks;
  // With a loss scaler (16-bit runs: --fp16, or --loss-scale): the scale this iteration's loss
  // was multiplied by, whether its gradients overflowed and the step was skipped, and the
  // iterations skipped so far in the run (Megatron-LM's "loss scale" and "number of skipped
  // iterations").
  std::optional<double> loss_scale;
  bool skipped = false;
  std::int64_t skipped_iterations = 0;
};

// An evaluation: the mean loss over eval_iters global batches of the validation samples.
struct ValidationResult {
  std::int64_t iteration = 0;  // the iterations trained before it
  double loss = 0;
};

// What the iteration callback tells the Trainer.
enum class TrainingControl {
  proceed,
  // End run() after this iteration's evaluation and interval save, if due; the final save
  // still happens.
  stop,
};

// Called by run(); any may be empty. Each runs on the thread that called run(), between steps.
struct TrainerCallbacks {
  std::function<TrainingControl(const IterationMetrics&)> iteration;
  std::function<void(const ValidationResult&)> validation;
  // After each checkpoint written, with the path and the iteration it holds.
  std::function<void(const std::string& path, std::int64_t iteration)> saved;
  // After the step of iteration trace_iteration ran, with the graph it ran and the spans it
  // recorded (on the wall clock; with Timing::virtual_clock the replay's): what a critical path
  // on the wall clock is read from (rt::wall_critical_path).
  std::function<void(std::int64_t iteration, const rt::Graph& graph, const rt::Trace& trace)>
      traced;
};

// What one run() did.
struct TrainingSummary {
  std::int64_t iterations = 0;  // trained by this run (0 when resumed at train_iters)
  double first_loss = 0, last_loss = 0;
  double seconds = 0;  // the iterations' summed step times, wall or modelled (no evaluation)
  std::int64_t tokens = 0;
  double tokens_per_second = 0;  // 0 when no time passed
  // The FLOPs of the graph's compute tasks (the cost hints the virtual clock charges) per
  // second of step time, in GFLOP/s: the rate of model math, comparable across clocks.
  double gflops_per_second = 0;
  bool stopped = false;  // a callback returned TrainingControl::stop
};

class Trainer {
 public:
  // Validates `config` (validate of trainer_config.hpp: throws ConfigError naming the rule),
  // checks the data against it (evaluation needs data.valid), builds plan.devices() devices of
  // its own, the shared-memory communicator and the step's graph, and resumes from
  // config.load_path if set (throws std::runtime_error for a missing, damaged or mismatched
  // checkpoint).
  Trainer(TrainerConfig config, TrainingData data);
  // The same on the caller's devices, which must number plan.devices() and outlive the
  // Trainer (one DeviceSet can serve Trainers one after another).
  Trainer(TrainerConfig config, TrainingData data, devices::DeviceSet& devices);
  // A run spread over processes (or any backend of the caller's): each process builds the
  // ranks of the devices `comm` holds, on `devices` holding the same devices (both outlive the
  // Trainer), and every process constructs its Trainer and calls run() alike. The results are
  // summed over the processes (every process sees the whole step's losses, bitwise those of one
  // process), a trace is merged by process 0 with every process's spans on its clock, and
  // checkpoints are saved as one part per process (checkpoint.hpp). Throws ConfigError when
  // the two disagree on which devices are held here, or for the virtual clock across processes.
  Trainer(TrainerConfig config, TrainingData data, devices::DeviceSet& devices,
          devices::Communicator& comm);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // The configuration as validated: decay_iters filled, the plan's derived fields set and what
  // validation switched off cleared.
  const TrainerConfig& config() const;
  // What validation switched off, one sentence each.
  const std::vector<std::string>& warnings() const;
  const TrainingData& data() const;

  // Trains iterations iteration() + 1 to config().train_iters (none when already there),
  // evaluating every eval_interval iterations, saving every save_interval, before each iteration
  // whose ramp-up batch grows and at the end, and
  // writing the trace of trace_iteration when it is among them. Throws std::runtime_error when
  // the loss stops being finite (after reporting that iteration), and whatever a step's task or
  // a callback throws; the iterations done so far stay done.
  TrainingSummary run(const TrainerCallbacks& callbacks = {});

  // The mean loss over eval_iters global batches of the validation samples (from sample 0,
  // the same batches every time), without updating the parameters. Throws std::logic_error
  // when the data has no validation samples.
  double evaluate();

  // Writes the model, optimizer state, iteration() and consumed_samples() to `path`
  // atomically; load() restores them. load throws std::runtime_error, changing nothing, for a
  // missing or damaged file or one of another model or plan.
  void save(const std::string& path);
  void load(const std::string& path);

  std::int64_t iteration() const;  // iterations completed, loaded ones included
  std::uint64_t consumed_samples() const;

  // The step the Trainer runs, for what the loop does not do (its graph, shards, activations):
  // with a batch ramp-up, the step of the batch trained last (the ramp's first before any).
  TrainingStep& step();
  devices::DeviceSet& devices();
  // The processes of the run (the communicator's): one unless it spans processes.
  devices::ProcessSet& processes();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace weave::graphs
