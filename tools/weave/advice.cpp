#include "advice.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "memory_estimate.hpp"
#include "weave/devices/link_model.hpp"
#include "weave/graphs/config_flags.hpp"
#include "weave/graphs/mesh.hpp"
#include "weave/graphs/pipeline_layout.hpp"
#include "weave/graphs/pipeline_schedule_generators.hpp"
#include "weave/graphs/prediction.hpp"
#include "weave/runtime/trace_metrics.hpp"

namespace weave::cli {

namespace {

std::string machine_text(const graphs::TrainerConfig& config) {
  return fmt::format(
      "{} devices of {:.3g} FLOP/s, link {}{}", config.plan.devices(), config.machine.device_flops,
      devices::LinkModel::preset(config.machine.link).describe(),
      config.machine.cluster ? ", " + config.machine.cluster->describe(config.plan.devices())
                             : std::string());
}

std::string fits_text(const graphs::PlanOutcome& o) {
  return fmt::format("{}{}", bytes_text(o.memory_per_device), o.fits ? "" : " (does not fit)");
}

// The milliseconds a device's expert-parallel all-to-alls (dispatch and combine) stay exposed.
double exposed_all_to_all_ms(const graphs::Prediction& p) {
  constexpr std::string_view kAllToAll[] = {"dispatch", "combine"};
  return static_cast<double>(rt::exposed_comm_named(p.trace, kAllToAll)) * 1e-6 /
         p.replayed_devices;
}

[[noreturn]] void refuse_none_fits(std::string_view what, std::int64_t capacity) {
  std::fflush(stdout);  // the table the message points to, before the message on stderr
  throw graphs::ConfigError(fmt::format(
      "no {} fits the device's memory ({} a device, see the table): give --device-memory (weave "
      "predict) or --accelerator the device's memory, raise the parallel sizes, lower "
      "--micro-batch-size or use --use-distributed-optimizer",
      what, bytes_text(capacity)));
}

}  // namespace

// Every Ampipe degree the rules allow, the fastest that fits named.
int advise_ampipe(const graphs::TrainerConfig& config, std::int64_t device_memory_bytes,
                  const std::vector<std::string>& flags_without_effect) {
  fmt::print(
      "Ampipe degrees for this configuration, predicted on the virtual clock ({}; steps built "
      "without tensors, all-to-alls timed for balanced routing):\n",
      machine_text(config));
  fmt::print("{:>7} {:>11} {:>20} {:>19} {:>9}  {}\n", "degree", "step (ms)",
             "exposed comm (ms/dev)", "exposed a2a (ms/dev)", "speed-up", "memory per device");
  double baseline = 0, best_time = 0;
  int best = 0;
  for (int degree = 1; degree <= 16; degree *= 2) {
    graphs::TrainerConfig candidate = config;
    candidate.plan.ampipe_degree = degree;
    try {
      const std::vector<std::string> warnings = graphs::validate(candidate);
      graphs::check_flag_rules(candidate.plan, flags_without_effect);
      const graphs::Prediction p = graphs::predict_step(candidate);
      const graphs::PlanOutcome o = graphs::outcome_of(candidate, p, device_memory_bytes);
      if (degree == 1) baseline = o.step_ms;
      if (o.fits && (best == 0 || o.step_ms < best_time)) {
        best_time = o.step_ms;
        best = degree;
      }
      fmt::print("{:>7} {:>11.3f} {:>20.3f} {:>19.3f} {:>8.2f}x  {}\n", degree, o.step_ms,
                 p.exposed_ms_per_device, exposed_all_to_all_ms(p),
                 baseline > 0 ? baseline / o.step_ms : 1.0, fits_text(o));
      for (const std::string& w : warnings)
        fmt::print("        ({})\n", w);
    } catch (const graphs::ConfigError& e) {
      if (degree == 1) throw;
      fmt::print("{:>7} not possible: {}\n", degree, e.what());
    }
  }
  if (best == 0) refuse_none_fits("Ampipe degree", device_memory_bytes);
  fmt::print("best: --ampipe-degree {}\n", best);
  return 0;
}

// Every pipeline schedule: the step time, the bubble measured in the replay beside the
// schedule's formula, the activation memory each stage holds and the most a device holds. The
// fastest that fits is named.
int advise_pipeline(const graphs::TrainerConfig& config, std::int64_t device_memory_bytes) {
  const graphs::ParallelPlan& base = config.plan;
  if (base.pipeline_parallel < 2)
    throw graphs::ConfigError(
        "--pipeline-advise compares pipeline schedules: set --pipeline-model-parallel-size >= 2");
  const int p = base.pipeline_parallel;
  fmt::print(
      "Pipeline schedules for this configuration, predicted on the virtual clock ({}; p = {}, {} "
      "micro-batches):\n",
      machine_text(config), p, base.micro_batches());
  fmt::print("{:<16} {:>2} {:>10} {:>16} {:>14}  {:<24} {}\n", "schedule", "v", "step (ms)",
             "bubble measured", "bubble theory", "memory per device", "activations per stage, MiB");
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
      graphs::validate(candidate);
      const graphs::Prediction prediction = graphs::predict_step(candidate);
      const graphs::PlanOutcome o = graphs::outcome_of(candidate, prediction, device_memory_bytes);
      const graphs::Mesh mesh(plan);
      std::string activations;
      for (int stage = 0; stage < p; ++stage) {
        const auto rank = static_cast<std::size_t>(mesh.rank_of(0, 0, 0, stage));
        const auto category = static_cast<std::size_t>(rt::MemoryCategory::activations);
        activations +=
            fmt::format("{}{:.1f}", stage > 0 ? " | " : "",
                        static_cast<double>(prediction.memory[rank][category]) / (1 << 20));
      }
      const graphs::ScheduleTheory theory =
          graphs::schedule_theory(kind, {.ranks = p,
                                         .micro_batches = plan.micro_batches(),
                                         .chunks = plan.virtual_pipeline,
                                         .group_size = plan.microbatch_group_size});
      if (o.fits && (best.empty() || o.step_ms < best_time)) {
        best_time = o.step_ms;
        best = name;
      }
      // Idle over busy compute: the schedule's bubble plus whatever communication, loss and
      // optimizer the step leaves exposed.
      fmt::print("{:<16} {:>2} {:>10.3f} {:>16.3f} {:>14.3f}  {:<24} {}\n", name,
                 plan.virtual_pipeline, o.step_ms, prediction.bubble, theory.bubble_over_ideal,
                 fits_text(o), activations);
    } catch (const graphs::ConfigError& e) {
      fmt::print("{:<16} not possible: {}\n", name, e.what());
    }
  }
  if (best.empty()) refuse_none_fits("pipeline schedule", device_memory_bytes);
  fmt::print("best: --pipeline-scheduler {}\n", best);
  return 0;
}

namespace {

// The search's heading: the machine, what is searched and the candidates the rules left.
void print_candidates(const graphs::TrainerConfig& config, const graphs::PlanCandidates& candidates,
                      int max_tp, const PlanAdviceOptions& options) {
  const int devices = config.plan.devices();
  fmt::print(
      "Parallel plans over {} devices, predicted on the virtual clock ({}); global batch {}, "
      "micro-batch {}, each device {}:\n",
      devices, machine_text(config), config.plan.global_batch_size, config.plan.micro_batch_size,
      bytes_text(options.device_memory_bytes));
  fmt::print(
      "searched: tp{} x pp x cp x {}dp, schedules for pp > 1 (1f1b, interleaved, zb-h1), "
      "{}recomputation none or full uniform 1\n",
      max_tp > 0 ? fmt::format(" (at most {}, a node's devices)", max_tp) : "",
      config.model.num_experts > 0 ? "ep x " : "",
      config.model.num_experts > 0 ? "Ampipe degree 1 or 2, " : "");
  const int total = static_cast<int>(candidates.configs.size());
  fmt::print(
      "candidates: {} valid, {} refused by the rules, {} skipped (data-parallel size "
      "does not divide the global batch {})\n",
      total, candidates.refused_total(), candidates.skipped_global_batch,
      config.plan.global_batch_size);
  for (const graphs::RefusalCount& r : candidates.refused)
    fmt::print("  refused {:>5}: {}\n", r.candidates, r.reason);
  if (total == 0)
    throw graphs::ConfigError(fmt::format(
        "no parallel plan over {} devices passes the rules (see the refusals above): change "
        "--devices, --global-batch-size or the model's sizes",
        devices));
  if (total > options.max_predictions)
    fmt::print(
        "stopping at the candidate limit: predicting the {} of {} candidates that build the "
        "fewest ranks (raise --advise-limit to predict them all)\n",
        options.max_predictions, total);
}

// Predicts the candidates, reporting progress on stderr every two seconds.
graphs::PlanRanking rank_with_progress(const graphs::PlanCandidates& candidates,
                                       const PlanAdviceOptions& options) {
  std::fflush(stdout);  // the table's heading before the progress lines on stderr
  const auto start = std::chrono::steady_clock::now();
  auto last = start;
  graphs::PlanRankingOptions ranking_options{
      .device_memory_bytes = options.device_memory_bytes,
      .max_predictions = options.max_predictions,
      .prediction = {.fold_data_parallel = options.fold,
                     .fold_tensor_parallel = options.fold,
                     .fold_context_parallel = options.fold,
                     .fold_micro_batches = options.fold,
                     .memory_over_step = false},
      .memory_budget_bytes = options.memory_budget_bytes,
      .progress = [&](int done, int to_do) {
        const auto now = std::chrono::steady_clock::now();
        if (done < to_do && now - last < std::chrono::seconds(2)) return;
        last = now;
        fmt::print(stderr, "advise: predicted {} of {} candidates ({:.1f} s)\n", done, to_do,
                   std::chrono::duration<double>(now - start).count());
      }};
  return graphs::rank_plans(candidates.configs, ranking_options);
}

// The fastest plans that fit, one line each.
void print_fitting(const graphs::PlanRanking& ranking, int top) {
  const int shown = std::min(top, static_cast<int>(ranking.fitting.size()));
  // Asked for ZeRO stage 2 or 3, the advice weighs it against the stages below: a last column
  // names each plan's stage.
  bool stages = false;
  for (const graphs::PlanOutcome& o : ranking.fitting)
    stages |= o.config.plan.shard_gradients;
  fmt::print(
      "{:>4} {:>3} {:>3} {:>3} {:>3} {:>4} {:<12} {:>6} {:>9} {:>11} {:>13} {:>6} {:>8}  {}{}\n",
      "rank", "tp", "pp", "cp", "ep", "dp", "schedule", "ampipe", "recompute", "step (ms)",
      "tokens/s", "MFU %", "bubble", "memory per device", stages ? "  ZeRO stage" : "");
  for (int i = 0; i < shown; ++i) {
    const graphs::PlanOutcome& o = ranking.fitting[static_cast<std::size_t>(i)];
    const graphs::ParallelPlan& p = o.config.plan;
    const std::string schedule =
        p.pipeline_parallel == 1
            ? "-"
            : fmt::format("{}{}", p.pipeline_scheduler.empty() ? "1f1b" : p.pipeline_scheduler,
                          p.virtual_pipeline > 1 ? fmt::format(" v{}", p.virtual_pipeline) : "");
    fmt::print(
        "{:>4} {:>3} {:>3} {:>3} {:>3} {:>4} {:<12} {:>6} {:>9} {:>11.3f} {:>13.0f} {:>6.1f} "
        "{:>8.3f}  {}\n",
        i + 1, p.tensor_parallel, p.pipeline_parallel, p.context_parallel, p.expert_parallel,
        p.data_parallel, schedule, p.ampipe_degree,
        o.config.model.recompute.full() ? "full" : "none", o.step_ms, o.tokens_per_second,
        100 * o.mfu, o.bubble,
        stages ? fmt::format("{:<17}  {}", bytes_text(o.memory_per_device),
                             p.shard_parameters  ? 3
                             : p.shard_gradients ? 2
                                                 : 1)
               : bytes_text(o.memory_per_device));
  }
}

}  // namespace

int advise_plans(const graphs::TrainerConfig& config, const PlanAdviceOptions& options) {
  // Tensor parallelism stays in a node: across nodes every layer's collectives would cross
  // the network.
  const int max_tp = config.machine.cluster ? config.machine.cluster->devices_per_node() : 0;
  const graphs::PlanCandidates candidates = graphs::enumerate_plans(
      config,
      {.max_tensor_parallel = max_tp, .flags_without_effect = options.flags_without_effect});
  print_candidates(config, candidates, max_tp, options);
  const graphs::PlanRanking ranking = rank_with_progress(candidates, options);
  int refused_building = 0;
  for (const graphs::RefusalCount& r : ranking.refused)
    refused_building += r.candidates;
  fmt::print("predicted {}: {} fit, {} discarded for memory, {} refused{}\n", ranking.predicted,
             ranking.fitting.size(), ranking.too_large, refused_building,
             ranking.not_predicted > 0
                 ? fmt::format(", {} not predicted (--advise-limit)", ranking.not_predicted)
                 : std::string());
  for (const graphs::RefusalCount& r : ranking.refused)
    fmt::print("  refused {:>5} while building the step: {}\n", r.candidates, r.reason);
  fmt::print("side by side: at most {} predictions at once, estimated to hold {} together{}\n",
             ranking.most_side_by_side, bytes_text(ranking.most_estimated_bytes),
             options.memory_budget_bytes > 0 ? fmt::format(" (--advise-memory-budget {})",
                                                           bytes_text(options.memory_budget_bytes))
                                             : std::string());
  if (ranking.fitting.empty())
    refuse_none_fits("predicted parallel plan", options.device_memory_bytes);
  print_fitting(ranking, options.top);
  const graphs::PlanOutcome& best = ranking.fitting.front();
  fmt::print("best: {:.3f} ms a step\n", best.step_ms);
  fmt::print("run it: weave predict {}{}{}\n", options.model_flags,
             options.model_flags.empty() ? "" : " ", graphs::plan_flags(best.config));
  return 0;
}

}  // namespace weave::cli
