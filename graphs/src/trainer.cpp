#include "weave/graphs/trainer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
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
  std::optional<rt::TraceMetrics> metrics;
};

}  // namespace

struct Trainer::Impl {
  Impl(TrainerConfig c, std::vector<std::string> w, TrainingData d,
       std::unique_ptr<devices::DeviceSet> owned, devices::DeviceSet* given)
      : config(std::move(c)),
        warnings(std::move(w)),
        data(std::move(d)),
        owned_devices(std::move(owned)),
        devices(given ? *given : *owned_devices),
        step(config.model, config.plan, config.optimizer, devices, comm),
        machine(machine_model(devices, config.machine)),
        clock(machine, {.execute = true, .record_trace = true}),
        flops(step_flops(step.graph())) {
    if (!config.load_path.empty()) load(config.load_path);
  }

  void fill(const SampleSource& samples, std::uint64_t first_sample) {
    fill_micro_batches(step, config.model, config.plan, samples, first_sample);
  }

  // Runs the prepared step once on the configured clock. `traced`: measure it from a trace (the
  // virtual clock records one anyway); `trace_path`: also write that trace there.
  StepTiming run_step(bool traced, const std::string& trace_path) {
    if (config.timing == Timing::virtual_clock) {
      const rt::VirtualRunResult r = clock.run(step.graph());
      if (!trace_path.empty()) rt::write_chrome_trace(r.trace, trace_path);
      const double seconds = static_cast<double>(r.makespan) * 1e-9;
      if (!traced) return {seconds, std::nullopt};
      return {seconds, rt::measure(r.trace)};
    }
    const auto t0 = std::chrono::steady_clock::now();
    const rt::RunResult r = devices.executor().run(
        step.graph(), {.record_trace = traced || !trace_path.empty(),
                       .link_model = machine.links().enabled() ? &machine : nullptr});
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!trace_path.empty()) rt::write_chrome_trace(r.trace, trace_path);
    if (!traced) return {seconds, std::nullopt};
    return {seconds, rt::measure(r.trace)};
  }

  IterationMetrics train_iteration() {
    const std::int64_t it = state.iteration + 1;
    fill(data.train, state.consumed_samples);
    const double lr = config.learning_rate.at(it);
    step.prepare(it, lr);
    step.set_update_parameters(true);
    const bool traced = config.timing == Timing::virtual_clock || it == config.trace_iteration ||
                        it % config.metrics_interval == 0;
    const StepTiming timing =
        run_step(traced, it == config.trace_iteration ? config.trace_path : std::string());
    const StepResult r = step.result();
    state.iteration = it;
    state.consumed_samples += static_cast<std::uint64_t>(config.plan.global_batch_size);
    IterationMetrics m{
        .iteration = it,
        .loss = r.loss,
        .aux_loss = r.aux_loss,
        .grad_norm = r.grad_norm,
        .learning_rate = lr,
        .seconds = timing.seconds,
        .tokens = std::int64_t{config.model.seq_length} * config.plan.global_batch_size,
        .routed_picks = r.routed_picks};
    if (timing.metrics) {
      m.exposed_comm_share = timing.metrics->exposed_comm_share();
      // With pipeline stages the time a stage waits for its next receive is the bubble, not
      // communication to hide: it is reported apart.
      if (config.plan.pipeline_parallel > 1) m.pipeline_bubble = timing.metrics->compute_bubble();
    }
    if (config.model.num_experts > 0 && config.model.moe_expert_capacity_factor > 0)
      m.dropped_picks = r.dropped_picks;
    return m;
  }

  double evaluate() {
    if (!data.valid)
      throw std::logic_error(
          "evaluate() needs validation samples and the data has none: give TrainingData::valid");
    // The step as last prepared (the iteration keys dropout), so an evaluation between
    // iterations sees the model as it was trained.
    const std::int64_t it = std::max<std::int64_t>(state.iteration, 1);
    step.prepare(it, config.learning_rate.at(it));
    step.set_update_parameters(false);
    double sum = 0;
    for (int e = 0; e < config.eval_iters; ++e) {
      fill(data.valid, static_cast<std::uint64_t>(e) *
                           static_cast<std::uint64_t>(config.plan.global_batch_size));
      run_step(false, {});
      sum += step.result().loss;
    }
    step.set_update_parameters(true);
    return sum / std::max(1, config.eval_iters);
  }

  void save(const std::string& path) {
    save_checkpoint(path, config.model, config.plan, step, state);
  }
  void load(const std::string& path) {
    state = load_checkpoint(path, config.model, config.plan, step);
  }

  TrainerConfig config;
  std::vector<std::string> warnings;
  TrainingData data;
  std::unique_ptr<devices::DeviceSet> owned_devices;
  devices::DeviceSet& devices;
  devices::SharedMemoryCommunicator comm;
  TrainingStep step;
  devices::MachineModel machine;
  rt::VirtualClock clock;
  double flops;
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

}  // namespace

Trainer::Trainer(TrainerConfig config, TrainingData data) {
  std::vector<std::string> warnings = validate(config);
  check_data(config, data);
  auto owned = std::make_unique<devices::DeviceSet>(
      config.plan.devices(), devices::DeviceSetOptions{.pin = config.pin_devices});
  impl_ = std::make_unique<Impl>(std::move(config), std::move(warnings), std::move(data),
                                 std::move(owned), nullptr);
}

Trainer::Trainer(TrainerConfig config, TrainingData data, devices::DeviceSet& devices) {
  std::vector<std::string> warnings = validate(config);
  check_data(config, data);
  devices::DeviceSet* given = checked(devices, config);
  impl_ = std::make_unique<Impl>(std::move(config), std::move(warnings), std::move(data), nullptr,
                                 given);
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
  std::int64_t saved_at = -1;
  auto save = [&](const std::string& path) {
    t.save(path);
    saved_at = t.state.iteration;
    if (callbacks.saved) callbacks.saved(path, t.state.iteration);
  };
  while (t.state.iteration < c.train_iters) {
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
  if (summary.seconds > 0) {
    summary.tokens_per_second = static_cast<double>(summary.tokens) / summary.seconds;
    summary.gflops_per_second =
        t.flops * static_cast<double>(summary.iterations) / summary.seconds * 1e-9;
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
  return impl_->step;
}
devices::DeviceSet& Trainer::devices() {
  return impl_->devices;
}

}  // namespace weave::graphs
