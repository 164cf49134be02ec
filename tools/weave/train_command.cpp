// `weave train`: trains the GPT-MoE model over simulated devices with Megatron-LM's flags. The
// training loop is graphs::Trainer; this file turns flags into its configuration and its
// callbacks into progress lines.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "advice.hpp"
#include "commands.hpp"
#include "memory_estimate.hpp"
#include "output_paths.hpp"
#include "progress_reporter.hpp"
#include "run_record.hpp"
#include "step_figures.hpp"
#include "step_views.hpp"
#include "train_data.hpp"
#include "train_options.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/mpi_communicator.hpp"
#include "weave/graphs/path_bubble.hpp"
#include "weave/graphs/pipeline_layout.hpp"
#include "weave/graphs/pipeline_schedule_generators.hpp"
#include "weave/graphs/token_dataset.hpp"
#include "weave/graphs/trainer.hpp"
#include "weave/graphs/virtual_replay.hpp"
#include "weave/runtime/critical_path.hpp"

namespace weave::cli {

namespace {

// The run's first line: the model, the split over devices, the batch and the data.
std::string describe(const graphs::TrainerConfig& c, const std::string& data) {
  const graphs::ModelConfig& m = c.model;
  const graphs::ParallelPlan& plan = c.plan;
  return fmt::format(
      "weave train: {} layers, hidden {}, {} heads{}, {}{}{} | {} devices: tp {}{}, cp {}, ep {}, "
      "dp {}{}{} | micro-batch {}, global batch {} ({} micro-batches) | data: {}",
      m.num_layers, m.hidden_size, m.num_attention_heads, heads_width_text(m), moe_text(m),
      m.activation == graphs::Activation::swiglu ? ", SwiGLU" : "",
      m.precision != graphs::Precision::fp32
          ? fmt::format(", {} mixed precision", graphs::precision_name(m.precision))
          : "",
      plan.devices(), plan.tensor_parallel, plan.sequence_parallel ? " + sp" : "",
      plan.context_parallel, plan.expert_parallel, plan.data_parallel,
      plan.ampipe_degree > 1 ? fmt::format(", ampipe {}", plan.ampipe_degree) : "",
      plan.pipeline_parallel > 1
          ? fmt::format(", pp {} ({}{})", plan.pipeline_parallel,
                        graphs::schedule_name(graphs::pipeline_schedule_kind(plan)),
                        plan.virtual_pipeline > 1
                            ? fmt::format(", {} chunks per rank", plan.virtual_pipeline)
                            : "")
          : "",
      plan.micro_batch_size, plan.global_batch_size, plan.micro_batches(), data);
}

// A ramp-up's line: the batches it trains at and over how many samples.
std::string describe_rampup(const graphs::TrainerConfig& c) {
  const graphs::BatchRampup& r = c.rampup;
  const int per_replica = c.plan.micro_batch_size * c.plan.data_parallel;
  return fmt::format(
      "batch ramp-up: global batch {} ({} micro-batches) growing by {} to {} over {} samples; {} "
      "samples in {} iterations",
      r.start, r.start / per_replica, r.increment, c.plan.global_batch_size, r.samples,
      c.train_samples, c.train_iters);
}

// This process's place in an MPI job, from the launcher's environment (0 without one).
int launched_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"})
    if (const char* v = std::getenv(name)) return std::atoi(v);
  return 0;
}

// A run over the processes of an MPI job: the communicator and this process's devices, laid out
// on its own cores.
struct ProcessRun {
  explicit ProcessRun(int devices, bool pin) : comm(devices) {
    devices::Topology topology = devices::Topology::detect();
    const std::vector<int> cores = comm.cores(topology);
    set = std::make_unique<devices::DeviceSet>(
        std::move(topology), devices,
        devices::DeviceSetOptions{.pin = pin, .held = comm.held_devices(), .cores = cores});
  }
  devices::MpiCommunicator comm;
  std::unique_ptr<devices::DeviceSet> set;
};

int train(TrainOptions& o, ProgressReporter& progress, ProcessRun* processes,
          std::shared_ptr<graphs::GptData> indexed);
int run_trainer(TrainOptions& o, ProgressReporter& progress, graphs::Trainer& trainer);

int run_train(TrainOptions o) {
  derive_config(o);
  graphs::TrainerConfig& c = o.config;
  // Under mpirun every process runs this; until training starts they all meet the same errors,
  // which process 0 alone reports.
  const bool launched = devices::MpiCommunicator::launched();
  const bool first = launched_rank() == 0;
  std::unique_ptr<ProcessRun> processes;
  std::unique_ptr<ProgressReporter> progress;
  std::shared_ptr<graphs::GptData> indexed;
  try {
    if (launched && (o.ampipe_advise || o.pipeline_advise))
      throw std::invalid_argument(
          "--ampipe-advise and --pipeline-advise predict steps on the virtual clock in one "
          "process: run them without mpirun");
    if (o.ampipe_advise && o.pipeline_advise)
      throw std::invalid_argument(
          "--ampipe-advise and --pipeline-advise are two searches: give one");
    // Indexed data sets the vocabulary (its tokenizer's) that the checks below count.
    indexed = open_indexed_data(o);
    const std::vector<std::string> warnings = graphs::validate(c);
    // Advice predicts the steps on the modelled machine and allocates nothing here.
    if (o.ampipe_advise || o.pipeline_advise) {
      for (const std::string& w : warnings)
        fmt::print("warning: {}\n", w);
      const std::int64_t capacity = modelled_device_memory(o, 0);
      return o.ampipe_advise ? advise_ampipe(c, capacity, o.no_effect)
                             : advise_pipeline(c, capacity);
    }
    // Every file the run will write, before an hour of training finds one it cannot.
    check_writable("--save", c.save_path);
    check_writable("--trace", c.trace_path);
    check_writable("--dump-graph", o.dump_graph);
    check_writable("--report", o.report);
    (void)step_view_request(o);  // a wrong --graph-filter, --graph-level or --what-if
    (void)figure_request(o, c);  // a wrong --figure, --layer, --figure-device or --figure-out
    check_writable("--log-json", o.log_json);
    // What the devices will hold, before any of it is allocated.
    const MemoryEstimate memory = estimate_memory(c);
    check_fits(memory, host_memory_bytes());
    if (launched) processes = std::make_unique<ProcessRun>(c.plan.devices(), c.pin_devices);
    progress =
        std::make_unique<ProgressReporter>(c.train_iters, c.metrics_interval, o.log_json, first);
    if (!o.no_effect.empty())
      progress->note(
          fmt::format("no effect here: {} (docs/flags.md says why)", fmt::join(o.no_effect, ", ")));
    if (!o.deepspeed_unhonoured.empty())
      progress->note(fmt::format("{}: without effect here: {}", o.deepspeed_config,
                                 fmt::join(o.deepspeed_unhonoured, ", ")));
    if (c.train_samples > 0) progress->show_samples();
    for (const std::string& w : warnings)
      progress->note("warning: " + w);
    progress->note(fmt::format("memory (estimate): {}, of this host's {}", memory.describe(),
                               bytes_text(host_memory_bytes())));
  } catch (const std::exception&) {
    if (!first) throw CommandExit{1};
    throw;
  }
  return train(o, *progress, processes.get(), std::move(indexed));
}

int train(TrainOptions& o, ProgressReporter& progress, ProcessRun* processes,
          std::shared_ptr<graphs::GptData> indexed) {
  graphs::TrainerConfig& c = o.config;
  const bool first = launched_rank() == 0;
  graphs::TrainingData data = training_data(o, std::move(indexed));
  // --report charts each device's memory over the step from what the step's build allocated.
  c.record_step_memory = !o.report.empty();

  std::unique_ptr<graphs::Trainer> built;
  try {
    built = processes ? std::make_unique<graphs::Trainer>(c, std::move(data), *processes->set,
                                                          processes->comm)
                      : std::make_unique<graphs::Trainer>(c, std::move(data));
  } catch (const std::exception&) {
    if (!first) throw CommandExit{1};
    throw;
  }
  graphs::Trainer& trainer = *built;
  const int process_count = trainer.processes().size();
  if (process_count > 1)
    progress.note(fmt::format("{} processes of {} device{} each (mpirun -np {})", process_count,
                              c.plan.devices() / process_count,
                              c.plan.devices() / process_count == 1 ? "" : "s", process_count));
  try {
    return run_trainer(o, progress, trainer);
  } catch (const std::exception& e) {
    if (process_count == 1) throw;
    // The other processes may be waiting for this one: say why, then end the job.
    fmt::print(stderr, "weave: error: process {}: {}\n", trainer.processes().index(), e.what());
    std::fflush(stderr);
    processes->comm.abort(1);
  }
}

// The pipeline schedule's bubble over ideal by its formula, for the progress line to show
// beside the measured one; nothing without pipeline parallelism.
std::optional<double> bubble_theory(const graphs::ParallelPlan& plan) {
  if (plan.pipeline_parallel < 2) return std::nullopt;
  return graphs::schedule_theory(graphs::pipeline_schedule_kind(plan),
                                 {.ranks = plan.pipeline_parallel,
                                  .micro_batches = plan.micro_batches(),
                                  .chunks = plan.virtual_pipeline,
                                  .group_size = plan.microbatch_group_size})
      .bubble_over_ideal;
}

// --critical-path (and --what-if) and --figure on the virtual clock of the modelled machine, then
// --dump-graph with that path drawn heavy.
void show_step(const TrainOptions& o, graphs::Trainer& trainer, ProgressReporter& progress) {
  const StepViewRequest request = step_view_request(o);
  const FigureRequest figure = figure_request(o, trainer.config());
  std::vector<rt::TaskId> path;
  if (request.critical_path || !figure.kind.empty()) {
    const devices::MachineModel machine =
        graphs::machine_model(trainer.devices(), trainer.config().machine);
    const rt::Graph& graph = trainer.step().graph();
    const rt::Trace replay = replay_costs(graph, machine);
    if (request.critical_path) {
      const rt::Trace changed =
          request.what_if.empty()
              ? rt::Trace()
              : replay_costs(graph, rt::WhatIfCostModel(machine, request.what_if));
      path = print_critical_path(graph, replay, request.what_if, changed,
                                 graphs::pipeline_stage_of_devices(trainer.step().mesh()));
    }
    if (!figure.kind.empty()) progress.note(write_figure(figure, replay, trainer.config()));
  }
  if (!request.dump_path.empty())
    progress.note(write_graph_view(trainer.step().graph(), request, path));
}

// The step of iteration --trace-iteration as the run recorded it on the wall clock, and the
// critical path read from its spans: what --critical-path prints after training and --report
// shows beside the modelled machine's.
struct WallStep {
  std::int64_t iteration = 0;
  rt::Trace trace;
  rt::CriticalPath path;
};

// --critical-path, once the run has trained: the path on the wall clock, or why there is none.
void show_wall_path(graphs::Trainer& trainer, std::int64_t first_iteration,
                    const std::optional<WallStep>& wall, ProgressReporter& progress) {
  const graphs::TrainerConfig& c = trainer.config();
  if (c.timing == graphs::Timing::virtual_clock)
    return progress.note(
        "critical path on the wall clock: none, the run was timed on the modelled machine "
        "(--timing model): its path is the virtual clock's above");
  if (trainer.processes().size() > 1)
    return progress.note(
        "critical path on the wall clock: none, each process records the spans of its own "
        "devices only: run the step in one process (without mpirun) to see it");
  if (!wall)
    return progress.note(fmt::format(
        "critical path on the wall clock: none, iteration {} (--trace-iteration) was not trained "
        "by this run: give --trace-iteration from {} to {}",
        c.trace_iteration, first_iteration, c.train_iters));
  print_wall_critical_path(wall->path, wall->trace, wall->iteration,
                           graphs::pipeline_stage_of_devices(trainer.step().mesh()));
}

// --report, once the run has trained: the step replayed on the virtual clock of the modelled
// machine, with its memory over the step from the step's build (placed on that replay), the
// memory each device's tracker saw at its peak over the run, and the critical path the run
// recorded on the wall clock.
void write_train_report(const TrainOptions& o, graphs::Trainer& trainer,
                        const std::optional<WallStep>& wall, ProgressReporter& progress) {
  const devices::MachineModel machine =
      graphs::machine_model(trainer.devices(), trainer.config().machine);
  const rt::Graph& graph = trainer.step().graph();
  const rt::MemoryTracker& memory = trainer.devices().memory();
  std::vector<std::array<std::int64_t, rt::kMemoryCategoryCount>> peaks(memory.device_count());
  for (std::size_t d = 0; d < peaks.size(); ++d)
    for (std::size_t k = 0; k < rt::kMemoryCategoryCount; ++k)
      peaks[d][k] = memory.peak(static_cast<rt::DeviceId>(d), static_cast<rt::MemoryCategory>(k));
  // What train measured, in weave predict's words: the trackers' peaks over the run.
  MemoryEstimate measured{.by_category = peaks};
  for (std::size_t d = 0; d < peaks.size(); ++d)
    measured.peak.push_back(memory.peak_total(static_cast<rt::DeviceId>(d)));
  progress.note(fmt::format("memory (measured): {}", measured.describe()));
  const rt::Trace replay = replay_costs(graph, machine);
  graphs::StepReportInput input{
      .title = "weave train",
      .configuration_json =
          run_record(trainer.config(), trainer.data().description, o.no_effect).dump(),
      .stage_of_device = graphs::pipeline_stage_of_devices(trainer.step().mesh()),
      .memory = std::move(peaks),
      .memory_source = "measured: each device's tracker over the run",
      .memory_over_step =
          graphs::memory_timeline(trainer.step().memory_events(), replay, memory.device_count())};
  // The path of the step the report shows (a batch ramp-up may have trained another since).
  if (wall && &wall->trace.tasks() == &graph.tasks()) {
    input.wall_critical_path = wall->path;
    input.wall_trace = wall->trace;
    input.wall_iteration = wall->iteration;
  }
  progress.note(write_report(o.report, graph, replay, step_view_request(o), std::move(input)));
}

int run_trainer(TrainOptions& o, ProgressReporter& progress, graphs::Trainer& trainer) {
  graphs::TrainerConfig& c = o.config;
  progress.note(describe(trainer.config(), trainer.data().description));
  if (trainer.config().rampup.enabled()) progress.note(describe_rampup(trainer.config()));
  if (!c.trace_path.empty() && c.trace_iteration <= trainer.iteration())
    throw graphs::ConfigError(fmt::format(
        "--trace-iteration {} was trained before the checkpoint --load '{}' (it resumes after "
        "iteration {}): the trace would never be written; choose an iteration from {} to {}",
        c.trace_iteration, c.load_path, trainer.iteration(), trainer.iteration() + 1,
        c.train_iters));
  const std::optional<double> theory = bubble_theory(trainer.config().plan);
  if (theory) progress.set_bubble_theory(*theory);
  progress.record("run", run_record(trainer.config(), trainer.data().description, o.no_effect));
  // A report of too many tasks is refused before the run trains, not after.
  if (!o.report.empty() && trainer.processes().index() == 0)
    graphs::check_report_size(trainer.step().graph().size());
  if (trainer.processes().index() == 0) show_step(o, trainer, progress);
  if (!c.load_path.empty())
    progress.note(fmt::format("resumed from {} at iteration {}", c.load_path, trainer.iteration()));

  const std::int64_t first_iteration = trainer.iteration() + 1;
  std::optional<WallStep> wall;
  const bool wants_wall_path = (o.critical_path || !o.report.empty()) &&
                               trainer.processes().size() == 1 && c.timing == graphs::Timing::wall;
  const graphs::TrainingSummary done = trainer.run(
      {.iteration =
           [&](const graphs::IterationMetrics& m) {
             progress.iteration(m);
             return graphs::TrainingControl::proceed;
           },
       .validation =
           [&](const graphs::ValidationResult& v) { progress.validation(v.iteration, v.loss); },
       .saved =
           [&](const std::string& path, std::int64_t iteration) {
             progress.note(fmt::format("saved {} (iteration {})", path, iteration));
           },
       .traced =
           [&](std::int64_t iteration, const rt::Graph& graph, const rt::Trace& trace) {
             if (wants_wall_path && trace.clock() == rt::ClockKind::wall)
               wall = WallStep{iteration, trace, rt::wall_critical_path(graph, trace)};
           }});
  progress.finish();
  if (o.critical_path && trainer.processes().index() == 0)
    show_wall_path(trainer, first_iteration, wall, progress);
  progress.record("summary", summary_record(done, trainer.iteration()));
  if (!o.report.empty() && trainer.processes().index() == 0)
    write_train_report(o, trainer, wall, progress);
  // Only a trace that is there is named (process 0 writes it).
  const bool traced = !c.trace_path.empty() && std::filesystem::exists(c.trace_path);
  if (done.seconds > 0)
    progress.note(fmt::format(
        "done: loss {:.4f} -> {:.4f} | {:.0f} tokens/s {} | {:.1f} GFLOP/s of model math{}",
        done.first_loss, done.last_loss, done.tokens_per_second,
        c.timing == graphs::Timing::virtual_clock ? "(modelled)" : "(wall)", done.gflops_per_second,
        traced ? fmt::format(" | trace of iteration {}: {}", c.trace_iteration, c.trace_path)
               : ""));
  return 0;
}

}  // namespace

void add_train_command(CLI::App& app) {
  auto o = std::make_shared<TrainOptions>();
  CLI::App* cmd = app.add_subcommand("train", "Train the GPT-MoE model over simulated devices");
  add_train_flags(*cmd, *o);
  cmd->footer(
      "Example:\n"
      "  weave train --num-layers 4 --hidden-size 128 --num-attention-heads 8 --seq-length 128 \\\n"
      "              --num-experts 4 --devices 4 --tensor-model-parallel-size 2 \\\n"
      "              --sequence-parallel --mock-data --train-iters 50 --log-json metrics.jsonl\n"
      "Megatron-LM's and MindSpeed's flags that mean nothing here are accepted and named in\n"
      "one line, \"no effect here: ...\"; those weave cannot honour are refused, saying why.\n"
      "docs/flags.md lists them all.");
  cmd->callback([o] { throw CommandExit{run_train(*o)}; });
}

}  // namespace weave::cli
