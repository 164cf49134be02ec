#include "weave/graphs/prediction.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <string_view>
#include <utility>

#include "replay_figures.hpp"
#include "step/comm_streams.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/folded_communicator.hpp"
#include "weave/graphs/mesh.hpp"
#include "weave/graphs/pipeline_layout.hpp"
#include "weave/graphs/step_report.hpp"
#include "weave/graphs/training_step.hpp"
#include "weave/graphs/virtual_replay.hpp"
#include "weave/runtime/trace_metrics.hpp"
#include "weave/runtime/virtual_clock.hpp"
#include "weave/runtime/what_if.hpp"

namespace weave::graphs {

namespace {

// An MLP's forward FLOPs per token for a hidden size of `ffn` (the dense MLP's, or one routed
// expert's), as Megatron-LM counts them.
double mlp_forward_flops(const ModelConfig& m, int ffn) {
  const double matrices = m.activation == Activation::swiglu ? 3 : 2;
  return 2.0 * m.hidden_size * ffn * matrices;
}

double mlp_forward_flops(const ModelConfig& m) {
  return mlp_forward_flops(m, m.ffn_hidden_size);
}

// Forward FLOPs of layer l per token, as Megatron-LM counts them: a MoE layer's router and the
// top-k experts each token passes through (--moe-ffn-hidden-size wide) and the shared experts
// (--moe-shared-expert-intermediate-size wide).

// A MoE layer's MLP per token: the router's logits, its top-k experts and its shared experts.
double moe_forward_flops(const ModelConfig& m) {
  return 2.0 * m.hidden_size * m.num_experts +
         m.moe_router_topk * mlp_forward_flops(m, m.expert_ffn_hidden_size()) +
         (m.has_shared_experts() ? mlp_forward_flops(m, m.moe_shared_expert_intermediate_size)
                                 : 0.0);
}

double layer_forward_flops(const ModelConfig& m, int l) {
  const double h = m.hidden_size, s = m.seq_length, d = m.head_dim();
  const double heads = m.num_attention_heads, groups = m.query_groups();
  const double attention = 2 * h * (heads + 2 * groups) * d + 4 * s * heads * d + 2 * heads * d * h;
  const double ffn = m.is_moe_layer(l) ? moe_forward_flops(m) : mlp_forward_flops(m);
  return attention + ffn;
}

}  // namespace

double model_flops_per_step(const ModelConfig& m, const ParallelPlan& plan, bool recompute) {
  const double h = m.hidden_size, s = m.seq_length;
  double layers = 0;  // forward FLOPs of every layer, per token
  for (int l = 0; l < m.num_layers; ++l)
    layers += layer_forward_flops(m, l);
  const double output = 2 * h * m.padded_vocab_size(plan.tensor_parallel);
  const double tokens = static_cast<double>(plan.global_batch_size) * s;
  return tokens * ((recompute ? 4 : 3) * layers + 3 * output);
}

double recomputed_flops_per_step(const ModelConfig& m, const ParallelPlan& plan) {
  const PipelineLayout layout = make_pipeline_layout(m, plan);
  double layers = 0;
  for (int l = 0; l < m.num_layers; ++l) {
    if (!recompute_group(m.recompute, layout, l).empty()) {
      layers += layer_forward_flops(m, l);
      continue;
    }
    if (!m.is_moe_layer(l) && m.recompute.recomputes(kRecomputeMlp)) layers += mlp_forward_flops(m);
    if (m.is_moe_layer(l) && m.recompute.recomputes(kRecomputeMoe)) layers += moe_forward_flops(m);
    // Materialised scores recomputed: QK^T and the product with V over the square, as
    // Megatron-LM counts them.
    if (m.materialised_scores() && m.recompute.recomputes(kRecomputeCoreAttention))
      layers += 4.0 * m.seq_length * m.num_attention_heads * m.head_dim();
  }
  return static_cast<double>(plan.global_batch_size) * m.seq_length * layers;
}

namespace {

// prediction_tasks_bound's counts, each at least what the step's builders add (measured over the
// candidates of tests/graphs/plan_search_test.cpp's searches, dense and MoE).
constexpr std::int64_t kTasksPerLayer = 22;
constexpr std::int64_t kTasksPerSequenceChunk = 8;  // each chunk past the first
constexpr std::int64_t kTasksPerTensorParallelLayer = 12;
constexpr std::int64_t kTasksPerMoeLayer = 8;
constexpr std::int64_t kTasksPerLocalExpert = 1;
constexpr std::int64_t kTasksPerStageAndMicroBatch = 8;
constexpr std::int64_t kTasksPerLayerAndStep = 4;
constexpr std::int64_t kTasksPerStage = 16;
// prediction_memory_bytes: what a prediction holds per task built (the graph's task, its edges
// and name, the trace's span, the builder's and the collectives' bookkeeping) and per device
// modelled (its memory tracker, streams and communicator state, held or folded), above what
// bench/predict_scale.py's predictions were measured to hold past the program's own 14 MiB:
// Llama 3 405B's 47,416 tasks in 30 MiB over 128 devices (630 bytes a task), 39 MiB more over
// 4,096 devices (10 KiB a device), 187 MiB over 16,384.
constexpr std::int64_t kPredictionBytesPerTask = 768;
constexpr std::int64_t kPredictionBytesPerDevice = 12 * 1024;

// The ranks a prediction builds, and the rank each device's figures are read from: with folding,
// a data-parallel replica reads its first replica's, a tensor- or context-parallel rank its
// group's first.
struct ReplayedRanks {
  std::vector<int> built, source;
  std::vector<bool> held;  // per device: built here
};

ReplayedRanks ranks_to_replay(const ParallelPlan& plan, const Mesh& mesh,
                              const PredictionOptions& options) {
  ReplayedRanks ranks;
  ranks.source.resize(static_cast<std::size_t>(plan.devices()));
  ranks.held.assign(static_cast<std::size_t>(plan.devices()), false);
  for (int r = 0; r < plan.devices(); ++r) {
    ranks.source[static_cast<std::size_t>(r)] = replayed_rank(mesh, r, options);
    if (ranks.source[static_cast<std::size_t>(r)] == r) {
      ranks.built.push_back(r);
      ranks.held[static_cast<std::size_t>(r)] = true;
    }
  }
  return ranks;
}

// The step's time, throughput and FLOP counts, and the share of the peak they reach.
void read_throughput(const TrainerConfig& config, rt::Nanos makespan, Prediction& p) {
  const ModelConfig& m = config.model;
  const ParallelPlan& plan = config.plan;
  const double seconds = static_cast<double>(makespan) * 1e-9;
  p.step_ms = seconds * 1e3;
  p.tokens_per_second = static_cast<double>(plan.global_batch_size) * m.seq_length / seconds;
  p.model_flops = model_flops_per_step(m, plan, false);
  p.model_flops_recompute = model_flops_per_step(m, plan, true);
  p.flops_recomputed = recomputed_flops_per_step(m, plan);
  p.flops_per_device = p.model_flops / seconds / plan.devices();
  const double peak =
      config.machine.peak_flops > 0 ? config.machine.peak_flops : config.machine.device_flops;
  p.mfu = p.flops_per_device / peak;
}

// Each process group's exposed communication, summed over the replayed devices.
void read_exposed_by_group(const rt::Trace& trace, ReplayFigures& f) {
  const auto groups = streams_by_group(trace.tasks());
  std::vector<std::vector<rt::StreamId>> sets;
  for (const auto& [name, streams] : groups) {
    f.groups.push_back(name);
    sets.push_back(streams);
  }
  f.exposed = rt::exposed_comm_on_stream_sets(trace, sets);
}

// Each compute task's span split into ComputeKind by the time each part of its cost takes on the
// modelled device, as devices::MachineModel prices them (the kernel model: products, attention
// and streamed bytes one after another; the roofline: whichever bounds the task). The optimizer's
// tasks count whole as the optimizer.
std::array<rt::Nanos, kComputeKindCount> compute_by_kind(const rt::Trace& trace,
                                                         const ModelledMachine& m) {
  std::array<rt::Nanos, kComputeKindCount> out{};
  const rt::TaskTable& tasks = trace.tasks();
  const auto at = [](ComputeKind k) { return static_cast<std::size_t>(k); };
  for (const rt::Span& span : trace.spans()) {
    const rt::TaskInfo& t = tasks[span.task];
    if (t.kind != rt::TaskKind::compute) continue;
    const rt::Nanos duration = span.end - span.start;
    const std::string_view name = tasks.name(span.task);
    if (name == "zero_grads" || name == "grad_norm" || name == "optimizer") {
      out[at(ComputeKind::optimizer)] += duration;
      continue;
    }
    const rt::CostHint& c = t.cost;
    const double bytes = m.device_memory_bandwidth > 0 ? c.bytes / m.device_memory_bandwidth : 0;
    double products = 0, attention = 0, launch = 0;
    if (m.attention_flops > 0) {
      const bool backward =
          t.tags.phase == rt::Phase::backward || t.tags.phase == rt::Phase::weight;
      const double rate = backward && m.attention_backward_flops > 0 ? m.attention_backward_flops
                                                                     : m.attention_flops;
      products = (std::max(c.flops - c.attention_flops, 0.0) +
                  m.matmul_overhead_dimension * c.matmul_edges) /
                 m.device_flops;
      attention = c.attention_flops / rate;
      launch = m.kernel_launch_seconds * static_cast<double>(c.messages);
    } else {
      products = c.flops / m.device_flops;
    }
    const double total =
        m.attention_flops > 0 ? products + attention + bytes + launch : std::max(products, bytes);
    if (!(total > 0)) {
      out[at(ComputeKind::elementwise)] += duration;
      continue;
    }
    const double d = static_cast<double>(duration);
    const bool roofline = m.attention_flops <= 0;
    const auto product_ns = static_cast<rt::Nanos>(
        std::llround(roofline ? (products >= bytes ? d : 0) : d * products / total));
    const auto attention_ns = static_cast<rt::Nanos>(std::llround(d * attention / total));
    const auto launch_ns = static_cast<rt::Nanos>(std::llround(d * launch / total));
    out[at(ComputeKind::products)] += product_ns;
    out[at(ComputeKind::attention)] += attention_ns;
    out[at(ComputeKind::launch)] += launch_ns;
    out[at(ComputeKind::elementwise)] += duration - product_ns - attention_ns - launch_ns;
  }
  return out;
}

// Each device's peak memory by category and in total, read from the rank it was folded onto.
void read_memory(devices::DeviceSet& set, const std::vector<int>& source, ReplayFigures& f) {
  for (std::size_t d = 0; d < set.size(); ++d) {
    const auto id = static_cast<rt::DeviceId>(source[d]);
    std::array<std::int64_t, rt::kMemoryCategoryCount> bytes{};
    for (std::size_t c = 0; c < rt::kMemoryCategoryCount; ++c)
      bytes[c] = set.memory().peak(id, static_cast<rt::MemoryCategory>(c));
    f.memory.push_back(bytes);
    f.memory_total.push_back(set.memory().peak_total(id));
  }
}

// What a replay keeps besides its figures: its trace, graph and memory over the step (a single
// prediction shows them), or nothing (a micro-batch fold extrapolates the figures alone, and
// holding its three replays' traces and graphs at once would triple what it holds).
enum class ReplayViews { kept, dropped };

// The step of a validated `config` built without tensors and replayed on the virtual clock.
ReplayFigures replay(const TrainerConfig& config, const PredictionOptions& options,
                     ReplayViews views = ReplayViews::kept) {
  const ParallelPlan& plan = config.plan;
  const Mesh mesh(plan);
  const ReplayedRanks ranks = ranks_to_replay(plan, mesh, options);
  std::vector<rt::DeviceId> ids(ranks.built.begin(), ranks.built.end());
  devices::DeviceSet set(plan.devices(), {.pin = false, .held = ids});
  devices::FoldedCommunicator comm(ranks.held);
  TrainingStep step(config.model, plan, config.step_optimizer(), set, comm,
                    {.ranks = ranks.built, .materialize = false, .record_memory = true});
  if (options.most_tasks > 0) check_report_size(step.graph().size(), options.most_tasks);
  step.prepare(1, config.learning_rate.at(1));
  const devices::MachineModel machine = machine_model(set, config.machine);
  rt::VirtualClock clock(machine, {.execute = false, .record_trace = true});
  rt::VirtualRunResult run = clock.run(step.graph());

  ReplayFigures f;
  f.makespan = run.makespan;
  f.replayed_devices = static_cast<int>(ranks.built.size());
  f.tasks_built = static_cast<std::int64_t>(step.graph().size());
  const rt::TraceMetrics metrics = rt::measure(run.trace);
  f.compute_busy = metrics.total_compute();
  f.compute_idle = metrics.total_compute_idle();
  f.exposed_total = metrics.total_exposed_comm();
  read_exposed_by_group(run.trace, f);
  f.compute_by_kind = compute_by_kind(run.trace, config.machine);
  read_memory(set, ranks.source, f);
  if (views == ReplayViews::dropped) return f;
  if (options.memory_over_step) {
    const MemoryTimeline built = memory_timeline(step.memory_events(), run.trace, set.size());
    for (std::size_t d = 0; d < set.size(); ++d)
      f.memory_over_step.devices.push_back(
          built.devices[static_cast<std::size_t>(ranks.source[d])]);
  }
  f.trace = std::move(run.trace);
  if (!options.what_if.empty()) {
    const rt::WhatIfCostModel changed(machine, options.what_if);
    f.what_if_trace = rt::VirtualClock(changed, {.execute = false}).run(step.graph()).trace;
  }
  f.graph = step.graph();
  return f;
}

// The micro-batch counts a folded prediction replays: m1, m1 + k and m1 + 2k, k a whole number
// of pipeline rounds (and of interleaving's micro-batch groups), m1 past two rounds of every
// virtual stage's warm-up and m1 = m (mod k); none when that saves less than a replay.
std::optional<std::array<int, 3>> micro_batches_to_replay(const ParallelPlan& plan) {
  const int m = plan.micro_batches();
  int k = plan.pipeline_parallel;
  if (plan.microbatch_group_size > 0) k = std::lcm(k, plan.microbatch_group_size);
  const int warm_up = 2 * plan.pipeline_parallel * plan.virtual_pipeline;
  int m1 = m % k;
  while (m1 < warm_up || m1 == 0)
    m1 += k;
  if (m1 + 3 * k > m) return std::nullopt;
  return std::array<int, 3>{m1, m1 + k, m1 + 2 * k};
}

// Replays of the step with three smaller micro-batch counts, extrapolated to the configured
// count when every figure grows by the same amount each period; none when they do not or a
// smaller count is refused.
std::optional<ReplayFigures> replay_folding_micro_batches(const TrainerConfig& config,
                                                          const PredictionOptions& options) {
  const ParallelPlan& plan = config.plan;
  const auto counts = micro_batches_to_replay(plan);
  if (!counts) return std::nullopt;
  std::vector<ReplayFigures> replays;
  for (const int count : *counts) {
    TrainerConfig fewer = config;
    fewer.plan.global_batch_size = count * plan.micro_batch_size * plan.data_parallel;
    try {
      validate(fewer);
    } catch (const ConfigError&) {
      return std::nullopt;
    }
    replays.push_back(replay(fewer, options, ReplayViews::dropped));
  }
  const int period = (*counts)[1] - (*counts)[0];
  std::optional<ReplayFigures> folded = extrapolate(replays[0], replays[1], replays[2],
                                                    (plan.micro_batches() - (*counts)[0]) / period);
  if (folded) folded->micro_batches.assign(counts->begin(), counts->end());
  return folded;
}

// A prediction's figures from its replay's.
Prediction prediction_of(const TrainerConfig& config, ReplayFigures f) {
  Prediction p;
  read_throughput(config, f.makespan, p);
  p.replayed_devices = f.replayed_devices;
  p.tasks_built = f.tasks_built;
  p.micro_batches_replayed =
      f.micro_batches.empty() ? std::vector<int>{config.plan.micro_batches()} : f.micro_batches;
  // As rt::TraceMetrics::compute_bubble, from the (possibly extrapolated) sums.
  p.bubble = f.compute_busy > 0
                 ? static_cast<double>(f.compute_idle) / static_cast<double>(f.compute_busy)
                 : 0;
  p.exposed_ms_per_device = static_cast<double>(f.exposed_total) * 1e-6 / f.replayed_devices;
  for (std::size_t k = 0; k < kComputeKindCount; ++k)
    p.compute_ms_per_device[k] =
        static_cast<double>(f.compute_by_kind[k]) * 1e-6 / f.replayed_devices;
  for (std::size_t g = 0; g < f.groups.size(); ++g)
    if (f.exposed[g] > 0)
      p.exposed.push_back(
          {f.groups[g], static_cast<double>(f.exposed[g]) * 1e-6 / f.replayed_devices});
  p.memory = std::move(f.memory);
  p.memory_total = std::move(f.memory_total);
  p.trace = std::move(f.trace);
  p.memory_over_step = std::move(f.memory_over_step);
  p.graph = std::move(f.graph);
  p.what_if_trace = std::move(f.what_if_trace);
  return p;
}

}  // namespace

std::string_view to_string(ComputeKind kind) {
  switch (kind) {
    case ComputeKind::products:
      return "products";
    case ComputeKind::attention:
      return "attention";
    case ComputeKind::elementwise:
      return "elementwise";
    case ComputeKind::optimizer:
      return "optimizer";
    case ComputeKind::launch:
      return "launch";
  }
  return "unknown";
}

int replayed_rank(const Mesh& mesh, int rank, const PredictionOptions& options) {
  const MeshCoordinates at = mesh.coordinates(rank);
  return mesh.rank_of(options.fold_tensor_parallel ? 0 : at.tp,
                      options.fold_context_parallel ? 0 : at.cp,
                      options.fold_data_parallel ? 0 : at.dp, at.pp);
}

Prediction predict_step(TrainerConfig config, const PredictionOptions& options) {
  validate(config);
  if (options.fold_micro_batches && options.what_if.empty())
    if (std::optional<ReplayFigures> folded = replay_folding_micro_batches(config, options))
      return prediction_of(config, std::move(*folded));
  return prediction_of(config, replay(config, options));
}

std::int64_t prediction_tasks_bound(TrainerConfig config, const PredictionOptions& options) {
  validate(config);
  const ModelConfig& m = config.model;
  const ParallelPlan& plan = config.plan;
  const Mesh mesh(plan);
  const PipelineLayout layout = make_pipeline_layout(m, plan);
  // A micro-batch fold replays fewer micro-batches, but falls back to the whole step when its
  // replays do not grow evenly: bounded by the whole step.
  const std::int64_t micro_batches = plan.micro_batches();
  // Tasks of one layer's forward and backward for one micro-batch, at most: each further
  // sequence chunk (context-parallel ring steps, Ampipe's chunks) repeats the attention's, tensor
  // parallelism adds its collectives, a recomputed layer runs its forward again, an MoE layer
  // adds its router, dispatch, local experts and combine.
  const std::int64_t chunks = plan.context_parallel + plan.ampipe_degree - 1;
  const std::int64_t dense_layer = kTasksPerLayer + kTasksPerSequenceChunk * (chunks - 1) +
                                   (plan.tensor_parallel > 1 ? kTasksPerTensorParallelLayer : 0);
  const std::int64_t local_experts =
      m.num_experts > 0 ? std::max(1, m.num_experts / plan.expert_parallel) : 0;
  const std::int64_t moe_layer =
      dense_layer + (kTasksPerMoeLayer + kTasksPerLocalExpert * local_experts) * plan.ampipe_degree;
  const bool recomputed = m.recompute.granularity != RecomputeGranularity::none;
  std::int64_t tasks = 0;
  for (int r = 0; r < plan.devices(); ++r) {
    if (replayed_rank(mesh, r, options) != r) continue;
    const StageContents stage = layout.contents(mesh.coordinates(r).pp);
    std::int64_t per_micro_batch = kTasksPerStageAndMicroBatch, per_step = kTasksPerStage;
    for (int l = 0; l < m.num_layers; ++l) {
      if (!stage.layers.empty() && !stage.layers[static_cast<std::size_t>(l)]) continue;
      const std::int64_t layer = m.is_moe_layer(l) ? moe_layer : dense_layer;
      per_micro_batch += recomputed ? layer * 3 / 2 : layer;
      per_step += kTasksPerLayerAndStep;
    }
    tasks += micro_batches * per_micro_batch + per_step;
  }
  return tasks;
}

std::int64_t prediction_memory_bytes(std::int64_t tasks, int devices) {
  return tasks * kPredictionBytesPerTask + std::int64_t{devices} * kPredictionBytesPerDevice;
}

std::int64_t prediction_memory_bound(const TrainerConfig& config,
                                     const PredictionOptions& options) {
  return prediction_memory_bytes(prediction_tasks_bound(config, options), config.plan.devices());
}

rt::Nanos exposed_comm_of_groups(const rt::Trace& trace, std::span<const std::string_view> groups) {
  std::vector<rt::StreamId> chosen;
  for (const auto& [name, streams] : streams_by_group(trace.tasks()))
    if (std::find(groups.begin(), groups.end(), name) != groups.end())
      chosen.insert(chosen.end(), streams.begin(), streams.end());
  return rt::exposed_comm_on_stream_ids(trace, chosen);
}

}  // namespace weave::graphs
