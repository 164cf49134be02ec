// The training step of one rank, written as a distributed program is: the code here sees this
// rank only (its shard, its activation sets, its buffers, its tasks and its handles to the
// process groups it belongs to) and learns what a peer holds only through a collective or a
// send/receive. The step's graph is the union of every rank's program; collectives meet across
// members by (group, issue order) in a CollectiveMatcher.
//
// The layers are modules (embedding, attention, dense MLP, MoE MLP, Ampipe block, loss) whose
// forward and backward emitters take this program, a BuildPosition value and, for backward, the
// action's WeightHalves.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "config/step_shape.hpp"
#include "model/layer_shard.hpp"
#include "pipeline/activation_sets.hpp"
#include "step/build_position.hpp"
#include "step/comm_streams.hpp"
#include "step/memory_recording.hpp"
#include "step/rank_state.hpp"
#include "weave/devices/collective_matcher.hpp"
#include "weave/devices/device.hpp"
#include "weave/graphs/mesh.hpp"
#include "weave/graphs/pipeline_layout.hpp"
#include "weave/graphs/training_step.hpp"
#include "weave/ops/random.hpp"

namespace weave::graphs {

using rt::TaskId;

// What the host sets between runs of the step, read by the tasks when they run.
struct StepInputs {
  std::vector<std::vector<MicroBatch>> batches;  // [dp][micro-batch]
  std::int64_t iteration = 1;
  double learning_rate = 0;
  bool update = true;
  float loss_scale = 1;             // OptimizerConfig::loss_scaling only
  std::int64_t optimizer_step = 0;  // AdamW's step count; 0: the iteration
};

// This rank's side of one process group: the collectives it issues over the group run on the
// group's own stream, as NCCL and HCCL give each communicator its own stream, so collectives of
// different groups overlap and those of one group keep their issue order on every member.
// Each call orders the member after `ready` (kNoTask: nothing) and returns its task, or kNoTask
// for a group of one, where there is nothing to do.
class GroupHandle {
 public:
  GroupHandle() = default;
  // `stream`: the group's stream on this rank, made as a stream of `stream_group`; `tails`: the
  // rank's last task per communication stream, kept up to date.
  GroupHandle(devices::CollectiveMatcher& matcher, rt::GraphBuilder& graph,
              const devices::ProcessGroup& group, int member, std::string stream,
              CommGroup stream_group, std::map<std::string, TaskId>* tails,
              std::size_t element_bytes);

  // The same handle, its collectives costed at `bytes` an element: the gradient reductions in
  // the gradients' precision (ParameterBytes), not the activations'.
  GroupHandle with_element_bytes(std::size_t bytes) const {
    GroupHandle h = *this;
    h.element_bytes_ = bytes;
    return h;
  }

  int size() const { return group_ ? group_->size() : 1; }
  int member() const { return member_; }
  const std::string& stream() const { return stream_; }

  // This rank's side of any collective op over the group, with the buffers its op uses
  // (devices::CollectiveMember). `stream`: another stream of this group's (Ampipe's pipe experts
  // keep dispatches and combines apart); empty: the group's. The calls below are this one.
  TaskId issue(TaskId ready, const devices::CollectiveCall& call,
               const devices::CollectiveMember& buffers, const std::string& name, rt::TaskTags tags,
               const std::string& stream = {}) const;

  TaskId all_reduce(TaskId ready, std::span<float> buffer, devices::ReduceOp op,
                    const std::string& name, rt::TaskTags tags) const {
    return issue(ready, {.op = devices::CollectiveOp::all_reduce, .reduce = op}, {.output = buffer},
                 name, tags);
  }
  TaskId all_gather(TaskId ready, std::span<const float> input, std::span<float> output,
                    const std::string& name, rt::TaskTags tags) const {
    return issue(ready, {.op = devices::CollectiveOp::all_gather},
                 {.input = input, .output = output}, name, tags);
  }
  // 16-bit values (a materialized 16-bit run's parameters) gathered two to each 4-byte element
  // the collective moves (devices/packed_halves.hpp), costed at the elements' 4 bytes: 2 bytes a
  // value, as the prediction costs the same gather of 16-bit values. `input` may be this
  // member's block of `output` (in place).
  TaskId all_gather_halves(TaskId ready, const ops::Bf16Tensor& input,
                           const ops::Bf16Tensor& output, const std::string& name,
                           rt::TaskTags tags) const;
  TaskId reduce_scatter(TaskId ready, std::span<const float> input, std::span<float> output,
                        const std::string& name, rt::TaskTags tags) const {
    return issue(ready, {.op = devices::CollectiveOp::reduce_scatter},
                 {.input = input, .output = output}, name, tags);
  }
  TaskId all_to_all(TaskId ready, std::span<const float> input, std::span<float> output,
                    const std::string& name, rt::TaskTags tags) const {
    return issue(ready, {.op = devices::CollectiveOp::all_to_all},
                 {.input = input, .output = output}, name, tags);
  }
  TaskId all_to_all_v(TaskId ready, const devices::VariableAllToAllBuffers& buffers,
                      std::int64_t row_elements, const std::string& name, rt::TaskTags tags,
                      const std::string& stream = {}) const {
    return issue(ready, {.op = devices::CollectiveOp::all_to_all_v, .row_elements = row_elements},
                 {.variable = buffers}, name, tags, stream);
  }
  TaskId all_gather_v(TaskId ready, const devices::VariableGatherBuffers& buffers,
                      std::int64_t row_elements, const std::string& name, rt::TaskTags tags,
                      const std::string& stream = {}) const {
    return issue(ready, {.op = devices::CollectiveOp::all_gather_v, .row_elements = row_elements},
                 {.gather = buffers}, name, tags, stream);
  }
  TaskId reduce_scatter_v(TaskId ready, const devices::VariableScatterBuffers& buffers,
                          std::int64_t row_elements, const std::string& name, rt::TaskTags tags,
                          const std::string& stream = {}) const {
    return issue(ready,
                 {.op = devices::CollectiveOp::reduce_scatter_v, .row_elements = row_elements},
                 {.scatter = buffers}, name, tags, stream);
  }

 private:
  devices::CollectiveMatcher* matcher_ = nullptr;
  rt::GraphBuilder* graph_ = nullptr;
  const devices::ProcessGroup* group_ = nullptr;
  int member_ = 0;
  std::string stream_;
  CommGroup stream_group_ = CommGroup::unclassified;
  std::map<std::string, TaskId>* tails_ = nullptr;
  // Bytes an element moves (CollectiveOptions::element_bytes): the training precision's.
  std::size_t element_bytes_ = sizeof(float);
};

inline std::span<float> all_of(const Tensor& t) {
  return {t.data(), static_cast<std::size_t>(t.numel())};
}
inline std::span<const float> read_of(const Tensor& t) {
  return {t.data(), static_cast<std::size_t>(t.numel())};
}
// Elements [begin, begin + n) of t. A tensor built without storage (a prediction) has a null
// data pointer, which may not be offset: its part is a null span of the same size, which the
// collectives only count.
inline std::span<float> part_of(const Tensor& t, std::int64_t begin, std::int64_t n) {
  return {t.data() ? t.data() + begin : nullptr, static_cast<std::size_t>(n)};
}

class RankProgram {
 public:
  // `sets`: the activation sets the schedule needs (shared by every rank: it is the schedule's).
  RankProgram(const StepShape& shape, const Mesh& mesh, const PipelineLayout& layout,
              const ActivationSetPlan& sets, const StepInputs& inputs, const OptimizerConfig& opt,
              int rank, devices::Device& device, rt::GraphBuilder& graph,
              devices::CollectiveMatcher& matcher, bool materialize);
  RankProgram(const RankProgram&) = delete;
  RankProgram& operator=(const RankProgram&) = delete;

  // Emits every task of this rank's step.
  void build();

  // ------------------------------------------------------------------ what the modules use
  const StepShape& shape;
  const Mesh& mesh;
  const PipelineLayout& layout;
  const ActivationSetPlan& set_plan;
  const StepInputs& inputs;
  const OptimizerConfig& opt;
  const int rank;
  const MeshCoordinates at;
  devices::Device& device;
  const bool materialize;
  RankState state;

  // Handles to this rank's groups. `data` is dp x cp (dense gradients), `expert_data` the
  // replicas of this rank's experts, `tensor_context` the ranks sharing one micro-batch.
  // `tensor_gradients` is the tp group again, as a communicator of its own for the gradient
  // buckets' reductions over tp, so that the layers below's activation collectives never wait
  // behind them (as Megatron reduces those gradients apart from the layers' collectives).
  GroupHandle tensor, context, expert, expert_data, data, tensor_context, tensor_gradients;
  devices::CollectiveMatcher& matcher;
  rt::GraphBuilder& graph;

  // A compute task on this rank's device: `fn` is its work, `flops` its cost on the virtual
  // clock (from the shapes it multiplies).
  // A compute task priced by its arithmetic (flops) or by the memory it streams (cost.bytes).
  TaskId compute(const std::string& name, rt::TaskTags tags, rt::CostHint cost,
                 std::function<void()> fn);
  TaskId compute(const std::string& name, rt::TaskTags tags, double flops,
                 std::function<void()> fn) {
    return compute(name, tags, rt::CostHint{.flops = flops}, std::move(fn));
  }
  // `task` starts after `before` (either may be kNoTask: no edge).
  void after(TaskId before, TaskId task) {
    if (before != rt::kNoTask && task != rt::kNoTask) graph.precede(before, task);
  }
  // Records a task this rank issued on communication stream `stream`; the optimizer waits for
  // the last of each.
  void track_comm(const std::string& stream, TaskId task) { comm_tails_[stream] = task; }
  // Gradient buckets whose data-parallel reduction waits for the step's last backward task
  // (ParallelPlan::overlap_grad_reduce off), each with the task that completed its gradients;
  // reduce_deferred_buckets issues them.
  // A task on `stream` (a group's communication stream), tracked as its tail.
  TaskId compute_on(const std::string& stream, CommGroup group, const std::string& name,
                    rt::TaskTags tags, rt::CostHint cost, std::function<void()> fn);
  std::vector<std::pair<std::size_t, TaskId>> deferred_buckets;
  // ZeRO stage 2: by gradient slot, the reductions its last layer's buckets end with, not yet
  // waited for by a later layer's backward.
  std::map<int, std::vector<TaskId>> gradient_slot_releases;
  // ZeRO stage 3, by parameter slot: the layer whose values it holds (or is being gathered
  // with), those gathers, and the releases since that the next gather into it waits for.
  struct ParameterSlot {
    int layer = -1;
    std::vector<TaskId> gathers, releases;
  };
  std::map<int, ParameterSlot> parameter_slots;
  // The next compute task waits for `tasks` too.
  void await(const std::vector<TaskId>& tasks) {
    awaited_gathers_.insert(awaited_gathers_.end(), tasks.begin(), tasks.end());
  }
  // --overlap-param-gather: the step-start all-gathers of the buckets' updated shards, by the
  // point the buckets are named after ("layers.3.attention", "embedding").
  std::map<std::string, std::vector<TaskId>> parameter_gathers;
  // The next compute task this rank adds waits for the gathers of the buckets of `point` (none
  // without --overlap-param-gather): the first task of a module's forward, as Megatron-LM's
  // forward pre-hook waits for the gather of the bucket holding the module's parameters. The
  // compute stream runs its tasks in the order they were added, so every later task reading
  // those parameters waits too.
  void wait_for_parameters(const std::string& point);
  const std::map<std::string, TaskId>& comm_tails() const { return comm_tails_; }

  // Activations and workspace of this rank; shapes only when the step is not materialized,
  // counted at the training precision's bytes (a materialized step is fp32).
  Tensor activation(const ops::Shape& s) {
    return materialize
               ? Tensor::empty(s, device, rt::MemoryCategory::activations)
               : Tensor::shape_only(s, device, rt::MemoryCategory::activations,
                                    static_cast<std::size_t>(shape.model.activation_bytes()));
  }
  // A materialized 16-bit run (bf16 or fp16, the same code with the format a parameter):
  // products in 16 bits (gemm_bf16, gemm_fp16), the parameters' 16-bit copies, the
  // products' inputs kept in bf16, the residual stream, norms, softmax and loss in fp32. A step
  // built without tensors models bf16 by its byte counts alone and takes the fp32 code paths.
  bool half() const { return materialize && shape.model.precision != Precision::fp32; }
  // A materialized 16-bit run whose residual stream is 16-bit (no --fp32-residual-connection),
  // as Megatron-LM's is: each residual end's sum and each sum of the stream's gradient is
  // rounded once, held in the fp32 buffers as the 16-bit value.
  bool rounds_residual_stream() const { return half() && !shape.model.fp32_residual_connection; }
  // A residual stream tensor or its gradient: counted at residual_stream_bytes() when the step is
  // not materialized (fp32 storage when it is).
  Tensor stream_activation(const ops::Shape& s) {
    return materialize
               ? Tensor::empty(s, device, rt::MemoryCategory::activations)
               : Tensor::shape_only(s, device, rt::MemoryCategory::activations,
                                    static_cast<std::size_t>(shape.model.residual_stream_bytes()));
  }
  // The run's precision: a 16-bit run's 16-bit tensors are Bf16Tensor storage, read as fp16 in
  // an fp16 run (half_precision.hpp).
  Precision precision() const { return shape.model.precision; }
  // A tensor a 16-bit run keeps in fp32 as Megatron-LM's --bf16 does, counted at 4 bytes a value
  // whatever the precision: the layers' and the final norm's statistics (TE's and Megatron's own
  // norms return them in fp32, megatron/core/transformer/custom_layers/batch_invariant_kernels.py),
  // the attention's log-sum-exp (weave's attention kernels take and keep it in fp32), and the
  // cross-entropy's logits and row figures (megatron/core/tensor_parallel/cross_entropy.py widens
  // the logits with .float() and keeps their fp32 softmax for the backward).
  Tensor activation32(const ops::Shape& s) {
    return materialize ? Tensor::empty(s, device, rt::MemoryCategory::activations)
                       : Tensor::shape_only(s, device, rt::MemoryCategory::activations);
  }
  // A 16-bit activation of a 16-bit run; a shape counted at 2 bytes a value when the step is not
  // materialized.
  ops::Bf16Tensor activation16(const ops::Shape& s) {
    return materialize ? ops::Bf16Tensor::empty(s, device, rt::MemoryCategory::activations)
                       : ops::Bf16Tensor::shape_only(s, device, rt::MemoryCategory::activations);
  }

  ModelShard& shard() { return *state.shard; }
  const LayerShard& layer(int l) const { return state.shard->layer(l); }
  // Layer l's modules' parameters (the MLP's as its spec makes it).
  const AttentionParameters& attention_parameters(int l) const { return layer(l).attention; }
  const DenseMlpParameters& dense_mlp_parameters(int l) const { return layer(l).dense_mlp(); }
  const MoeMlpParameters& moe_parameters(int l) const { return layer(l).moe_mlp(); }
  ActivationSet& aset(int set) {
    if (MemoryRecording* r = active_memory_recording())
      r->first_use.try_emplace(std::pair{rank, set}, graph.size());
    return state.sets[static_cast<std::size_t>(set)];
  }
  LayerActivations& acts(int set, int l) {
    const int k = set_plan.chunk_of_layer[static_cast<std::size_t>(l)];
    return aset(set).layers[static_cast<std::size_t>(l - layout.first_layer(k))];
  }
  OutputSet& oset(int out) { return state.outputs[static_cast<std::size_t>(out)]; }
  BackwardWorkspace& ws() { return state.ws; }
  MoeSlot& slot(int set, int l, int c) {
    return acts(set, l).moe().slots[static_cast<std::size_t>(c)];
  }

  // The global position of row s of this rank's [Sl, B, ...] activations.
  std::int64_t position(std::int64_t s) const { return shape.position(at.tp, at.cp, s); }
  // This rank's positions of micro-batch mb's tokens (or targets).
  void load_tokens(int mb, std::vector<std::int32_t>& into, bool targets) const;
  // Dropout on this rank's [Sl, B, h] rows from `first_row` (out may be in): masks keyed by
  // global token, so any split of the sequence draws the one-device masks. Without dropout, a
  // copy.
  // The key of a dropout mask at (layer, site) in this step: the seed mixed with the iteration,
  // so every iteration draws new masks and a replay of it the same ones.
  ops::RandomKey dropout_key(int layer, int site) const;
  // The first sequence of micro-batch `mb` of this rank's replica in the global batch.
  std::int64_t batch_offset(int mb) const {
    return (static_cast<std::int64_t>(at.dp) * shape.M + mb) * shape.B;
  }
  void apply_dropout(bool backward, int mb, int layer, int site, const Tensor& in,
                     const Tensor& out, std::int64_t first_row = 0) const;
  // x_out = x_in + dropout(y + bias): the residual branch's end, on [Sl, B, h] rows, in fp32;
  // with a 16-bit stream (rounds_residual_stream) rounded once, as Megatron-LM's fused
  // bias-dropout-add leaves a 16-bit tensor.
  void bias_dropout_add(int mb, int layer, int site, const Tensor& y, const Tensor& bias,
                        const Tensor& x_in, const Tensor& x_out, std::int64_t first_row = 0) const;
  // Its backward: d_y = dropout'(d_out); d_bias += rows of d_y.
  void bias_dropout_add_backward(int mb, int layer, int site, const Tensor& d_out,
                                 const Tensor& d_y, const Tensor& d_bias,
                                 std::int64_t first_row = 0) const;

 private:
  void allocate();
  std::map<std::string, TaskId> comm_tails_;  // the last task of each communication stream
  std::vector<TaskId> awaited_gathers_;       // what the next compute task waits for
};

}  // namespace weave::graphs
