#include "train_advice.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include "weave/devices/link_model.hpp"
#include "weave/graphs/pipeline_layout.hpp"
#include "weave/graphs/virtual_replay.hpp"
#include "weave/runtime/trace_metrics.hpp"

namespace weave::cli {

// Every Ampipe degree the rules allow, fastest named. `fast`: replay without running the kernels.
int advise_ampipe(const graphs::TrainerConfig& config, const graphs::SampleSource& samples,
                  bool fast) {
  const devices::LinkModel links = devices::LinkModel::preset(config.machine.link);
  const int devices = config.plan.devices();
  fmt::print(
      "Ampipe degrees for this configuration on the virtual clock ({} devices of {:.3g} "
      "FLOP/s, link {}{}):\n",
      devices, config.machine.device_flops, links.describe(),
      fast ? "; kernels not run, all-to-alls timed for balanced routing" : "");
  fmt::print("{:>7} {:>11} {:>20} {:>19} {:>9}\n", "degree", "step (ms)", "exposed comm (ms/dev)",
             "exposed a2a (ms/dev)", "speed-up");
  double baseline = 0, best_time = 0;
  int best = 1;
  for (int degree = 1; degree <= 16; degree *= 2) {
    graphs::TrainerConfig candidate = config;
    candidate.plan.ampipe_degree = degree;
    try {
      const std::vector<std::string> warnings = graphs::validate(candidate.model, candidate.plan);
      const rt::VirtualRunResult r = graphs::replay_step(candidate, samples, !fast);
      const rt::TraceMetrics metrics = rt::measure(r.trace);
      constexpr std::string_view kAllToAll[] = {"dispatch", "combine"};
      const double per_device = 1e-6 / static_cast<double>(devices);
      const double ms = static_cast<double>(r.makespan) * 1e-6;
      if (degree == 1) baseline = ms;
      if (best_time == 0 || ms < best_time) {
        best_time = ms;
        best = degree;
      }
      fmt::print("{:>7} {:>11.3f} {:>20.3f} {:>19.3f} {:>8.2f}x\n", degree, ms,
                 static_cast<double>(metrics.total_exposed_comm()) * per_device,
                 static_cast<double>(rt::exposed_comm_named(r.trace, kAllToAll)) * per_device,
                 baseline > 0 ? baseline / ms : 1.0);
      for (const std::string& w : warnings)
        fmt::print("        ({})\n", w);
    } catch (const graphs::ConfigError& e) {
      if (degree == 1) throw;
      fmt::print("{:>7} not possible: {}\n", degree, e.what());
    }
  }
  fmt::print("best: --ampipe-degree {}\n", best);
  return 0;
}

// Every pipeline schedule (a MoE model's kernels run, so its routing is real): the step time,
// the bubble measured in the training graph beside the schedule's formula, and the activation
// memory each stage holds. The fastest is named.
int advise_pipeline(const graphs::TrainerConfig& config, const graphs::SampleSource& samples) {
  const graphs::ParallelPlan& base = config.plan;
  if (base.pipeline_parallel < 2)
    throw graphs::ConfigError(
        "--pipeline-advise compares pipeline schedules: set --pipeline-model-parallel-size >= 2");
  const devices::LinkModel links = devices::LinkModel::preset(config.machine.link);
  const int p = base.pipeline_parallel;
  fmt::print(
      "Pipeline schedules for this configuration on the virtual clock ({} devices of {:.3g} "
      "FLOP/s, link {}; p = {}, {} micro-batches):\n",
      base.devices(), config.machine.device_flops, links.describe(), p, base.micro_batches());
  fmt::print("{:<16} {:>2} {:>10} {:>16} {:>14}  {}\n", "schedule", "v", "step (ms)",
             "bubble measured", "bubble theory", "activations per stage: sets, MiB");
  std::string best;
  double best_time = 0;
  for (const std::string& name : graphs::schedule_names()) {
    graphs::TrainerConfig candidate = config;
    graphs::ParallelPlan& plan = candidate.plan;
    plan.pipeline_scheduler = name;
    plan.layers_per_virtual_stage = 0;
    const graphs::ScheduleKind kind = graphs::schedule_kind(name);
    const bool chunked = kind == graphs::ScheduleKind::Interleaved ||
                         kind == graphs::ScheduleKind::InterleavedMem ||
                         kind == graphs::ScheduleKind::ZeroBubbleV;
    plan.virtual_pipeline = chunked ? std::max(2, base.virtual_pipeline) : 1;
    if (kind == graphs::ScheduleKind::ZeroBubbleV) plan.virtual_pipeline = 2;
    if (kind != graphs::ScheduleKind::Interleaved) plan.microbatch_group_size = 0;
    try {
      graphs::validate(candidate.model, plan);
      std::string memory;
      // A dense model's costs do not depend on the data: its kernels need not run.
      const rt::VirtualRunResult r = graphs::replay_step(
          candidate, samples, candidate.model.num_experts > 0,
          [&](graphs::TrainingStep& step, devices::DeviceSet& set) {
            for (int stage = 0; stage < p; ++stage) {
              const int rank = step.mesh().rank_of(0, 0, 0, stage);
              memory += fmt::format(
                  "{}{}, {:.1f}", stage > 0 ? " | " : "", step.activation_sets(rank),
                  static_cast<double>(set.memory().peak(static_cast<rt::DeviceId>(rank),
                                                        rt::MemoryCategory::activations)) /
                      (1 << 20));
            }
          });
      const graphs::ScheduleTheory theory =
          graphs::schedule_theory(kind, {.ranks = p,
                                         .micro_batches = plan.micro_batches(),
                                         .chunks = plan.virtual_pipeline,
                                         .group_size = plan.microbatch_group_size});
      const double ms = static_cast<double>(r.makespan) * 1e-6;
      if (best_time == 0 || ms < best_time) {
        best_time = ms;
        best = name;
      }
      // Idle over busy compute: the schedule's bubble plus whatever communication, loss and
      // optimizer the step leaves exposed.
      fmt::print("{:<16} {:>2} {:>10.3f} {:>16.3f} {:>14.3f}  {}\n", name, plan.virtual_pipeline,
                 ms, rt::measure(r.trace).compute_bubble(), theory.bubble_over_ideal, memory);
    } catch (const graphs::ConfigError& e) {
      fmt::print("{:<16} not possible: {}\n", name, e.what());
    }
  }
  if (best.empty())
    throw graphs::ConfigError("no pipeline schedule can run this configuration (see above)");
  fmt::print("best: --pipeline-scheduler {}\n", best);
  return 0;
}

}  // namespace weave::cli
