// weave predict: one training step of a configuration on the virtual clock, from the step's
// graph built without tensors: time, throughput, model FLOP/s and MFU, exposed communication
// per process group, the pipeline's bubble and each device's memory.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "advice.hpp"
#include "commands.hpp"
#include "memory_estimate.hpp"
#include "output_paths.hpp"
#include "run_record.hpp"
#include "step_figures.hpp"
#include "step_views.hpp"
#include "train_options.hpp"
#include "weave/devices/accelerator.hpp"
#include "weave/devices/link_model.hpp"
#include "weave/graphs/config_flags.hpp"
#include "weave/graphs/mesh.hpp"
#include "weave/graphs/path_bubble.hpp"
#include "weave/graphs/prediction.hpp"
#include "weave/runtime/chrome_trace.hpp"

namespace weave::cli {

bool left_out_of_advice(std::string_view flag) {
  const graphs::ConfigFlag* f = graphs::find_config_flag(flag);
  return f && (f->has(graphs::kChoosesPlan) || f->has(graphs::kNotRepeatedByAdvice));
}

namespace {

struct PredictOptions {
  TrainOptions train;
  double device_memory_gib = 80;
  bool device_memory_given = false;
  bool every_rank = false;
  bool json = false;        // --json: the prediction as one JSON object
  std::string trace_ranks;  // --trace-ranks: "0-7,64"
  // --advise: search the parallel plans instead of predicting the one given.
  bool advise = false;
  int advise_top = 10;
  int advise_limit = 500;
  double advise_memory_budget_gib = 0;  // 0: the memory the machine has available
  bool advise_top_given = false, advise_limit_given = false, advise_memory_budget_given = false;
};

// A word as a shell reads it back.
std::string shell_word(const std::string& word) {
  if (!word.empty() && word.find_first_of(" \t\n'\"\\$`*?[]{}()<>|&;~#!") == std::string::npos)
    return word;
  std::string quoted = "'";
  for (const char ch : word)
    quoted += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return quoted + "'";
}

// The flags given on the command line other than the plan's, as a shell command's words.
std::string model_flags(const CLI::App& cmd) {
  std::string flags;
  for (const CLI::Option* opt : cmd.get_options()) {
    if (opt->count() == 0) continue;
    const std::string name = opt->get_name();
    if (left_out_of_advice(name)) continue;
    flags += (flags.empty() ? "" : " ") + name;
    if (opt->get_expected_max() != 0)  // a flag takes no value
      for (const std::string& value : opt->results())
        flags += " " + shell_word(value);
  }
  return flags;
}

// --bf16 / --fp16 into the model's configuration, by Megatron-LM's meanings (derive_config read
// the recomputation flags); graphs::validate checks the combinations.
void apply_predicted_training(PredictOptions& o) {
  graphs::ModelConfig& m = o.train.config.model;
  if (o.train.bf16 && o.train.fp16)
    throw graphs::ConfigError(
        "--bf16 and --fp16 are two precisions: give one (Megatron-LM refuses both, too)");
  m.precision = o.train.bf16   ? graphs::Precision::bf16
                : o.train.fp16 ? graphs::Precision::fp16
                               : graphs::Precision::fp32;
}

std::string recompute_text(const graphs::Recompute& r) {
  switch (r.granularity) {
    case graphs::RecomputeGranularity::full:
      return fmt::format(", full recomputation ({} {})",
                         r.method == graphs::RecomputeMethod::uniform ? "uniform" : "block",
                         r.num_layers);
    case graphs::RecomputeGranularity::selective: {
      // The modules that recompute more than the blockwise attention does anyway.
      std::vector<std::string> what;
      if (r.recomputes(graphs::kRecomputeMlp)) what.emplace_back("the MLPs");
      if (r.recomputes(graphs::kRecomputeMoe)) what.emplace_back("the MoE layers");
      if (r.recomputes(graphs::kRecomputeMoeActivation))
        what.emplace_back("the experts' activations");
      if (r.recomputes(graphs::kRecomputeLayerNorm)) what.emplace_back("the norms");
      return what.empty() ? ", selective recomputation"
                          : fmt::format(", selective recomputation of {}", fmt::join(what, ", "));
    }
    case graphs::RecomputeGranularity::none:
      break;
  }
  return {};
}

// Folding data-parallel replicas, tensor- and context-parallel peers and micro-batches, unless
// --every-rank. A step shown (--trace, --dump-graph, --critical-path, --what-if, --figure,
// --report) keeps every rank of replica 0, the peers included, and every micro-batch, as a reader
// expects to see them. Each device's memory over the step is kept for --report's charts alone.
graphs::PredictionOptions folding(const PredictOptions& o, const graphs::TrainerConfig& c,
                                  const StepViewRequest& views, const FigureRequest& figure) {
  const bool shown = !c.trace_path.empty() || views.critical_path || !views.dump_path.empty() ||
                     !views.what_if.empty() || !figure.kind.empty() || !o.train.report.empty();
  return {.fold_data_parallel = !o.every_rank,
          .fold_tensor_parallel = !o.every_rank && !shown,
          .fold_context_parallel = !o.every_rank && !shown,
          .fold_micro_batches = !o.every_rank && !shown,
          .what_if = views.what_if,
          // --report refuses a step too large for a page once it is built, before its replay.
          .most_tasks = o.train.report.empty() ? 0 : graphs::kStepReportMostTasks,
          .memory_over_step = !o.train.report.empty()};
}

// The ranks --trace-ranks names ("0-7,64"), each checked against the plan before anything is
// predicted: in range, and built (a folded rank is not: it runs the program of the rank it is
// folded into).
std::vector<rt::DeviceId> parse_trace_ranks(const PredictOptions& o,
                                            const graphs::TrainerConfig& c) {
  std::vector<rt::DeviceId> ranks;
  if (o.trace_ranks.empty()) return ranks;
  if (c.trace_path.empty())
    throw graphs::ConfigError(fmt::format(
        "--trace-ranks {} chooses what --trace writes: add --trace FILE", o.trace_ranks));
  const int devices = c.plan.devices();
  const graphs::Mesh mesh(c.plan);
  auto rank = [&](const std::string& text) {
    std::size_t used = 0;
    long value = -1;
    try {
      value = std::stol(text, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != text.size() || text.empty() || value < 0 || value >= devices)
      throw graphs::ConfigError(fmt::format(
          "--trace-ranks takes ranks in [0, {}) and ranges like 0-7,64; '{}' is not one", devices,
          text));
    return static_cast<int>(value);
  };
  std::size_t at = 0;
  while (at <= o.trace_ranks.size()) {
    const std::size_t comma = std::min(o.trace_ranks.find(',', at), o.trace_ranks.size());
    const std::string item = o.trace_ranks.substr(at, comma - at);
    const std::size_t dash = item.find('-');
    const int first = rank(item.substr(0, dash));
    const int last = dash == std::string::npos ? first : rank(item.substr(dash + 1));
    if (last < first)
      throw graphs::ConfigError(
          fmt::format("--trace-ranks: the range '{}' ends before it starts", item));
    for (int r = first; r <= last; ++r) {
      const graphs::MeshCoordinates x = mesh.coordinates(r);
      if (!o.every_rank && x.dp > 0)
        throw graphs::ConfigError(fmt::format(
            "--trace-ranks: rank {} is data-parallel replica {}'s, folded into replica 0 (the "
            "same program on other samples): trace rank {} instead, or add --every-rank",
            r, x.dp, mesh.rank_of(x.tp, x.cp, 0, x.pp)));
      ranks.push_back(static_cast<rt::DeviceId>(r));
    }
    at = comma + 1;
  }
  return ranks;
}

// The memory --advise's predictions side by side may hold together: --advise-memory-budget's
// GiB, else what the machine has available (MemAvailable: free memory and the caches the kernel
// gives back), else no budget.
std::int64_t advice_memory_budget(const PredictOptions& o) {
  if (o.advise_memory_budget_given) {
    if (o.advise_memory_budget_gib > 1e9)
      throw std::invalid_argument(fmt::format(
          "--advise-memory-budget {} GiB is more than any machine holds: give the GiB the "
          "predictions side by side may take",
          o.advise_memory_budget_gib));
    return static_cast<std::int64_t>(o.advise_memory_budget_gib * 1024 * 1024 * 1024);
  }
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);) {
    std::istringstream words(line);
    std::string key;
    std::int64_t kib = 0;
    if (words >> key >> kib && key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

// Advice (--advise, --ampipe-advise, --pipeline-advise) predicts many steps: one at a time, and
// none with the single prediction's --trace.
void check_advice_flags(const PredictOptions& o) {
  const int advice = o.advise + o.train.ampipe_advise + o.train.pipeline_advise;
  if (advice > 1)
    throw std::invalid_argument(
        "--advise, --ampipe-advise and --pipeline-advise are three searches: give one");
  if ((o.advise_top_given || o.advise_limit_given || o.advise_memory_budget_given) && !o.advise)
    throw std::invalid_argument(fmt::format("{} shapes --advise's search: add --advise",
                                            o.advise_top_given     ? "--advise-top"
                                            : o.advise_limit_given ? "--advise-limit"
                                                                   : "--advise-memory-budget"));
  if (advice > 0 && !o.train.figure.empty())
    throw std::invalid_argument(
        "--figure draws one step's replay and advice predicts many: run weave predict with the "
        "best's flags and --figure");
  if (advice > 0 && !o.train.report.empty())
    throw std::invalid_argument(
        "--report shows one step's replay and advice predicts many: run weave predict with the "
        "best's flags and --report");
  if (advice > 0 && !o.train.config.trace_path.empty())
    throw std::invalid_argument(
        "--trace writes one step's replay and advice predicts many: run weave predict with the "
        "best's flags and --trace");
}

// --advise replaces the plan given, which need not pass the rules: the model's own sizes are
// checked on one device, the candidates' plans one by one.
std::vector<std::string> validate_model(const graphs::TrainerConfig& c) {
  graphs::TrainerConfig one = c;
  one.model.recompute = {};
  one.plan = {.expert_tensor_parallel = 1,
              .moe_model_type = c.plan.moe_model_type,
              .micro_batch_size = c.plan.micro_batch_size,
              .global_batch_size = c.plan.micro_batch_size,
              .distributed_optimizer = c.plan.distributed_optimizer};
  return graphs::validate(one);
}

// The --accelerator's line ("h100-sxm (peak ...), "), its memory becoming the devices' unless
// --device-memory is given.
std::string accelerator_text(PredictOptions& o) {
  if (o.train.accelerator.empty()) return {};
  const devices::Accelerator a = devices::Accelerator::load(o.train.accelerator);
  if (!o.device_memory_given)
    o.device_memory_gib = static_cast<double>(a.memory_bytes) / (1024.0 * 1024 * 1024);
  return fmt::format("{} (peak {:.4g} FLOP/s, {} of memory), ", a.name, a.peak_flops,
                     bytes_text(a.memory_bytes));
}

// What is predicted: the model, the plan and the modelled machine.
void print_configuration(const graphs::TrainerConfig& c, const std::string& accelerator) {
  const graphs::ModelConfig& m = c.model;
  const graphs::ParallelPlan& plan = c.plan;
  fmt::print(
      "weave predict: {} layers, hidden {}, {} heads{}, {}, vocabulary {} (padded {}), {}{} | {} "
      "devices: tp {}{}, cp {}, ep {}, dp {}, pp {} | global batch {} x {} tokens\n",
      m.num_layers, m.hidden_size, m.num_attention_heads, heads_width_text(m), moe_text(m),
      m.vocab_size, m.padded_vocab_size(c.plan.tensor_parallel),
      graphs::precision_name(m.precision), recompute_text(m.recompute), plan.devices(),
      plan.tensor_parallel, plan.sequence_parallel ? " + sp" : "", plan.context_parallel,
      plan.expert_parallel, plan.data_parallel, plan.pipeline_parallel, plan.global_batch_size,
      m.seq_length);
  const std::string kernels =
      c.machine.attention_flops > 0
          ? fmt::format(
                "matrix products {:.3g} FLOP/s (half that at {:.0f} rows), attention "
                "{:.3g} FLOP/s, ",
                c.machine.device_flops, c.machine.matmul_overhead_dimension,
                c.machine.attention_flops)
          : fmt::format("{:.3g} FLOP/s sustained, ", c.machine.device_flops);
  fmt::print("modelled device: {}{}{:.3g} B/s of memory, link {}\n", accelerator, kernels,
             c.machine.device_memory_bandwidth,
             devices::LinkModel::preset(c.machine.link).describe());
  if (c.machine.cluster)
    fmt::print(
        "cluster          {}: collectives by their algorithm (ring or tree in a node, "
        "hierarchical across nodes, all-to-all messages in flight together)\n",
        c.machine.cluster->describe(plan.devices()));
}

// The step's time, throughput, FLOPs, bubble and exposed communication.
void print_figures(const graphs::Prediction& p, const graphs::TrainerConfig& c) {
  const graphs::ParallelPlan& plan = c.plan;
  fmt::print("replayed         {} of {} devices{}\n", p.replayed_devices, plan.devices(),
             p.replayed_devices < plan.devices()
                 ? " (data-parallel replicas, tensor- and context-parallel peers folded into the "
                   "first: the same work on other samples, shards and chunks)"
                 : "");
  if (p.micro_batches_replayed.size() == 3)
    fmt::print(
        "micro-batches    {} a replica, extrapolated from replays of {}, {} and {} (each period "
        "of the steady phase adds the same time and memory)\n",
        c.plan.micro_batches(), p.micro_batches_replayed[0], p.micro_batches_replayed[1],
        p.micro_batches_replayed[2]);
  fmt::print("step             {:.3f} ms\n", p.step_ms);
  fmt::print("throughput       {:.0f} tokens/s\n", p.tokens_per_second);
  fmt::print(
      "model FLOPs      {:.4g} a step (Megatron-LM's count; {:.4g} with full recomputation{})\n",
      p.model_flops, p.model_flops_recompute,
      p.flops_recomputed > 0
          ? fmt::format(", {:.4g} with this run's", p.model_flops + p.flops_recomputed)
          : std::string());
  const double peak = c.machine.peak_flops > 0 ? c.machine.peak_flops : c.machine.device_flops;
  // With recomputation, also what Megatron-LM's papers report: the recomputed forward counted.
  std::string with_recomputation;
  if (p.flops_recomputed > 0) {
    const double counted =
        p.flops_per_device * (p.model_flops + p.flops_recomputed) / p.model_flops;
    with_recomputation = fmt::format("; {:.4g} FLOP/s, {:.1f} % counting the recomputed forward",
                                     counted, 100 * counted / peak);
  }
  fmt::print("per device       {:.4g} FLOP/s of model math, MFU {:.1f} % of {:.3g}{}\n",
             p.flops_per_device, 100 * p.mfu, peak, with_recomputation);
  fmt::print("bubble           {:.3f} (compute idle over compute busy, summed over devices)\n",
             p.bubble);
  std::string exposed;
  for (const graphs::ExposedCommunication& e : p.exposed)
    exposed += fmt::format("{}{} {:.3f}", exposed.empty() ? "" : ", ", e.group, e.ms_per_device);
  fmt::print("exposed comm     {} ms a device\n", exposed.empty() ? "none" : exposed);
  std::string compute;
  for (std::size_t k = 0; k < graphs::kComputeKindCount; ++k)
    compute += fmt::format("{}{} {:.3f}", k == 0 ? "" : ", ",
                           graphs::to_string(static_cast<graphs::ComputeKind>(k)),
                           p.compute_ms_per_device[k]);
  fmt::print("compute          {} ms a device\n", compute);
}

// Memory per device against the device's capacity, naming the devices that would run out.
void print_memory(const graphs::Prediction& p, double device_memory_gib) {
  // Worded as weave train's estimate: the device that holds the most, by category.
  const MemoryEstimate memory{.by_category = p.memory, .peak = p.memory_total};
  const std::size_t largest = memory.largest_device();
  const auto capacity = static_cast<std::int64_t>(device_memory_gib * 1024 * 1024 * 1024);
  fmt::print("memory           {}, of {} a device\n", memory.describe(), bytes_text(capacity));
  int over = 0;
  for (const std::int64_t bytes : p.memory_total)
    over += bytes > capacity;
  if (over > 0)
    fmt::print(
        "warning: {} of {} devices would run out of memory (device {} needs {} of {}): raise the "
        "parallel sizes, lower --micro-batch-size or use --use-distributed-optimizer\n",
        over, p.memory_total.size(), largest, bytes_text(p.memory_total[largest]),
        bytes_text(capacity));
}

// --json: the figures print_figures and print_memory give, as one object a script reads.
void print_json(const graphs::Prediction& p, const graphs::TrainerConfig& c,
                const std::vector<std::string>& warnings,
                const std::vector<std::string>& no_effect) {
  nlohmann::json j;
  j["step_ms"] = p.step_ms;
  j["tokens_per_second"] = p.tokens_per_second;
  j["model_flops"] = p.model_flops;
  j["flops_recomputed"] = p.flops_recomputed;
  j["flops_per_device"] = p.flops_per_device;
  j["mfu"] = p.mfu;
  j["bubble"] = p.bubble;
  j["devices"] = c.plan.devices();
  j["replayed_devices"] = p.replayed_devices;
  j["micro_batches"] = c.plan.micro_batches();
  j["micro_batches_replayed"] = p.micro_batches_replayed;
  nlohmann::json compute = nlohmann::json::object();
  double busy = 0;
  for (std::size_t k = 0; k < graphs::kComputeKindCount; ++k) {
    compute[std::string(graphs::to_string(static_cast<graphs::ComputeKind>(k)))] =
        p.compute_ms_per_device[k];
    busy += p.compute_ms_per_device[k];
  }
  j["compute_ms_per_device"] = compute;
  j["compute_busy_ms_per_device"] = busy;
  nlohmann::json exposed = nlohmann::json::object();
  for (const graphs::ExposedCommunication& e : p.exposed)
    exposed[e.group] = e.ms_per_device;
  j["exposed_ms_per_device"] = exposed;
  j["exposed_total_ms_per_device"] = p.exposed_ms_per_device;
  std::int64_t peak = 0;
  for (const std::int64_t bytes : p.memory_total)
    peak = std::max(peak, bytes);
  j["peak_memory_bytes"] = peak;
  j["warnings"] = warnings;
  j["no_effect"] = no_effect;
  fmt::print("{}\n", j.dump(2));
}

// --trace: the replay's trace, of every rank or of --trace-ranks'.
void write_trace(const graphs::Prediction& p, const graphs::TrainerConfig& c,
                 const std::vector<rt::DeviceId>& traced, const std::string& trace_ranks) {
  if (!c.trace_path.empty()) {
    if (traced.empty()) {
      rt::write_chrome_trace(p.trace, c.trace_path);
      fmt::print("trace of the replay: {}\n", c.trace_path);
    } else {
      rt::write_chrome_trace(p.trace.only_devices(traced), c.trace_path);
      fmt::print("trace of the replay of {} rank(s) ({}): {}\n", traced.size(), trace_ranks,
                 c.trace_path);
    }
  }
}

// Where weave predict's own flags and the refused flags it models write their values when the
// table names no field.
std::optional<ProgramSetting> predict_setting(const graphs::ConfigFlag& f, PredictOptions& o) {
  if (!std::holds_alternative<std::monostate>(f.field)) return std::nullopt;
  const std::pair<std::string_view, ProgramSetting> settings[] = {
      {"--device-memory", &o.device_memory_gib},
      {"--trace-ranks", &o.trace_ranks},
      {"--every-rank", &o.every_rank},
      {"--json", &o.json},
      {"--advise", &o.advise},
      {"--advise-top", &o.advise_top},
      {"--advise-limit", &o.advise_limit},
      {"--advise-memory-budget", &o.advise_memory_budget_gib}};
  for (const auto& [name, setting] : settings)
    if (name == f.name) return setting;
  throw std::logic_error(fmt::format(
      "the flag table's {} is weave predict's and has no field: give it one or a setting of "
      "weave predict",
      f.name));
}

// weave predict's own flags (the flag table's FlagCommand::predict), then Megatron-LM's flags
// that weave train refuses or takes without effect and a prediction models: the flag table marks
// them. Registered in this order, the
// command printed for the best plan keeps its flags in the order it always had.
void add_predict_flags(CLI::App& cmd, PredictOptions& o) {
  for (const graphs::ConfigFlag& f : graphs::config_flags())
    if (f.command == graphs::FlagCommand::predict)
      add_config_flag(cmd, f, f.help, o.train.config, predict_setting(f, o))
          ->group(std::string(graphs::flag_group_title(f.group)));
  for (const graphs::ConfigFlag& f : graphs::config_flags())
    if (f.has(graphs::kModelledByPredict)) {
      // One weave train takes without effect, registered as such with train's flags, is
      // registered again as what it models here.
      if (CLI::Option* trains = cmd.get_option_no_throw(std::string(f.name)))
        cmd.remove_option(trains);
      add_config_flag(cmd, f, f.predicted_help, o.train.config, predict_setting(f, o));
    }
}

int run_predict(PredictOptions& o, const CLI::App& cmd) {
  check_advice_flags(o);
  derive_config(o.train);
  apply_predicted_training(o);
  graphs::TrainerConfig& c = o.train.config;
  if (o.device_memory_gib > 1e9)
    throw std::invalid_argument(fmt::format(
        "--device-memory {} GiB is more than any device holds: give the device's memory in GiB",
        o.device_memory_gib));
  const std::string accelerator = accelerator_text(o);
  const std::vector<std::string> warnings = o.advise ? validate_model(c) : graphs::validate(c);
  check_writable("--trace", c.trace_path);
  const std::vector<rt::DeviceId> traced = parse_trace_ranks(o, c);
  for (const std::string& w : warnings)
    if (!o.json) fmt::print("warning: {}\n", w);
  if (!o.json && !o.train.no_effect.empty())
    fmt::print("no effect here: {} (docs/flags.md says why)\n", fmt::join(o.train.no_effect, ", "));
  const std::int64_t device_memory =
      modelled_device_memory(o.train, o.device_memory_given ? o.device_memory_gib : 0);
  if (o.train.ampipe_advise) return advise_ampipe(c, device_memory, o.train.no_effect);
  if (o.train.pipeline_advise) return advise_pipeline(c, device_memory);
  if (o.advise)
    return advise_plans(c, {.device_memory_bytes = device_memory,
                            .top = o.advise_top,
                            .max_predictions = o.advise_limit,
                            .memory_budget_bytes = advice_memory_budget(o),
                            .fold = !o.every_rank,
                            .model_flags = model_flags(cmd),
                            .flags_without_effect = o.train.no_effect});
  const StepViewRequest views = step_view_request(o.train);
  check_writable("--dump-graph", views.dump_path);
  check_writable("--report", o.train.report);
  const FigureRequest figure = figure_request(o.train, c);
  const graphs::Prediction p = graphs::predict_step(c, folding(o, c, views, figure));
  auto report = [&] {
    return write_report(
        o.train.report, p.graph, p.trace, views,
        {.title = "weave predict",
         .configuration_json =
             run_record(c, "none: a prediction reads no data", o.train.no_effect).dump(),
         .stage_of_device = graphs::pipeline_stage_of_devices(graphs::Mesh(c.plan)),
         .memory = p.memory,
         .memory_source = "predicted: what the prediction's trackers counted "
                          "each device would hold",
         .memory_over_step = p.memory_over_step});
  };
  if (o.json) {
    print_json(p, c, warnings, o.train.no_effect);
    write_trace(p, c, traced, o.trace_ranks);
    if (!figure.kind.empty()) (void)write_figure(figure, p.trace, c);
    if (!o.train.report.empty()) (void)report();
    return 0;
  }
  print_configuration(c, accelerator);
  print_figures(p, c);
  print_memory(p, o.device_memory_gib);
  write_trace(p, c, traced, o.trace_ranks);
  std::vector<rt::TaskId> path;
  if (views.critical_path)
    path = print_critical_path(p.graph, p.trace, views.what_if, p.what_if_trace,
                               graphs::pipeline_stage_of_devices(graphs::Mesh(c.plan)));
  if (!views.dump_path.empty()) fmt::print("{}\n", write_graph_view(p.graph, views, path));
  if (!figure.kind.empty()) fmt::print("{}\n", write_figure(figure, p.trace, c));
  if (!o.train.report.empty()) fmt::print("{}\n", report());
  return 0;
}

}  // namespace

void add_predict_command(CLI::App& app) {
  auto o = std::make_shared<PredictOptions>();
  CLI::App* cmd = app.add_subcommand(
      "predict",
      "Predict one training step on the virtual clock, from the step's graph built without "
      "tensors: nothing is allocated or computed");
  add_train_flags(*cmd, o->train);
  add_predict_flags(*cmd, *o);
  cmd->footer(
      "Takes weave train's flags (--trace writes the replay). Example:\n"
      "  weave predict --num-layers 8 --hidden-size 1024 --num-attention-heads 16 \\\n"
      "                --seq-length 2048 --devices 16 --tensor-model-parallel-size 4 \\\n"
      "                --pipeline-model-parallel-size 2 --global-batch-size 32 \\\n"
      "                --device-flops 3e14 --device-memory-bandwidth 2e12 --link nvlink4");
  cmd->callback([o, cmd] {
    o->device_memory_given = cmd->get_option("--device-memory")->count() > 0;
    o->advise_top_given = cmd->get_option("--advise-top")->count() > 0;
    o->advise_limit_given = cmd->get_option("--advise-limit")->count() > 0;
    o->advise_memory_budget_given = cmd->get_option("--advise-memory-budget")->count() > 0;
    throw CommandExit{run_predict(*o, *cmd)};
  });
}

}  // namespace weave::cli
