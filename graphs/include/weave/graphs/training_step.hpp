// One training step of the GPT-MoE model as a single task graph over the mesh's devices:
// forward and backward of every micro-batch (with pipeline parallelism, each stage's in its
// schedule's order, activations and gradients moving between stages by send/recv), gradient
// reductions, clipping and the optimizer step.
//
// The graph is the union of every rank's program: the step written once for one rank, which
// sees only that rank's shard, buffers and tasks and meets its peers through collectives and
// send/receive pairs. Each process group has its own communication stream on each of its
// members (named by the group's kind: tp, cp, ep, edp, dp_cp, tp_cp, the pipeline's per direction
// and sending stage, embedding, world), so collectives of different groups overlap and those of
// one group keep their order; communication is ordered against compute by explicit edges only
// where the data requires it (a layer's gradient all-reduce runs while the backward of the layers
// below it computes; a column-parallel linear's weight-gradient GEMM runs while its input
// gradient is being reduce-scattered). Every task's cost hint comes from the shapes it computes
// on.
//
// The graph is built once and run every iteration; the host fills the micro-batches' tokens
// and sets the learning rate between runs.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "weave/devices/communicator.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/graphs/memory_timeline.hpp"
#include "weave/graphs/mesh.hpp"
#include "weave/graphs/model_config.hpp"
#include "weave/graphs/model_shard.hpp"
#include "weave/ops/optimizer.hpp"
#include "weave/runtime/graph.hpp"

namespace weave::graphs {

struct OptimizerConfig {
  ops::AdamWOptions adamw;  // lr is set per iteration with set_learning_rate
  double clip_grad = 1.0;   // --clip-grad; 0: no clipping
  // A loss scaler runs (LossScaler::for_run gives one): the loss gradient is multiplied by the
  // scale set with TrainingStep::set_loss_scale, the fp32 main gradients by its inverse before
  // the norm and the update, and a step whose gradients hold an infinity or a NaN on any rank
  // (an all-reduce of a found_inf flag over every rank, as Megatron-LM's) updates nothing.
  bool loss_scaling = false;
};

// One micro-batch of one data-parallel rank, in Megatron's [sequence, batch] order: entry
// s * micro_batch_size + b.
struct MicroBatch {
  std::vector<std::int32_t> tokens;
  std::vector<std::int32_t> targets;
};

struct StepResult {
  double loss = 0;  // language-model loss, mean over the global batch's tokens
  // MoE load-balancing plus z-loss, mean over micro-batches and data-parallel replicas; with
  // MindSpeed's deepspeed_moe gate the sum of the micro-batch's gate calls' losses over the ranks
  // that gate different tokens (SP shards, cp shares), the loss whose gradient the step applies.
  double aux_loss = 0;
  double grad_norm = 0;  // before clipping
  // MoE routing over the step (all layers and micro-batches): the token-to-expert picks the
  // routers made and those a full expert dropped (--moe-expert-capacity-factor; capacity is
  // per Ampipe chunk). Zero for dense models and dropless routing.
  std::int64_t routed_picks = 0;
  std::int64_t dropped_picks = 0;
  // A hash of every pick the routers made and whether it was kept (0 without MoE): it changes
  // when a token's experts or drops change, so a finite-difference check can tell that routing,
  // a step function of the parameters, held between the points it compares.
  std::uint64_t routing_digest = 0;
  // With OptimizerConfig::loss_scaling: some rank's unscaled gradients were not finite, and the
  // step updated no parameter or moment (Megatron-LM's skipped iteration).
  bool found_inf = false;
};

struct StepBuildOptions {
  // The ranks whose programs are built (empty: every rank). A graph of some ranks holds their
  // tasks only, exactly as they are in the whole step's graph; their collectives with ranks not
  // built stay open (a backend that reaches the other ranks' processes runs them; the in-process
  // one refuses to).
  std::vector<int> ranks;
  // False: build with shapes only (no parameter, gradient, optimizer or activation memory is
  // allocated; each device's memory tracker still counts what it would hold, by category). The
  // graph is the same, costs included, for the virtual clock to replay without running the work
  // (rt::VirtualClockOptions::execute = false); running its tasks fails, naming this option.
  bool materialize = true;
  // Record every allocation and release the build makes on the device set's memory tracker, with
  // the number of tasks built before it (TrainingStep::memory_events): what memory_timeline
  // places on a replay of the step.
  bool record_memory = false;
};

class TrainingStep {
 public:
  // plan must have passed validate(); devices.size() == plan.devices(). With a multi-process
  // communicator, options.ranks names the ranks of the devices this process holds.
  TrainingStep(const ModelConfig& model, const ParallelPlan& plan, const OptimizerConfig& optimizer,
               devices::DeviceSet& devices, devices::Communicator& comm,
               const StepBuildOptions& options = {});
  ~TrainingStep();
  TrainingStep(const TrainingStep&) = delete;
  TrainingStep& operator=(const TrainingStep&) = delete;

  const rt::Graph& graph() const;
  // With StepBuildOptions::record_memory: the build's allocations and releases in the order they
  // were made (empty otherwise).
  const std::vector<MemoryEvent>& memory_events() const;
  const Mesh& mesh() const;
  // The batch of data-parallel rank `dp`, micro-batch `m`: fill before running the graph.
  MicroBatch& micro_batch(int dp, int m);
  // Iteration number (from 1; keys dropout masks and AdamW's bias correction) and learning rate
  // for the next run.
  void prepare(std::int64_t iteration, double learning_rate);
  // With OptimizerConfig::loss_scaling: the scale the next run multiplies the loss gradient by
  // (1 until set), and AdamW's step count for its update: the updates applied before it plus
  // one, as a skipped step applies none (the iteration until set).
  void set_loss_scale(float scale);
  void set_optimizer_step(std::int64_t step);
  // What the last run computed, over the ranks built here; with a multi-process backend, over
  // every process's ranks (a call every process makes: the terms are exchanged), bitwise what
  // one process building every rank gets.
  StepResult result() const;
  // The processes the step is spread over (the communicator's; one without MPI).
  devices::ProcessSet& processes() const;
  // Whether rank `rank`'s program is built here.
  bool holds(int rank) const;
  // Whether the step was built with tensors (StepBuildOptions::materialize).
  bool materialized() const;
  // Throws std::out_of_range for a rank not built here.
  ModelShard& shard(int rank);
  // The activation sets rank `rank` holds: one chunk's activations for one micro-batch each, as
  // many per model chunk as the pipeline schedule has micro-batches of that chunk in flight at
  // once (1F1B: p - r on stage r; GPipe: every micro-batch; 1 without pipelining).
  int activation_sets(int rank) const;
  // The residual stream layer `layer` of rank `rank` left in activation set `set` by the last run
  // of a materialized step: the layer's middle (after its attention's residual end) and its
  // output, for checks of what precision the stream's values have. Throws std::out_of_range for a
  // rank not built here or a layer it does not hold.
  struct ResidualStream {
    ops::Tensor middle, output;
  };
  ResidualStream residual_stream(int rank, int layer, int set = 0);
  // When false, the graph skips the optimizer step (for gradient checks).
  void set_update_parameters(bool update);
  // With --overlap-param-gather (and the distributed optimizer) a step opens with the
  // all-gathers of the shards the previous step's update produced, each layer's forward waiting
  // for its own, and ends after the update without gathering, as Megatron-LM's does: after a run
  // a data-parallel replica holds up to date only the shards it updates. This graph is those
  // gathers alone; run it before reading the parameters other than by running the step (saving,
  // comparing, decoding), as Megatron-LM finishes its parameter gathers before saving and
  // evaluating. Without the flag it is empty.
  const rt::Graph& parameter_gather_graph() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace weave::graphs
