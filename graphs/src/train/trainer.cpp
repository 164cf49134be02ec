#include "weave/graphs/trainer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string_view>
#include <utility>

#include "weave/devices/machine_model.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/checkpoint.hpp"
#include "weave/graphs/virtual_replay.hpp"
#include "weave/runtime/chrome_trace.hpp"
#include "weave/runtime/trace_metrics.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::graphs {

namespace {

// The FLOPs of one step: the sum of its compute tasks' cost hints (what the virtual clock
// charges), so the rate reported on the wall clock and the virtual clock's agree.
double step_flops(const rt::Graph& graph) {
  double flops = 0;
  for (rt::TaskId t = 0; t < graph.size(); ++t)
    flops += graph.tasks()[t].cost.flops;
  return flops;
}

// Refuses data the configuration cannot train on, before any device is built.
void check_data(const TrainerConfig& config, const TrainingData& data) {
  if (!data.train)
    throw ConfigError("the training data has no training samples: set TrainingData::train");
  if (config.eval_interval > 0 && !data.valid)
    throw ConfigError(fmt::format(
        "--eval-interval {} needs validation samples and the data has none: give "
        "TrainingData::valid (a text long enough to hold some back), or set --eval-interval 0",
        config.eval_interval));
}

// One step's time and, when it was traced, what the trace shows.
struct StepTiming {
  double seconds = 0;
  std::optional<double> exposed_comm_share, compute_bubble;
};

std::int64_t steady_ns(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// The ranks this process builds: every rank, or those of the devices a multi-process
// communicator holds here.
StepBuildOptions held_ranks(const devices::Communicator& comm, const ParallelPlan& plan) {
  StepBuildOptions options;
  for (int r = 0; r < plan.devices(); ++r)
    if (comm.holds(static_cast<rt::DeviceId>(r))) options.ranks.push_back(r);
  if (static_cast<int>(options.ranks.size()) == plan.devices()) options.ranks.clear();
  return options;
}

// How the Trainer builds a step: the ranks held here, recording the memory when asked to.
StepBuildOptions build_options(const TrainerConfig& c, const devices::Communicator& comm,
                               const ParallelPlan& plan) {
  StepBuildOptions options = held_ranks(comm, plan);
  options.record_memory = c.record_step_memory;
  return options;
}

// What a trace of the devices held here shows, over every process: exposed communication over
// busy time and the compute bubble, each a ratio of sums over the devices (of every process).
StepTiming measured(const rt::Trace& trace, const devices::DeviceSet& devices,
                    devices::ProcessSet& processes, double seconds) {
  const rt::TraceMetrics metrics = rt::measure(trace);
  if (processes.size() == 1)
    return {seconds, metrics.exposed_comm_share(), metrics.compute_bubble()};
  double sums[4] = {0, 0, 0, 0};  // exposed, busy, compute idle, compute busy
  for (std::size_t d = 0; d < metrics.devices.size(); ++d) {
    if (!devices.holds(static_cast<rt::DeviceId>(d))) continue;
    const rt::DeviceMetrics& m = metrics.devices[d];
    sums[0] += static_cast<double>(m.exposed_comm);
    sums[1] += static_cast<double>(m.busy);
    sums[2] += static_cast<double>(metrics.makespan - m.compute_busy);
    sums[3] += static_cast<double>(m.compute_busy);
  }
  processes.sum(sums);
  return {seconds, sums[1] > 0 ? sums[0] / sums[1] : 0, sums[3] > 0 ? sums[2] / sums[3] : 0};
}

// Writes the trace of a step every process ran: each process's spans moved onto process 0's
// clock (the run started at `started`, on this process's clock) and merged by process 0.
void write_trace(const rt::Trace& trace, std::chrono::steady_clock::time_point started,
                 devices::ProcessSet& processes, const std::string& path) {
  if (processes.size() == 1) return rt::write_chrome_trace(trace, path);
  std::ostringstream json;
  json << (steady_ns(started) - processes.clock_offset()) << "\n";
  rt::write_chrome_trace(trace, json);
  const std::vector<std::string> all = processes.gather(json.str());
  if (processes.index() != 0) return;
  std::vector<std::string> traces;
  std::vector<rt::Nanos> shifts;
  rt::Nanos first = 0;
  for (std::size_t p = 0; p < all.size(); ++p) {
    const auto line = all[p].find('\n');
    const rt::Nanos start = std::stoll(all[p].substr(0, line));
    if (p == 0) first = start;
    shifts.push_back(start - first);
    traces.push_back(all[p].substr(line + 1));
  }
  rt::merge_chrome_traces(traces, shifts, path);
}

}  // namespace

struct Trainer::Impl {
  Impl(TrainerConfig c, std::vector<std::string> w, TrainingData d,
       std::unique_ptr<devices::DeviceSet> owned, devices::DeviceSet* given,
       devices::Communicator* given_comm)
      : config(std::move(c)),
        warnings(std::move(w)),
        data(std::move(d)),
        owned_devices(std::move(owned)),
        devices(given ? *given : *owned_devices),
        owned_comm(given_comm ? nullptr : std::make_unique<devices::SharedMemoryCommunicator>()),
        comm(given_comm ? *given_comm : *owned_comm),
        machine(machine_model(devices, config.machine)),
        clock(machine, {.execute = true, .record_trace = true}),
        scaler(LossScaler::for_run(config.model.precision, config.loss_scale)) {
    current = &built(batch_at(0)).step;
    if (!config.load_path.empty()) load(config.load_path);
  }

  // The global batch of the iteration after `consumed` samples: the ramp's, or the plan's.
  int batch_at(std::uint64_t consumed) const {
    return static_cast<int>(config.rampup.batch_at(consumed, config.plan.global_batch_size));
  }

  // The step of global batch `batch`, built once: a ramp-up trains at a few batches, each for
  // many iterations, and evaluates at the full one.
  struct BatchStep {
    BatchStep(const TrainerConfig& c, ParallelPlan p, devices::DeviceSet& devices,
              devices::Communicator& comm)
        : plan(std::move(p)),
          step(c.model, plan, c.step_optimizer(), devices, comm, build_options(c, comm, plan)),
          flops(step_flops(step.graph())) {}
    ParallelPlan plan;
    TrainingStep step;
    double flops;
  };
  BatchStep& built(int batch) {
    auto found = steps.find(batch);
    if (found != steps.end()) return *found->second;
    ParallelPlan plan = config.plan;
    plan.global_batch_size = batch;
    if (batch != config.plan.global_batch_size) (void)validate(config.model, plan);
    return *steps.emplace(batch, std::make_unique<BatchStep>(config, plan, devices, comm))
                .first->second;
  }

  // The step of global batch `batch` holding the model's state: the state moves to it from the
  // step that trained last when `trains` (steps of smaller batches are then dropped, a ramp never
  // returning to them); an evaluation's step gets a copy.
  BatchStep& use(int batch, bool trains) {
    BatchStep& s = built(batch);
    if (&s.step != current) {
      copy_checkpointed_state(*current, s.step);
      if (trains) {
        current = &s.step;
        std::erase_if(steps, [&](const auto& entry) { return entry.first < batch; });
      }
    }
    return s;
  }

  TrainingStep& step() { return *current; }

  void fill(BatchStep& s, const SampleSource& samples, std::uint64_t first_sample) {
    fill_micro_batches(s.step, config.model, s.plan, samples, first_sample);
  }

  // Runs the prepared step once on the configured clock. `traced`: measure it from a trace (the
  // virtual clock records one anyway); `trace_path`: also write that trace there; `kept`: when
  // set, record the trace and move it there.
  StepTiming run_step(TrainingStep& step, bool traced, const std::string& trace_path,
                      rt::Trace* kept = nullptr) {
    devices::ProcessSet& processes = comm.processes();
    if (config.timing == Timing::virtual_clock) {
      rt::VirtualRunResult r = clock.run(step.graph());
      if (!trace_path.empty()) rt::write_chrome_trace(r.trace, trace_path);
      const double seconds = static_cast<double>(r.makespan) * 1e-9;
      const StepTiming timing =
          traced ? measured(r.trace, devices, processes, seconds) : StepTiming{.seconds = seconds};
      if (kept) *kept = std::move(r.trace);
      return timing;
    }
    const auto t0 = std::chrono::steady_clock::now();
    rt::RunResult r = devices.executor().run(
        step.graph(), {.record_trace = traced || kept || !trace_path.empty(),
                       .link_model = machine.links().enabled() ? &machine : nullptr});
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!trace_path.empty()) write_trace(r.trace, t0, processes, trace_path);
    const StepTiming timing =
        traced ? measured(r.trace, devices, processes, seconds) : StepTiming{.seconds = seconds};
    if (kept) *kept = std::move(r.trace);
    return timing;
  }

  // The step of `iteration`'s graph and spans go to `traced` (TrainerCallbacks::traced).
  std::function<void(std::int64_t, const rt::Graph&, const rt::Trace&)> traced_callback;

  IterationMetrics train_iteration() {
    const std::int64_t it = state.iteration + 1;
    const int batch = batch_at(state.consumed_samples);
    BatchStep& s = use(batch, true);
    TrainingStep& step = s.step;
    fill(s, data.train, state.consumed_samples);
    const std::uint64_t consumed = state.consumed_samples + static_cast<std::uint64_t>(batch);
    // Trained by samples, the schedule counts the samples consumed with this iteration's batch.
    // Skipped iterations do not advance it (Megatron-LM steps its scheduler on updates only).
    const double lr = config.train_samples > 0
                          ? config.learning_rate.at_samples(
                                static_cast<std::int64_t>(consumed - state.skipped_samples))
                          : config.learning_rate.at(it - state.skipped_iterations);
    step.prepare(it, lr);
    if (scaler) {
      step.set_loss_scale(scaler->scale());
      // AdamW counts the updates applied: a skipped step applied none.
      step.set_optimizer_step(it - state.skipped_iterations);
    }
    step.set_update_parameters(true);
    // With --overlap-param-gather the step gathers the last update's shards first and leaves
    // its own ungathered (finish_parameter_gathers).
    gathers_pending = config.plan.distributed_optimizer && config.plan.overlap_param_gather;
    const bool traced = config.timing == Timing::virtual_clock || it == config.trace_iteration ||
                        it % config.metrics_interval == 0;
    const bool keep = traced_callback && it == config.trace_iteration;
    rt::Trace kept;
    const StepTiming timing =
        run_step(step, traced, it == config.trace_iteration ? config.trace_path : std::string(),
                 keep ? &kept : nullptr);
    if (keep) traced_callback(it, step.graph(), kept);
    const StepResult r = step.result();
    const std::optional<double> used_scale =
        scaler ? std::optional<double>(scaler->scale()) : std::nullopt;
    if (scaler) {
      scaler->update(r.found_inf);
      if (r.found_inf) {
        state.skipped_iterations += 1;
        state.skipped_samples += static_cast<std::uint64_t>(batch);
      }
    }
    state.iteration = it;
    state.consumed_samples = consumed;
    flops_done += s.flops;
    IterationMetrics m{.iteration = it,
                       .loss = r.loss,
                       .aux_loss = r.aux_loss,
                       .grad_norm = r.grad_norm,
                       .learning_rate = lr,
                       .seconds = timing.seconds,
                       .tokens = std::int64_t{config.model.seq_length} * batch,
                       .global_batch_size = batch,
                       .consumed_samples = consumed,
                       .routed_picks = r.routed_picks,
                       .loss_scale = used_scale,
                       .skipped = r.found_inf,
                       .skipped_iterations = state.skipped_iterations};
    if (timing.exposed_comm_share) {
      m.exposed_comm_share = timing.exposed_comm_share;
      // With pipeline stages the time a stage waits for its next receive is the bubble, not
      // communication to hide: it is reported apart.
      if (config.plan.pipeline_parallel > 1) m.pipeline_bubble = timing.compute_bubble;
    }
    if (config.model.num_experts > 0 && config.model.moe_expert_capacity_factor > 0)
      m.dropped_picks = r.dropped_picks;
    return m;
  }

  // Gathers the shards the last step updated onto every replica, if that step left them
  // ungathered, as Megatron-LM finishes its parameter gathers before it evaluates or saves.
  void finish_parameter_gathers() {
    if (!gathers_pending) return;
    const rt::Graph& graph = step().parameter_gather_graph();
    if (config.timing == Timing::virtual_clock)
      (void)clock.run(graph);
    else
      (void)devices.executor().run(graph,
                                   {.link_model = machine.links().enabled() ? &machine : nullptr});
    gathers_pending = false;
  }

  double evaluate() {
    if (!data.valid)
      throw std::logic_error(
          "evaluate() needs validation samples and the data has none: give TrainingData::valid");
    finish_parameter_gathers();
    // The step as last prepared (the iteration keys dropout), so an evaluation between
    // iterations sees the model as it was trained.
    // Evaluation batches are full global batches, during a ramp-up too (as Megatron-LM's
    // evaluate takes --global-batch-size).
    const std::int64_t it = std::max<std::int64_t>(state.iteration, 1);
    BatchStep& s = use(config.plan.global_batch_size, false);
    TrainingStep& step = s.step;
    step.prepare(
        it, config.train_samples > 0
                ? config.learning_rate.at_samples(static_cast<std::int64_t>(state.consumed_samples))
                : config.learning_rate.at(it));
    step.set_update_parameters(false);
    double sum = 0;
    for (int e = 0; e < config.eval_iters; ++e) {
      fill(s, data.valid,
           static_cast<std::uint64_t>(e) * static_cast<std::uint64_t>(s.plan.global_batch_size));
      run_step(step, false, {});
      sum += step.result().loss;
    }
    step.set_update_parameters(true);
    return sum / std::max(1, config.eval_iters);
  }

  void save(const std::string& path) {
    finish_parameter_gathers();
    state.loss_scaler = scaler ? std::optional<LossScalerState>(scaler->state()) : std::nullopt;
    save_checkpoint(path, config.model, config.plan, step(), state);
  }
  void load(const std::string& path) {
    state = load_checkpoint(path, config.model, config.plan, step());
    // A checkpoint of a run with a scaler resumes its state; one without (an fp32 or bf16 run's
    // main parameters and moments are the same fp32 values) starts the scaler afresh.
    if (scaler && state.loss_scaler) scaler->restore(*state.loss_scaler);
  }

  TrainerConfig config;
  std::vector<std::string> warnings;
  TrainingData data;
  std::unique_ptr<devices::DeviceSet> owned_devices;
  devices::DeviceSet& devices;
  std::unique_ptr<devices::Communicator> owned_comm;
  devices::Communicator& comm;
  devices::MachineModel machine;
  rt::VirtualClock clock;
  std::map<int, std::unique_ptr<BatchStep>> steps;  // by global batch
  TrainingStep* current = nullptr;                  // the step holding the trained state
  double flops_done = 0;             // the FLOPs of the iterations trained by this Trainer
  bool gathers_pending = false;      // the last step's updated shards are not gathered yet
  std::optional<LossScaler> scaler;  // 16-bit runs with one (LossScaler::for_run)
  CheckpointState state;
};

namespace {

devices::DeviceSet* checked(devices::DeviceSet& devices, const TrainerConfig& config) {
  if (static_cast<int>(devices.size()) != config.plan.devices())
    throw ConfigError(fmt::format(
        "the DeviceSet holds {} devices and the plan needs tensor x context x data x pipeline "
        "parallel = {}: build it with plan.devices() devices",
        devices.size(), config.plan.devices()));
  return &devices;
}

devices::Communicator* checked(devices::Communicator& comm, const devices::DeviceSet& devices,
                               const TrainerConfig& config) {
  for (int d = 0; d < config.plan.devices(); ++d)
    if (comm.holds(static_cast<rt::DeviceId>(d)) != devices.holds(static_cast<rt::DeviceId>(d)))
      throw ConfigError(fmt::format(
          "device {} is {} by the communicator's process but {} by the DeviceSet: build the "
          "DeviceSet with DeviceSetOptions::held = the devices the communicator holds",
          d, comm.holds(static_cast<rt::DeviceId>(d)) ? "held" : "not held",
          devices.holds(static_cast<rt::DeviceId>(d)) ? "held" : "not held"));
  // Each batch of a ramp builds a step of its own, and the processes' backends agree on one
  // graph's collectives at a time (Communicator::commit): not tried across processes yet.
  if (comm.processes().size() > 1 && config.rampup.enabled())
    throw ConfigError(
        "--rampup-batch-size builds a step for each batch of the ramp, which a run across "
        "processes (mpirun) does not do yet: run the ramp without mpirun, or train at "
        "--global-batch-size");
  if (comm.processes().size() > 1 && config.timing == Timing::virtual_clock)
    throw ConfigError(
        "--timing model replays the whole step on one virtual clock in one process, and this run "
        "spans processes: time it on the wall clock (--timing wall), or replay it without "
        "mpirun");
  return &comm;
}

}  // namespace

Trainer::Trainer(TrainerConfig config, TrainingData data) {
  std::vector<std::string> warnings = validate(config);
  check_data(config, data);
  auto owned = std::make_unique<devices::DeviceSet>(
      config.plan.devices(), devices::DeviceSetOptions{.pin = config.pin_devices});
  impl_ = std::make_unique<Impl>(std::move(config), std::move(warnings), std::move(data),
                                 std::move(owned), nullptr, nullptr);
}

Trainer::Trainer(TrainerConfig config, TrainingData data, devices::DeviceSet& devices) {
  std::vector<std::string> warnings = validate(config);
  check_data(config, data);
  devices::DeviceSet* given = checked(devices, config);
  impl_ = std::make_unique<Impl>(std::move(config), std::move(warnings), std::move(data), nullptr,
                                 given, nullptr);
}

Trainer::Trainer(TrainerConfig config, TrainingData data, devices::DeviceSet& devices,
                 devices::Communicator& comm) {
  std::vector<std::string> warnings = validate(config);
  check_data(config, data);
  devices::DeviceSet* given = checked(devices, config);
  devices::Communicator* given_comm = checked(comm, devices, config);
  impl_ = std::make_unique<Impl>(std::move(config), std::move(warnings), std::move(data), nullptr,
                                 given, given_comm);
}

Trainer::~Trainer() = default;

const TrainerConfig& Trainer::config() const {
  return impl_->config;
}
const std::vector<std::string>& Trainer::warnings() const {
  return impl_->warnings;
}
const TrainingData& Trainer::data() const {
  return impl_->data;
}

TrainingSummary Trainer::run(const TrainerCallbacks& callbacks) {
  Impl& t = *impl_;
  const TrainerConfig& c = t.config;
  TrainingSummary summary;
  t.traced_callback = callbacks.traced;
  const double flops_before = t.flops_done;
  std::int64_t saved_at = -1;
  auto save = [&](const std::string& path) {
    t.save(path);
    saved_at = t.state.iteration;
    if (callbacks.saved) callbacks.saved(path, t.state.iteration);
  };
  // A ramp-up saves before each iteration whose batch differs from the one before (with --save),
  // as Megatron-LM saves whenever the number of micro-batches changes.
  int batch = t.batch_at(t.state.consumed_samples);
  while (t.state.iteration < c.train_iters) {
    const int next = t.batch_at(t.state.consumed_samples);
    if (next != batch && !c.save_path.empty() && saved_at != t.state.iteration) save(c.save_path);
    batch = next;
    const IterationMetrics m = t.train_iteration();
    if (summary.iterations++ == 0) summary.first_loss = m.loss;
    summary.last_loss = m.loss;
    summary.seconds += m.seconds;
    summary.tokens += m.tokens;
    const TrainingControl control =
        callbacks.iteration ? callbacks.iteration(m) : TrainingControl::proceed;
    if (!std::isfinite(m.loss))
      throw std::runtime_error(
          fmt::format("the loss is {} at iteration {}: lower --lr or raise "
                      "--clip-grad's strictness",
                      m.loss, m.iteration));
    if (c.eval_interval > 0 && m.iteration % c.eval_interval == 0) {
      const ValidationResult v{.iteration = m.iteration, .loss = t.evaluate()};
      if (callbacks.validation) callbacks.validation(v);
    }
    if (c.save_interval > 0 && m.iteration % c.save_interval == 0 && !c.save_path.empty())
      save(c.save_path);
    if (control == TrainingControl::stop) {
      summary.stopped = true;
      break;
    }
  }
  if (!c.save_path.empty() && saved_at != t.state.iteration) save(c.save_path);
  // Whatever reads the parameters next (the caller, a decoder) reads them gathered.
  t.finish_parameter_gathers();
  if (summary.seconds > 0) {
    summary.tokens_per_second = static_cast<double>(summary.tokens) / summary.seconds;
    summary.gflops_per_second = (t.flops_done - flops_before) / summary.seconds * 1e-9;
  }
  return summary;
}

double Trainer::evaluate() {
  return impl_->evaluate();
}
void Trainer::save(const std::string& path) {
  impl_->save(path);
}
void Trainer::load(const std::string& path) {
  impl_->load(path);
}
std::int64_t Trainer::iteration() const {
  return impl_->state.iteration;
}
std::uint64_t Trainer::consumed_samples() const {
  return impl_->state.consumed_samples;
}
TrainingStep& Trainer::step() {
  return impl_->step();
}
devices::DeviceSet& Trainer::devices() {
  return impl_->devices;
}
devices::ProcessSet& Trainer::processes() {
  return impl_->comm.processes();
}

}  // namespace weave::graphs
