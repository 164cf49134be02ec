// `weave train`: trains the GPT-MoE model over simulated devices with Megatron-LM's flags.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "progress_reporter.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/link_model.hpp"
#include "weave/devices/machine_model.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/checkpoint.hpp"
#include "weave/graphs/learning_rate.hpp"
#include "weave/graphs/pipeline_layout.hpp"
#include "weave/graphs/token_dataset.hpp"
#include "weave/graphs/training_step.hpp"
#include "weave/runtime/chrome_trace.hpp"
#include "weave/runtime/dot_writer.hpp"
#include "weave/runtime/trace_metrics.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::cli {

namespace {

using graphs::Split;
using graphs::TokenDataset;

// The Debian package `fortunes` (installed by tools/dev) puts its text here.
constexpr const char* kDefaultCorpus = "/usr/share/games/fortunes";

struct TrainOptions {
  graphs::ModelConfig model;
  graphs::ParallelPlan plan{.global_batch_size = 0};  // 0: micro-batch x data-parallel size
  graphs::LearningRateSchedule lr{.lr = 3e-3, .min_lr = 3e-4, .warmup_iters = 10};
  graphs::OptimizerConfig optimizer{
      .adamw = {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1}};
  bool swiglu = false;
  int devices = 0;  // 0: tp x cp x pp (one data-parallel replica)
  std::int64_t train_iters = 100;
  std::string data_path = kDefaultCorpus;
  bool mock_data = false;
  double valid_fraction = 0.05;
  std::string save, load;
  int save_interval = 0, eval_interval = 0, eval_iters = 2, log_interval = 10;
  std::string log_json, trace, dump_graph;
  std::int64_t trace_iteration = 2;
  std::string timing = "wall";
  std::string link = "none";
  double device_flops = 1e11;
  std::string config;  // read before parsing (see expand_train_config)
  bool ampipe_advise = false;
  bool ampipe_advise_fast = false;  // replay without running the kernels
  bool pipeline_advise = false;
};

// The FLOPs of one step: the sum of its compute tasks' cost hints (what the virtual clock
// charges), so the reported rate and --timing model agree.
double step_flops(const rt::Graph& graph) {
  double flops = 0;
  for (rt::TaskId t = 0; t < graph.size(); ++t)
    flops += graph.tasks()[t].cost.flops;
  return flops;
}

// Fills every micro-batch of `step` with samples from `first_sample` on.
void fill_batches(graphs::TrainingStep& step, const graphs::ModelConfig& m,
                  const graphs::ParallelPlan& plan, const TokenDataset& data, Split split,
                  std::uint64_t first_sample) {
  const int M = plan.micro_batches(), B = plan.micro_batch_size;
  const std::int64_t S = m.seq_length;
  std::vector<std::int32_t> window;
  for (int dp = 0; dp < plan.data_parallel; ++dp)
    for (int mb = 0; mb < M; ++mb) {
      graphs::MicroBatch& batch = step.micro_batch(dp, mb);
      for (int b = 0; b < B; ++b) {
        data.sample(split, first_sample + static_cast<std::uint64_t>((dp * M + mb) * B + b),
                    window);
        for (std::int64_t s = 0; s < S; ++s) {
          batch.tokens[s * B + b] = window[s];
          batch.targets[s * B + b] = window[s + 1];
        }
      }
    }
}

// One step of `plan` (already validated) with the first samples, replayed on the virtual clock
// under the link and device models of `o`; `execute`: run the kernels. `inspect` sees the step
// and its devices after the replay.
rt::VirtualRunResult replay_step(
    const TrainOptions& o, const graphs::ParallelPlan& plan, const TokenDataset& data, bool execute,
    const std::function<void(graphs::TrainingStep&, devices::DeviceSet&)>& inspect = {}) {
  devices::DeviceSet set(o.devices, {.pin = false});
  devices::SharedMemoryCommunicator comm;
  graphs::TrainingStep step(o.model, plan, o.optimizer, set, comm);
  fill_batches(step, o.model, plan, data, Split::train, 0);
  step.prepare(1, o.lr.at(1));
  std::vector<int> numa;
  for (const auto& placement : set.layout())
    numa.push_back(placement.numa_node);
  const devices::MachineModel machine(numa, o.device_flops, devices::LinkModel::preset(o.link));
  rt::VirtualClock clock(machine, {.execute = execute, .record_trace = true});
  rt::VirtualRunResult run = clock.run(step.graph());
  if (inspect) inspect(step, set);
  return run;
}

// --ampipe-advise: one step of the configuration at every Ampipe degree the rules allow,
// replayed on the virtual clock with the link and device models given, and the fastest named.
int advise_ampipe(TrainOptions o, const TokenDataset& data) {
  const devices::LinkModel links = devices::LinkModel::preset(o.link);
  fmt::print(
      "Ampipe degrees for this configuration on the virtual clock ({} devices of {:.3g} "
      "FLOP/s, link {}{}):\n",
      o.devices, o.device_flops, links.describe(),
      o.ampipe_advise_fast ? "; kernels not run, all-to-alls timed for balanced routing" : "");
  fmt::print("{:>7} {:>11} {:>20} {:>19} {:>9}\n", "degree", "step (ms)", "exposed comm (ms/dev)",
             "exposed a2a (ms/dev)", "speed-up");
  double baseline = 0, best_time = 0;
  int best = 1;
  for (int degree = 1; degree <= 16; degree *= 2) {
    graphs::ParallelPlan plan = o.plan;
    plan.ampipe_degree = degree;
    try {
      const std::vector<std::string> warnings = graphs::validate(o.model, plan);
      const rt::VirtualRunResult r = replay_step(o, plan, data, !o.ampipe_advise_fast);
      const rt::TraceMetrics metrics = rt::measure(r.trace);
      constexpr std::string_view kAllToAll[] = {"dispatch", "combine"};
      const double per_device = 1e-6 / static_cast<double>(o.devices);
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

// --pipeline-advise: one step of the configuration under every pipeline schedule, replayed on
// the virtual clock (a MoE model's kernels run, so its routing is real): the step time, the bubble
// measured in the training graph beside the schedule's formula, and the activation memory each
// stage holds. The fastest is named.
int advise_pipeline(TrainOptions o, const TokenDataset& data) {
  if (o.plan.pipeline_parallel < 2)
    throw graphs::ConfigError(
        "--pipeline-advise compares pipeline schedules: set --pipeline-model-parallel-size >= 2");
  const devices::LinkModel links = devices::LinkModel::preset(o.link);
  const int p = o.plan.pipeline_parallel;
  fmt::print(
      "Pipeline schedules for this configuration on the virtual clock ({} devices of {:.3g} "
      "FLOP/s, link {}; p = {}, {} micro-batches):\n",
      o.devices, o.device_flops, links.describe(), p, o.plan.micro_batches());
  fmt::print("{:<16} {:>2} {:>10} {:>16} {:>14}  {}\n", "schedule", "v", "step (ms)",
             "bubble measured", "bubble theory", "activations per stage: sets, MiB");
  std::string best;
  double best_time = 0;
  for (const std::string& name : graphs::schedule_names()) {
    graphs::ParallelPlan plan = o.plan;
    plan.pipeline_scheduler = name;
    plan.layers_per_virtual_stage = 0;
    const graphs::ScheduleKind kind = graphs::schedule_kind(name);
    const bool chunked = kind == graphs::ScheduleKind::Interleaved ||
                         kind == graphs::ScheduleKind::InterleavedMem ||
                         kind == graphs::ScheduleKind::ZeroBubbleV;
    plan.virtual_pipeline = chunked ? std::max(2, o.plan.virtual_pipeline) : 1;
    if (kind == graphs::ScheduleKind::ZeroBubbleV) plan.virtual_pipeline = 2;
    if (kind != graphs::ScheduleKind::Interleaved) plan.microbatch_group_size = 0;
    try {
      graphs::validate(o.model, plan);
      std::string memory;
      // A dense model's costs do not depend on the data: its kernels need not run.
      const rt::VirtualRunResult r = replay_step(
          o, plan, data, o.model.num_experts > 0,
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

int run_train(TrainOptions o) {
  o.model.activation = o.swiglu ? graphs::Activation::swiglu : graphs::Activation::gelu;
  graphs::ParallelPlan& plan = o.plan;
  const int model_parallel = plan.tensor_parallel * plan.context_parallel * plan.pipeline_parallel;
  if (o.devices == 0) o.devices = model_parallel;
  if (o.devices % model_parallel != 0)
    throw graphs::ConfigError(fmt::format(
        "--devices ({}) must be a multiple of tensor x context x pipeline parallel ({}): the rest "
        "is data parallelism",
        o.devices, model_parallel));
  plan.data_parallel = o.devices / model_parallel;
  if (plan.global_batch_size == 0)
    plan.global_batch_size = plan.micro_batch_size * plan.data_parallel;
  if (o.lr.decay_iters == 0) o.lr.decay_iters = o.train_iters;
  o.lr.at(1);  // checks the schedule's settings
  ProgressReporter progress(o.train_iters, o.log_interval, o.log_json);
  for (const std::string& w : graphs::validate(o.model, plan))
    progress.note("warning: " + w);

  const TokenDataset data =
      o.mock_data ? TokenDataset::mock(o.model.seq_length, o.model.seed)
                  : TokenDataset::from_text(o.data_path, o.model.seq_length, o.valid_fraction);
  if (o.ampipe_advise_fast && !o.ampipe_advise)
    throw std::invalid_argument(
        "--ampipe-advise-fast changes how --ampipe-advise replays: add --ampipe-advise");
  if (o.ampipe_advise) return advise_ampipe(o, data);
  if (o.pipeline_advise) return advise_pipeline(o, data);
  devices::DeviceSet set(o.devices);
  devices::SharedMemoryCommunicator comm;
  graphs::TrainingStep step(o.model, plan, o.optimizer, set, comm);
  const devices::LinkModel links = devices::LinkModel::preset(o.link);
  std::vector<int> numa;
  for (const auto& p : set.layout())
    numa.push_back(p.numa_node);
  const devices::MachineModel machine(numa, o.device_flops, links);

  progress.note(fmt::format(
      "weave train: {} layers, hidden {}, {} heads, {}{} | {} devices: tp {}{}, cp {}, ep {}, dp "
      "{}{}{} | micro-batch {}, global batch {} ({} micro-batches) | data: {}",
      o.model.num_layers, o.model.hidden_size, o.model.num_attention_heads,
      o.model.num_experts > 0
          ? fmt::format("{} experts top-{}", o.model.num_experts, o.model.moe_router_topk)
          : "dense",
      o.swiglu ? ", SwiGLU" : "", o.devices, plan.tensor_parallel,
      plan.sequence_parallel ? " + sp" : "", plan.context_parallel, plan.expert_parallel,
      plan.data_parallel,
      plan.ampipe_degree > 1 ? fmt::format(", ampipe {}", plan.ampipe_degree) : "",
      plan.pipeline_parallel > 1
          ? fmt::format(", pp {} ({}{})", plan.pipeline_parallel,
                        graphs::schedule_name(graphs::pipeline_schedule_kind(plan)),
                        plan.virtual_pipeline > 1
                            ? fmt::format(", {} chunks per rank", plan.virtual_pipeline)
                            : "")
          : "",
      plan.micro_batch_size, plan.global_batch_size, plan.micro_batches(), data.description()));
  if (!o.dump_graph.empty()) {
    std::ofstream dot(o.dump_graph);
    rt::write_dot(step.graph(), dot);
    progress.note(fmt::format("graph: {} tasks, written to {}", step.graph().size(), o.dump_graph));
  }

  graphs::CheckpointState state;
  if (!o.load.empty()) {
    state = graphs::load_checkpoint(o.load, o.model, plan, step);
    progress.note(fmt::format("resumed from {} at iteration {}", o.load, state.iteration));
  }
  auto save = [&] {
    if (o.save.empty()) return;
    graphs::save_checkpoint(o.save, o.model, plan, step, state);
    progress.note(fmt::format("saved {} (iteration {})", o.save, state.iteration));
  };

  auto fill = [&](Split split, std::uint64_t first_sample) {
    fill_batches(step, o.model, plan, data, split, first_sample);
  };
  const std::int64_t S = o.model.seq_length;
  rt::VirtualClock clock(machine, {.execute = true, .record_trace = true});
  // Runs the step once; returns seconds (wall or modelled) and, when traced, its metrics.
  auto run_once =
      [&](bool traced,
          std::int64_t iteration) -> std::pair<double, std::optional<rt::TraceMetrics>> {
    if (o.timing == "model") {
      const rt::VirtualRunResult r = clock.run(step.graph());
      if (!o.trace.empty() && iteration == o.trace_iteration)
        rt::write_chrome_trace(r.trace, o.trace);
      return {static_cast<double>(r.makespan) * 1e-9, rt::measure(r.trace)};
    }
    const auto t0 = std::chrono::steady_clock::now();
    const rt::RunResult r = set.executor().run(
        step.graph(), {.record_trace = traced, .link_model = links.enabled() ? &machine : nullptr});
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!traced) return {seconds, std::nullopt};
    if (!o.trace.empty() && iteration == o.trace_iteration)
      rt::write_chrome_trace(r.trace, o.trace);
    return {seconds, rt::measure(r.trace)};
  };

  double first_loss = 0, last_loss = 0, total_seconds = 0;
  std::int64_t iterations_run = 0;
  const double tokens_per_step = static_cast<double>(S * plan.global_batch_size);
  for (std::int64_t it = state.iteration + 1; it <= o.train_iters; ++it) {
    fill(Split::train, state.consumed_samples);
    const double lr = o.lr.at(it);
    step.prepare(it, lr);
    step.set_update_parameters(true);
    const bool traced = it == o.trace_iteration || it % o.log_interval == 0;
    const auto [seconds, metrics] = run_once(traced, it);
    std::optional<double> exposed, bubble;
    if (metrics) exposed = metrics->exposed_comm_share();
    // With pipeline stages the time a stage waits for its next receive is the bubble, not
    // communication to hide: show it apart.
    if (metrics && plan.pipeline_parallel > 1) bubble = metrics->compute_bubble();
    const graphs::StepResult r = step.result();
    state.iteration = it;
    state.consumed_samples += static_cast<std::uint64_t>(plan.global_batch_size);
    if (iterations_run++ == 0) first_loss = r.loss;
    last_loss = r.loss;
    total_seconds += seconds;
    std::optional<std::int64_t> dropped;
    if (o.model.num_experts > 0 && o.model.moe_expert_capacity_factor > 0)
      dropped = r.dropped_picks;
    progress.iteration({it, r.loss, r.aux_loss, r.grad_norm, lr, seconds, tokens_per_step, exposed,
                        dropped, r.routed_picks, bubble});
    if (!std::isfinite(r.loss))
      throw std::runtime_error(
          fmt::format("the loss is {} at iteration {}: lower --lr or raise "
                      "--clip-grad's strictness",
                      r.loss, it));
    if (o.eval_interval > 0 && it % o.eval_interval == 0) {
      double sum = 0;
      step.set_update_parameters(false);
      for (int e = 0; e < o.eval_iters; ++e) {
        fill(Split::valid, static_cast<std::uint64_t>(e * plan.global_batch_size));
        run_once(false, 0);
        sum += step.result().loss;
      }
      progress.validation(it, sum / std::max(1, o.eval_iters));
    }
    if (o.save_interval > 0 && it % o.save_interval == 0) save();
  }
  progress.finish();
  save();
  if (total_seconds > 0)
    progress.note(fmt::format(
        "done: loss {:.4f} -> {:.4f} | {:.0f} tokens/s {} | {:.1f} GFLOP/s of model math{}",
        first_loss, last_loss,
        tokens_per_step * static_cast<double>(iterations_run) / total_seconds,
        o.timing == "model" ? "(modelled)" : "(wall)",
        step_flops(step.graph()) * static_cast<double>(iterations_run) / total_seconds * 1e-9,
        o.trace.empty() ? ""
                        : fmt::format(" | trace of iteration {}: {}", o.trace_iteration, o.trace)));
  return 0;
}

}  // namespace

void add_train_command(CLI::App& app) {
  auto o = std::make_shared<TrainOptions>();
  CLI::App* cmd = app.add_subcommand("train", "Train the GPT-MoE model over simulated devices");
  // --config's values come first on the command line; a flag given again overrides them.
  cmd->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  auto& m = o->model;
  auto& p = o->plan;
  cmd->add_option("--config", o->config,
                  "JSON file of flag names and values (flags given here win)");
  cmd->add_option("--num-layers", m.num_layers)->check(at_least(1))->capture_default_str();
  cmd->add_option("--hidden-size", m.hidden_size)->check(at_least(1))->capture_default_str();
  cmd->add_option("--num-attention-heads", m.num_attention_heads)
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--ffn-hidden-size", m.ffn_hidden_size)
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--seq-length", m.seq_length)->check(at_least(1))->capture_default_str();
  cmd->add_option("--max-position-embeddings", m.max_position_embeddings)->capture_default_str();
  cmd->add_option("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by)
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_flag("--swiglu", o->swiglu, "SwiGLU MLPs instead of GELU");
  cmd->add_option("--hidden-dropout", m.hidden_dropout)->capture_default_str();
  cmd->add_option("--init-method-std", m.init_method_std)->check(positive())->capture_default_str();
  cmd->add_option("--num-experts", m.num_experts, "0: dense model")
      ->check(at_least(0))
      ->capture_default_str();
  cmd->add_option("--moe-layer-freq", m.moe_layer_freq)->check(at_least(1))->capture_default_str();
  cmd->add_option("--moe-router-topk", m.moe_router_topk)
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--moe-aux-loss-coeff", m.moe_aux_loss_coeff)->capture_default_str();
  cmd->add_option("--moe-z-loss-coeff", m.moe_z_loss_coeff)->capture_default_str();
  cmd->add_option("--moe-expert-capacity-factor", m.moe_expert_capacity_factor, "0: dropless")
      ->capture_default_str();
  cmd->add_option("--seed", m.seed)->capture_default_str();
  cmd->add_option("--devices", o->devices, "Simulated devices (default: tp x cp x pp)")
      ->check(at_least(1));
  cmd->add_option("--tensor-model-parallel-size", p.tensor_parallel)
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_flag("--sequence-parallel", p.sequence_parallel);
  cmd->add_option("--ampipe-degree", p.ampipe_degree,
                  "Sequence chunks pipelining attention with the MoE all-to-alls (Ampipe)")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_flag("--ampipe-tp-sp-comm-overlap", p.ampipe_tp_sp_comm_overlap,
                "Pipeline the experts' tensor-parallel collectives (MindSpeed; switched off with a "
                "warning: weave's experts are not tensor-parallel)");
  cmd->add_flag("--use-pipe-experts", p.pipe_experts,
                "Run each MoE slot as items (local expert x capacity slice), each with its own "
                "dispatch and combine all-to-all");
  cmd->add_flag("--pipe-experts-multi-stream", p.pipe_experts_multi_stream,
                "With --use-pipe-experts: dispatches and combines on streams of their own");
  cmd->add_option("--pipe-experts-multi-data", p.pipe_experts_multi_data,
                  "With --use-pipe-experts: capacity slices per expert (divided among Ampipe "
                  "chunks)")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_flag("--ampipe-advise", o->ampipe_advise,
                "Instead of training: replay one step at each Ampipe degree on the virtual clock "
                "(--link, --device-flops) and name the fastest");
  cmd->add_flag("--ampipe-advise-fast", o->ampipe_advise_fast,
                "With --ampipe-advise: replay without running the kernels, all-to-alls timed as "
                "for balanced routing (for many devices)");
  cmd->add_flag("--pipeline-advise", o->pipeline_advise,
                "Instead of training: replay one step under every pipeline schedule on the "
                "virtual clock (--link, --device-flops): step time, bubble measured and in "
                "theory, activation memory per stage");
  cmd->add_flag("--use-distributed-optimizer", p.distributed_optimizer,
                "Shard optimizer state over data-parallel replicas (reduce-scatter + all-gather)");
  cmd->add_option("--context-parallel-size", p.context_parallel)
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--expert-model-parallel-size", p.expert_parallel)
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--pipeline-model-parallel-size", p.pipeline_parallel)
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--pipeline-scheduler", p.pipeline_scheduler,
                  "gpipe, 1f1b, interleaved, interleaved-mem, zb-h1 or zb-v (default: 1f1b, "
                  "interleaved with virtual stages); `weave schedule` draws them");
  cmd->add_option("--num-layers-per-virtual-pipeline-stage", p.layers_per_virtual_stage,
                  "Layers per model chunk: chunks per pipeline rank = layers / (pp x this)")
      ->check(at_least(1));
  cmd->add_option("--virtual-pipeline-model-parallel-size", p.virtual_pipeline,
                  "Model chunks per pipeline rank (instead of "
                  "--num-layers-per-virtual-pipeline-stage)")
      ->check(at_least(1));
  cmd->add_option("--microbatch-group-size-per-virtual-pipeline-stage", p.microbatch_group_size,
                  "Interleaved schedule: micro-batches run on one chunk before the next (default: "
                  "pp)")
      ->check(at_least(1));
  cmd->add_option("--decoder-first-pipeline-num-layers", p.first_stage_layers,
                  "Layers of the first model chunk (the rest split evenly)")
      ->check(at_least(1));
  cmd->add_option("--decoder-last-pipeline-num-layers", p.last_stage_layers,
                  "Layers of the last model chunk (the rest split evenly)")
      ->check(at_least(1));
  cmd->add_option("--micro-batch-size", p.micro_batch_size)
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--global-batch-size", p.global_batch_size,
                  "Default: micro-batch x data-parallel size")
      ->check(at_least(1));
  cmd->add_option("--train-iters", o->train_iters)->check(at_least(1))->capture_default_str();
  cmd->add_option("--lr", o->lr.lr)->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--min-lr", o->lr.min_lr)->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--lr-warmup-iters", o->lr.warmup_iters)
      ->check(at_least(0))
      ->capture_default_str();
  cmd->add_option("--lr-decay-iters", o->lr.decay_iters, "Default: --train-iters")
      ->check(at_least(0));
  cmd->add_option("--lr-decay-style", o->lr.style)
      ->check(CLI::IsMember({"cosine", "linear", "constant"}))
      ->capture_default_str();
  cmd->add_option("--weight-decay", o->optimizer.adamw.weight_decay)
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--adam-beta1", o->optimizer.adamw.beta1)->capture_default_str();
  cmd->add_option("--adam-beta2", o->optimizer.adamw.beta2)->capture_default_str();
  cmd->add_option("--adam-eps", o->optimizer.adamw.eps)->capture_default_str();
  cmd->add_option("--clip-grad", o->optimizer.clip_grad, "0: no clipping")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--data-path", o->data_path, "A text file or a folder of them (byte tokens)")
      ->capture_default_str();
  cmd->add_flag("--mock-data", o->mock_data, "Synthetic tokens instead of --data-path");
  cmd->add_option("--save", o->save, "Checkpoint file to write");
  cmd->add_option("--load", o->load, "Checkpoint file to resume from");
  cmd->add_option("--save-interval", o->save_interval)->check(at_least(0));
  cmd->add_option("--eval-interval", o->eval_interval)->check(at_least(0));
  cmd->add_option("--eval-iters", o->eval_iters)->check(at_least(1))->capture_default_str();
  cmd->add_option("--log-interval", o->log_interval)->check(at_least(1))->capture_default_str();
  cmd->add_option("--log-json", o->log_json, "Write metrics as JSON lines to this file");
  cmd->add_option("--trace", o->trace, "Write the Chrome trace of one iteration here");
  cmd->add_option("--trace-iteration", o->trace_iteration, "Which iteration --trace records")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--dump-graph", o->dump_graph,
                  "Write the step's task graph as GraphViz DOT here");
  cmd->add_option("--timing", o->timing, "wall: real threads; model: the virtual clock")
      ->check(CLI::IsMember({"wall", "model"}))
      ->capture_default_str();
  cmd->add_option("--link", o->link,
                  "Link model: a preset (see `weave topo --links`) or GBPS:MICROSECONDS")
      ->capture_default_str();
  cmd->add_option("--device-flops", o->device_flops, "Modelled FLOP/s of a device (--timing model)")
      ->check(positive())
      ->capture_default_str();
  cmd->callback([o] { throw CommandExit{run_train(*o)}; });
}

}  // namespace weave::cli
