// One training step predicted from its graph alone: every rank's program built without tensors
// (nothing is allocated; each device's memory tracker counts what it would hold) and replayed on
// the virtual clock of the configuration's modelled machine without running the kernels.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weave/graphs/memory_timeline.hpp"
#include "weave/graphs/mesh.hpp"
#include "weave/graphs/trainer_config.hpp"
#include "weave/runtime/graph.hpp"
#include "weave/runtime/memory_tracker.hpp"
#include "weave/runtime/trace.hpp"
#include "weave/runtime/what_if.hpp"

namespace weave::graphs {

// Megatron-LM's model-FLOPs count of one training step (Narayanan et al. 2021, section 5.1:
// 72 B s l h^2 (1 + s / 6h + V / 12lh) for a GPT with 4h-wide MLPs), from the layers' own
// shapes so that grouped-query attention, SwiGLU and top-k experts count what they multiply:
// per token and layer 2h (heads + 2 groups) d for QKV, 4 s heads d for the attention (the
// whole causal square, as Megatron counts it), 2 heads d h for the projection, the MLP's
// matrices (the router and top-k experts in a MoE layer), and 2 h V for the output layer;
// three passes (forward, and a backward of twice its cost), four for the layers when every
// layer's forward is recomputed.
double model_flops_per_step(const ModelConfig& model, const ParallelPlan& plan, bool recompute);
// The FLOPs a step's recomputation adds: a forward of every layer model.recompute recomputes in
// full (recompute_group), counted as model_flops_per_step counts a layer, and under selective
// recomputation of the mlp a forward of every dense MLP, and of core_attn the products of the
// materialised scores (--attention-backend unfused or local; with a fused kernel core_attn adds
// none: it recomputes its scores in every backward already, recomputation or not).
double recomputed_flops_per_step(const ModelConfig& model, const ParallelPlan& plan);

struct ExposedCommunication {
  std::string group;  // the streams' kind: tp, cp, ep, dp_cp, ...
  double ms_per_device = 0;
};

// What a step's compute time goes to: matrix products (their shapes' overhead included),
// attention kernels, element-wise work in the layers (norms, softmax and dropout of
// materialised scores, residuals, copies), and the optimizer step (zeroing the gradients, their
// norm, the update), and the kernels' launch cost (each kernel's fixed cost beyond its work).
enum class ComputeKind : std::uint8_t { products, attention, elementwise, optimizer, launch };
inline constexpr std::size_t kComputeKindCount = 5;
std::string_view to_string(ComputeKind kind);

struct Prediction {
  double step_ms = 0;
  double tokens_per_second = 0;
  double model_flops = 0;            // a step's, model_flops_per_step without recomputation
  double model_flops_recompute = 0;  // with full recomputation
  double flops_recomputed = 0;  // what this run's recomputation adds: recomputed_flops_per_step
  double flops_per_device = 0;  // model FLOP/s of each device: model_flops / step / devices
  double mfu = 0;               // flops_per_device over the machine's peak_flops (or device_flops)
  double bubble = 0;            // compute idle over compute busy, summed over devices
  std::vector<ExposedCommunication> exposed;  // groups with any exposed time
  // Every group's together, a time two groups leave exposed at once counted once.
  double exposed_ms_per_device = 0;
  // Compute busy per device by ComputeKind, in ms (summed over the replayed devices, divided by
  // their count, as exposed_ms_per_device).
  std::array<double, kComputeKindCount> compute_ms_per_device{};
  // Per device, by category (rt::MemoryCategory): what it would hold at its peak.
  std::vector<std::array<std::int64_t, rt::kMemoryCategoryCount>> memory;
  std::vector<std::int64_t> memory_total;  // per device (a folded replica: its first replica's)
  int replayed_devices = 0;                // the devices built and replayed
  // The tasks of the graph built and replayed (a micro-batch fold's: its largest replay's): what
  // the prediction's memory grows with (see prediction_tasks_bound).
  std::int64_t tasks_built = 0;
  // The micro-batch counts replayed: the configured one, or the three a micro-batch fold
  // extrapolated from.
  std::vector<int> micro_batches_replayed;
  rt::Trace trace;  // the replay (empty when micro-batches were folded)
  // Each device's memory over the replayed step by category (memory_timeline), its peaks those
  // of `memory`; empty when micro-batches were folded or PredictionOptions::memory_over_step is
  // false.
  MemoryTimeline memory_over_step;
  rt::Graph graph;  // the graph replayed (the critical path's, a DOT's; empty when folded)
  // The same graph replayed with PredictionOptions::what_if's costs (empty when none).
  rt::Trace what_if_trace;
};

// Folding: data-parallel replicas run the same program on other samples, the ranks of a
// tensor-parallel group the same program on other shards of the same shapes, and the ranks of a
// context-parallel group the same ring on other chunks of the sequence (each ring step costs
// every rank the same: the causal load balancing), so only the ranks with dp = tp = cp = 0 are
// built and replayed, each collective costed for its whole group (devices::FoldedCommunicator)
// and waiting only for the members built. Exact when the folded ranks' work is the same, as it
// is on the virtual clock without running kernels (MoE routing is then timed as balanced): the
// folded prediction equals the unfolded one (tests/graphs/prediction_test.cpp). Pipeline ranks
// are built; expert-parallel ranks are carved out of the folded ones.
//
// Folding micro-batches (fold_micro_batches): the step is replayed with three smaller micro-batch
// counts m1, m1 + k, m1 + 2k (k a whole number of pipeline rounds, m1 past the warm-up) and, when
// every figure (step time, compute busy and idle, each group's exposed time, each device's
// memory by category) grows by the same amount from the first to the second as from the second
// to the third, as it does once a pipeline's steady phase repeats, extrapolated to the
// configured count; otherwise (and whenever what_if is given) the whole step is replayed. A
// folded prediction has no trace and no graph.
struct PredictionOptions {
  bool fold_data_parallel = true;
  bool fold_tensor_parallel = true;
  bool fold_context_parallel = true;
  bool fold_micro_batches = false;
  // Also replay the step with these costs changed (rt::WhatIfCostModel) into what_if_trace.
  std::vector<rt::CostChange> what_if;
  // Refuse a step of more tasks than this once it is built, before it is replayed
  // (check_report_size of step_report.hpp: weave predict --report); 0: any size.
  std::size_t most_tasks = 0;
  // Keep each device's memory over the step (Prediction::memory_over_step). A folded device's is
  // a copy of its source's: over thousands of devices most of what a prediction holds and much
  // of its time (Llama 3 405B on 16,384 H100s: 1.3 GiB of 1.44), so a caller that draws no
  // memory chart goes without.
  bool memory_over_step = true;
};

// The rank whose replay stands for `rank`'s under `options` (itself when it is built).
int replayed_rank(const Mesh& mesh, int rank, const PredictionOptions& options);

// Validates a copy of `config` (throws ConfigError) and predicts its step.
Prediction predict_step(TrainerConfig config, const PredictionOptions& options = {});

// What predict_step holds while it predicts, estimated before it builds anything (weave predict
// --advise admits candidates side by side while their estimates fit a memory budget): the
// tasks built, at most prediction_tasks_bound(config, options) (validating a copy; throws
// ConfigError as predict_step does), at prediction_memory_bytes's count per task and device. The
// bound is the whole step's, as a micro-batch fold falls back to the whole step when its
// replays do not grow evenly.
std::int64_t prediction_tasks_bound(TrainerConfig config, const PredictionOptions& options = {});
std::int64_t prediction_memory_bytes(std::int64_t tasks, int devices);
std::int64_t prediction_memory_bound(const TrainerConfig& config,
                                     const PredictionOptions& options = {});

// The exposed communication, summed over the devices of a training step's trace, of the process
// groups `groups` as ExposedCommunication names them ("tp", "ep", "cp", ...): the union of every
// stream made for one of them (tp with its gradient stream, ep with its dispatch and combine
// streams), the streams found by their kind. 0 when the trace has none of them.
rt::Nanos exposed_comm_of_groups(const rt::Trace& trace, std::span<const std::string_view> groups);

}  // namespace weave::graphs
