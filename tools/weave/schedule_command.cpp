// `weave schedule`: builds or loads a pipeline schedule, checks and dry-runs it, and prints its
// order, its bubble (simulated and in theory) and its peak activations per rank, then lowers it
// to a task graph and replays that on the virtual clock; optionally writes it as SVG and CSV and
// the replay as a Chrome trace.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <fstream>
#include <optional>
#include <sstream>

#include "commands.hpp"
#include "output_paths.hpp"
#include "weave/graphs/pipeline_lowering.hpp"
#include "weave/graphs/pipeline_schedule.hpp"
#include "weave/graphs/pipeline_schedule_csv.hpp"
#include "weave/graphs/pipeline_schedule_generators.hpp"
#include "weave/graphs/pipeline_schedule_simulation.hpp"
#include "weave/graphs/pipeline_schedule_svg.hpp"
#include "weave/runtime/chrome_trace.hpp"
#include "weave/runtime/cost_model.hpp"

namespace weave::cli {

namespace {

struct ScheduleOptions {
  int ranks = 0;          // 0: not given
  int micro_batches = 0;  // 0: not given
  int chunks = 0;         // 0: the schedule's own default
  int group_size = 0;     // 0: p
  std::string scheduler = "1f1b";
  std::string svg_path;
  std::string csv_path;
  std::string load_path;
  std::string trace_path;
  double transfer_time = 0;  // of one point-to-point transfer, in the time model's units
  graphs::TimeModel time;
  bool backward_given = false;
  bool split_given = false;
};

// A validator that names the known schedules and the closest one to a mistyped name.
CLI::Validator schedule_name_validator() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        try {
          graphs::schedule_kind(value);
        } catch (const graphs::ScheduleError& e) {
          return e.what();
        }
        return {};
      },
      "NAME");
}

// Interleaving needs at least two chunks, and ZB-V exactly two: those default to 2.
int default_chunks(graphs::ScheduleKind kind) {
  switch (kind) {
    case graphs::ScheduleKind::Interleaved:
    case graphs::ScheduleKind::InterleavedMem:
    case graphs::ScheduleKind::ZeroBubbleV:
      return 2;
    default:
      return 1;
  }
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument(fmt::format("cannot read --load-csv file '{}'", path));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

void write_file(const std::string& path, const std::string& text, const char* flag) {
  std::ofstream out(path);
  out << text;
  if (!out) throw std::invalid_argument(fmt::format("cannot write {} file '{}'", flag, path));
  fmt::print("wrote {}\n", path);
}

graphs::PipelineSchedule load(const ScheduleOptions& o) {
  graphs::PipelineSchedule s =
      graphs::read_schedule_csv(read_file(o.load_path), o.load_path, o.micro_batches);
  if (o.ranks != 0 && o.ranks != s.ranks)
    throw std::invalid_argument(fmt::format(
        "--load-csv '{}' has {} rows, one per rank, but --pipeline-model-parallel-size is {}; "
        "leave the flag out or make them agree",
        o.load_path, s.ranks, o.ranks));
  if (o.chunks != 0 && o.chunks != s.chunks)
    throw std::invalid_argument(
        fmt::format("--load-csv '{}' uses {} chunks per rank (stages up to {}), but "
                    "--virtual-pipeline-size is {}; leave the flag out or make them agree",
                    o.load_path, s.chunks, s.stages() - 1, o.chunks));
  return s;
}

// A schedule's order is shown whole up to this size; a larger one (p 64 x m 100000 is 13 M
// actions) would bury the figures, so it is cut, saying so: --csv writes all of it.
constexpr std::size_t kShownRanks = 16;
constexpr std::size_t kShownActions = 64;

// The order of each rank, as format_schedule writes it, cut to kShownRanks x kShownActions.
void print_order(const graphs::PipelineSchedule& s) {
  const std::size_t ranks = s.actions.size();
  std::size_t longest = 0;
  for (const auto& rank : s.actions)
    longest = std::max(longest, rank.size());
  if (ranks <= kShownRanks && longest <= kShownActions) {
    fmt::print("{}", graphs::format_schedule(s));
    return;
  }
  for (std::size_t r = 0; r < std::min(ranks, kShownRanks); ++r) {
    const auto& actions = s.actions[r];
    std::vector<std::string> shown;
    for (std::size_t i = 0; i < std::min(actions.size(), kShownActions); ++i)
      shown.push_back(graphs::to_string(actions[i]));
    fmt::print("r{}: {}{}\n", r, fmt::join(shown, " "),
               actions.size() > kShownActions
                   ? fmt::format(" ... ({} more)", actions.size() - kShownActions)
                   : "");
  }
  fmt::print(
      "(order shown for {} of {} ranks, at most {} actions each; --csv FILE writes all of it)\n",
      std::min(ranks, kShownRanks), ranks, kShownActions);
}

void print_report(const graphs::PipelineSchedule& s, const graphs::ScheduleReport& report,
                  const std::optional<graphs::ScheduleTheory>& theory,
                  const graphs::TimeModel& time) {
  const std::string layout = s.chunks == 1 ? "one stage per rank"
                             : s.layout == graphs::StageLayout::V
                                 ? "rank r holds stages r and 2p-1-r"
                                 : "rank r holds stages r, r+p, ...";
  fmt::print("{}: p={} ranks, m={} micro-batches, v={} chunk{} per rank ({})\n", s.name, s.ranks,
             s.micro_batches, s.chunks, s.chunks == 1 ? "" : "s", layout);
  print_order(s);
  if (!report.simulated) return;
  fmt::print("time per chunk: F {:g}, B {:g}, I {:g}, W {:g}\n", time.forward, time.backward,
             time.backward_input, time.backward_weight);
  fmt::print("makespan {:g}\n", report.makespan);
  if (theory)
    fmt::print("bubble / ideal: {:.3f} simulated, {:.3f} in theory {}\n", report.bubble_over_ideal,
               theory->bubble_over_ideal, theory->bubble_formula);
  else
    fmt::print("bubble / ideal: {:.3f} simulated\n", report.bubble_over_ideal);
  fmt::print("idle / total:   {:.3f}\n", report.idle_over_total);
  if (theory && !theory->caveat.empty()) fmt::print("note: {}\n", theory->caveat);
  fmt::print("peak activations in units of one micro-batch's on a rank (a chunk holds 1/v):\n");
  fmt::print("{:>5} {:>8} {:>8} {:>10} {:>8}  {}\n", "rank", "busy", "idle", "peak", "theory",
             "first reached at");
  for (int r = 0; r < s.ranks; ++r) {
    const graphs::RankReport& rank = report.ranks[r];
    const std::string at =
        rank.peak_step < 0
            ? std::string("-")
            : fmt::format(
                  "step {} ({})", rank.peak_step,
                  graphs::to_string(s.actions[r][static_cast<std::size_t>(rank.peak_step)]));
    fmt::print("{:>5} {:>8g} {:>8g} {:>10g} {:>8}  {}\n", r, rank.busy, rank.idle,
               rank.peak_activations,
               theory ? fmt::format("{:g}", theory->peak_activations[r]) : std::string("-"), at);
  }
}

// The replay's clock runs at one time unit per microsecond: one FLOP and one byte per
// nanosecond, so a unit of the time model is 1000 FLOPs or 1000 bytes.
constexpr double kUnit = 1000;

// Lowers the schedule to a task graph, replays it on the virtual clock and prints what the
// runtime measured: the makespan, the bubble and the MemoryTracker's activation peaks.
void print_replay(const graphs::PipelineSchedule& s, const ScheduleOptions& o,
                  const std::optional<graphs::ScheduleTheory>& theory) {
  const graphs::LoweringOptions lowering{.forward_flops = o.time.forward * kUnit,
                                         .backward_flops = o.time.backward * kUnit,
                                         .backward_input_flops = o.time.backward_input * kUnit,
                                         .backward_weight_flops = o.time.backward_weight * kUnit,
                                         .transfer_bytes = o.transfer_time * kUnit};
  const rt::UniformCostModel model(1e9, 0, 1e9);
  const graphs::PipelineReplay replay = graphs::replay_schedule(s, lowering, model);
  const double makespan = static_cast<double>(replay.makespan) / kUnit;
  fmt::print("task graph on the virtual clock{}: makespan {:g}, bubble {:.3f}{}\n",
             o.transfer_time > 0 ? fmt::format(" (transfers {:g})", o.transfer_time) : "", makespan,
             replay.bubble_over_ideal,
             theory ? fmt::format(" (theory {:.3f})", theory->bubble_over_ideal) : "");
  std::vector<std::string> peaks;
  for (double peak : replay.peak_activations)
    peaks.push_back(fmt::format("{:g}", peak));
  fmt::print("memory tracker peak activations per rank: {}\n", fmt::join(peaks, " "));
  if (!o.trace_path.empty()) {
    rt::write_chrome_trace(replay.trace, o.trace_path);
    fmt::print("wrote {}\n", o.trace_path);
  }
}

int run_schedule(ScheduleOptions o) {
  check_writable("--svg", o.svg_path);
  check_writable("--csv", o.csv_path);
  check_writable("--trace", o.trace_path);
  // A backward time given alone splits evenly into its halves; halves given alone add up.
  if (o.backward_given && !o.split_given) {
    o.time.backward_input = o.time.backward / 2;
    o.time.backward_weight = o.time.backward / 2;
  } else if (o.split_given && !o.backward_given) {
    o.time.backward = o.time.backward_input + o.time.backward_weight;
  }
  graphs::PipelineSchedule schedule;
  std::optional<graphs::ScheduleTheory> theory;
  if (!o.load_path.empty()) {
    schedule = load(o);
  } else {
    if (o.ranks == 0 || o.micro_batches == 0)
      throw std::invalid_argument(
          "weave schedule needs --pipeline-model-parallel-size and --num-micro-batches (e.g. 4 "
          "and 8), or --load-csv FILE");
    const graphs::ScheduleKind kind = graphs::schedule_kind(o.scheduler);
    const graphs::ScheduleParams params{.ranks = o.ranks,
                                        .micro_batches = o.micro_batches,
                                        .chunks = o.chunks ? o.chunks : default_chunks(kind),
                                        .group_size = o.group_size};
    schedule = graphs::make_schedule(kind, params);
    theory = graphs::schedule_theory(kind, params, o.time.forward, o.time.backward_input,
                                     o.time.backward_weight);
  }
  const graphs::ScheduleReport report = graphs::simulate_schedule(schedule, o.time);
  print_report(schedule, report, theory, o.time);
  if (report.simulated) print_replay(schedule, o, theory);
  if (!o.svg_path.empty())
    write_file(o.svg_path, graphs::render_schedule_svg(schedule, report), "--svg");
  if (!o.csv_path.empty()) write_file(o.csv_path, graphs::write_schedule_csv(schedule), "--csv");
  if (!report.valid()) {
    fmt::print(stderr, "weave: error: the schedule is not valid:\n");
    for (const std::string& problem : report.problems)
      fmt::print(stderr, "  {}\n", problem);
    return 1;
  }
  return 0;
}

}  // namespace

void add_schedule_command(CLI::App& app) {
  auto o = std::make_shared<ScheduleOptions>();
  CLI::App* cmd = app.add_subcommand(
      "schedule", "Build or load a pipeline schedule, check it and show its bubble and memory");
  cmd->add_option("-p,--pipeline-model-parallel-size", o->ranks, "Pipeline ranks p")
      ->check(at_least(1));
  cmd->add_option("-m,--num-micro-batches", o->micro_batches, "Micro-batches per step m")
      ->check(at_least(1));
  cmd->add_option("--virtual-pipeline-size", o->chunks,
                  "Chunks (virtual stages) per rank v (default: 2 for interleaved, "
                  "interleaved-mem and zb-v, else 1)")
      ->check(at_least(1));
  cmd->add_option("--microbatch-group-size-per-virtual-pipeline-stage", o->group_size,
                  "Interleaved: micro-batches per group N (default p)")
      ->check(at_least(1));
  cmd->add_option("--pipeline-scheduler", o->scheduler,
                  "gpipe, 1f1b, interleaved, interleaved-mem, zb-h1 or zb-v")
      ->check(schedule_name_validator())
      ->capture_default_str();
  cmd->add_option("--svg", o->svg_path, "Write the schedule's picture here");
  cmd->add_option("--csv", o->csv_path, "Write the schedule as CSV here, one row per rank");
  cmd->add_option("--trace", o->trace_path,
                  "Write the task graph's replay on the virtual clock here (Chrome trace JSON)");
  cmd->add_option("--transfer-time", o->transfer_time,
                  "Time of one point-to-point transfer between ranks in the task-graph replay")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--load-csv", o->load_path,
                  "Check and show the schedule in this CSV instead of generating one");
  cmd->add_option("--forward-time", o->time.forward, "Time of one chunk's forward")
      ->check(positive())
      ->capture_default_str();
  cmd->add_option_function<double>(
         "--backward-time",
         [o](double t) {
           o->time.backward = t;
           o->backward_given = true;
         },
         "Time of one chunk's full backward (default 2; given alone, I and W take half each)")
      ->check(positive());
  cmd->add_option_function<double>(
         "--backward-input-time",
         [o](double t) {
           o->time.backward_input = t;
           o->split_given = true;
         },
         "Time of one chunk's input-gradient half I (default 1)")
      ->check(positive());
  cmd->add_option_function<double>(
         "--backward-weight-time",
         [o](double t) {
           o->time.backward_weight = t;
           o->split_given = true;
         },
         "Time of one chunk's weight-gradient half W (default 1)")
      ->check(positive());
  cmd->footer(
      "Example:\n"
      "  weave schedule --pipeline-model-parallel-size 4 --num-micro-batches 8 \\\n"
      "                 --pipeline-scheduler zb-h1 --svg zb-h1.svg --csv zb-h1.csv");
  cmd->callback([o] { throw CommandExit{run_schedule(*o)}; });
}

}  // namespace weave::cli
