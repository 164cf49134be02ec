// One device's share of the model's parameters, their gradients and optimizer state.
//
// Every parameter has a logical (unsharded, framework-independent) layout: 2-D [rows, cols]
// with Megatron's conventions (QKV rows are all queries, then keys, then values; SwiGLU's
// first linear is all gates, then all values; experts stack along rows). A device holds a
// shard in its own storage order, and each local element knows its logical coordinates.
// Initial values are a pure function of (seed, parameter, logical row, logical column), so a
// model split any way starts from exactly the slices of the one-device model — the basis of
// "parallel equals serial".
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "weave/devices/device.hpp"
#include "weave/graphs/mesh.hpp"
#include "weave/graphs/model_config.hpp"
#include "weave/graphs/row_map.hpp"
#include "weave/ops/tensor.hpp"

namespace weave::graphs {

// How a shard's gradients combine across devices before the optimizer step.
enum class GradientReduction {
  none,            // unique to this device (a tensor-parallel shard, summed over dp only)
  tensor_partial,  // replicated over tp but each rank saw other tokens (SP): sum over tp too
};

struct Parameter {
  std::string name;         // "layers.0.attention.qkv.weight"
  ops::Tensor value, grad;  // local shapes
  // A bf16 run: the bf16 copy of `value` the products read (the model's parameter, as
  // Megatron-LM's Float16Module holds it); `value` is then the fp32 main parameter the optimizer
  // updates and `grad` its fp32 main gradient. Undefined in an fp32 run.
  // An fp16 run holds it the same way, its bits read as fp16 (ops::Tensor::bits_as): fp16 true.
  ops::Bf16Tensor value16;
  bool fp16 = false;
  ops::Tensor exp_avg, exp_avg_sq;
  std::int64_t logical_rows = 0, logical_cols = 0;
  RowMap row_map;                  // local row -> logical row
  std::int64_t col_offset = 0;     // local column c is logical column col_offset + c
  bool expert = false;             // reduced over the expert-data-parallel group, not dp
  bool tensor_replicated = false;  // the same on every tensor-parallel rank
  GradientReduction reduction = GradientReduction::none;
  std::string bucket;  // the gradient bucket it is reduced with
};

// A tensor of the model that training updates by a rule of its own, not by the optimizer, and
// that checkpoints keep: Megatron-Core's router expert bias (a registered buffer there). The same
// on every rank that holds it.
struct ModelState {
  std::string name;  // "layers.1.moe.router.expert_bias"
  ops::Tensor value;
};

// Gradients that become ready together and are reduced the same way, stored contiguously so
// one collective reduces them all: a layer's MLP half, its attention half, the final norm, the
// embeddings — each split by how it is reduced (dense, partial over tp, expert).
//
// Values and gradients are flat, padded to a multiple of the replica count (data x context
// parallel, or expert-data parallel for experts). With the distributed optimizer each replica
// owns one contiguous shard of the bucket: it receives that shard's reduced gradients
// (reduce-scatter), keeps AdamW state for it alone, updates it, and the replicas all-gather
// the values.
struct GradientBucket {
  std::string name;  // "layers.3.mlp/dense"
  std::vector<Parameter*> params;
  ops::Tensor values, grads;  // flat; every parameter's value and grad is a view into them
  // A bf16 run: the flat bf16 copy of `values` (every parameter's value16 is a view into it),
  // refreshed from the fp32 main values before each step's forward. Counted as parameters, and
  // `values` (the main parameters) as optimizer state, as the prediction counts them.
  ops::Bf16Tensor values16;
  bool expert = false;
  GradientReduction reduction = GradientReduction::none;
  int replicas = 1;              // data-parallel copies of these values
  int replica = 0;               // this device's index among them
  bool sharded = false;          // distributed optimizer with more than one replica
  std::int64_t shard_begin = 0;  // the elements this device updates
  std::int64_t shard_size = 0;
  // ZeRO stage 2 (ParallelPlan::shard_gradients), a layer's sharded bucket: `grads` is a view into
  // the layer's gradient slot, shared with other layers and zeroed after each reduction, and
  // `grad_shard` accumulates the reduced shard over the step's micro-batches. Otherwise `staged`
  // is false and the shard is grads[shard_begin, shard_begin + shard_size).
  bool staged = false;
  int slot = -1;
  ops::Tensor grad_shard;
  ops::Tensor shard_grads() const {
    return staged ? grad_shard : grads.slice(0, shard_begin, shard_size);
  }
  // Stage 2 under a zero-bubble schedule: the gradients of the parameters the I action writes
  // (norms, biases, the router; not the weights its W action writes), kept here between the two
  // so that the bucket takes its slot at the W action only; moved into the slot at
  // held_at[i] (bucket offset, held offset, elements) before each reduction. Else undefined.
  ops::Tensor held_grads;
  struct HeldRange {
    std::int64_t at = 0, held = 0, size = 0;
  };
  std::vector<HeldRange> held_at;
  // ZeRO stage 3 (ParallelPlan::shard_parameters), a layer's sharded bucket: `values` is a view
  // into the layer's parameter slot, filled by the gathers from every replica's `value_shard`
  // (the replica's shard, which the optimizer updates).
  bool values_staged = false;
  ops::Tensor value_shard;
  // A bf16 run's stage 3: `values16` is a view into the layer's bf16 parameter slot, which the
  // gathers fill, and `value_shard16` the shard rounded to bf16 at the step's start: what the
  // gathers move, 2 bytes a value, as Megatron-LM all-gathers its bf16 parameter buffers. Such a
  // run keeps no fp32 copy of the gathered values: `values` (and its parameters' `value`) is
  // then a shape without storage.
  ops::Bf16Tensor value_shard16;
  // A materialized 16-bit run's sharded bucket that is not staged (the distributed optimizer's
  // embeddings, final norm and output layer, and every bucket below stage 3): the fp32 main
  // values are the replica's shard alone, `value_shard`, as Megatron-LM's distributed optimizer
  // keeps them (shard_fp32_from_float16_groups), and `values` a shape without storage. The
  // optimizer rounds the updated shard into its range of `values16`, and the gathers fill the
  // rest of `values16` from the other replicas, 2 bytes a value.
  bool main_values_sharded = false;
  // A materialized 16-bit run's sharded bucket (main_values_sharded, or values_staged): the fp32
  // shard rounded into the 16-bit values the gathers send (the shard's range of `values16`, or
  // `value_shard16`), as the optimizer does after each update (Megatron-LM's
  // _copy_main_params_to_model_params); nothing for another bucket.
  void round_shard_to_half(Precision precision) const;
  ops::Tensor shard_values() const {
    return value_shard.defined() ? value_shard : values.slice(0, shard_begin, shard_size);
  }
  ops::Tensor exp_avg, exp_avg_sq;  // AdamW state of [shard_begin, shard_begin + shard_size)
  // A 16-bit run predicted: the shard's fp32 master weights (and for fp16 its fp32 gradients),
  // counted only (ParameterBytes); undefined otherwise.
  ops::Tensor master_state;
};

// One layer's parameters: each of its modules' own (graphs/src/model/layer_shard.hpp).
struct LayerShard;
// The embedding's and the model end's parameters, declared by those modules (graphs/src/model).
struct EmbeddingParameters;
struct OutputLossParameters;

// The parts of the model one pipeline stage holds; by default all of it.
struct StageContents {
  std::vector<bool> layers;     // by model layer; empty: every layer
  bool input_embedding = true;  // the word and position embeddings: the first stage
  // The final norm and the word embedding as the output layer (tied weights): the last stage. A
  // last stage that is not also the first holds its own copy of the word embedding, started
  // equal and kept equal by summing both copies' gradients (the embedding group's all-reduce).
  bool output_layer = true;
};

class ParameterDeclarer;

class ModelShard {
 public:
  // The shard that device `rank` of `mesh` holds, allocated on `device` (tracked as parameters,
  // gradients and optimizer state) and initialised. Every parameter draws its initial values
  // from its index in the whole model, so a stage's shard starts as the whole model's slice.
  // Without `materialize` the shard has shapes only (Tensor::shape_only): nothing is allocated
  // or initialised, and the device's tracker counts what it would hold.
  ModelShard(const ModelConfig& config, const Mesh& mesh, int rank, devices::Device& device,
             StageContents contents = {}, bool materialize = true);
  ~ModelShard();
  ModelShard(const ModelShard&) = delete;
  ModelShard& operator=(const ModelShard&) = delete;

  // In the same order on every device; addresses are stable.
  std::deque<Parameter>& parameters() { return parameters_; }
  const std::deque<Parameter>& parameters() const { return parameters_; }
  // The model's non-trained state (ModelState), in the same order on every device.
  std::deque<ModelState>& states() { return states_; }
  // The word embedding (input, and tied output); held by the first and, tied, the last stage.
  Parameter& embedding();
  // The learned position table (--position-embedding-type learned_absolute only).
  Parameter& positions();
  // The output layer's weight: the word embedding, or untied a parameter of its own.
  Parameter& output_weight();
  const StageContents& contents() const { return contents_; }
  bool holds_layer(int l) const {
    return contents_.layers.empty() || contents_.layers.at(static_cast<std::size_t>(l));
  }
  // The output layer's copy of the word embedding on a last stage that is not the first: its
  // gradient is summed with the first stage's, and counted once in the gradient norm.
  bool holds_embedding_copy() const {
    return contents_.output_layer && !contents_.input_embedding &&
           !config_.untie_embeddings_and_output_weights;
  }
  Parameter& final_ln_weight();
  Parameter* final_ln_bias();  // null with RMSNorm
  const LayerShard& layer(int l) const;
  int vocab_start() const { return vocab_start_; }
  int first_expert() const { return first_expert_; }
  int local_experts() const { return local_experts_; }

  void zero_grads();
  // ZeRO stage 2: the gradient slots the layers' full buckets take in turn, so that at most this
  // many layers' gradients are held whole while the backward runs (DeepSpeed's stage 2 bounds
  // them by its reduce bucket size instead): one written, one reduced. Under a zero-bubble
  // schedule the W actions take them, the gradients the I actions write held aside per bucket
  // (GradientBucket::held_grads).
  static constexpr int kGradientSlots = 2;
  // The gradient slot layer l's staged buckets are written into; -1 for none.
  int gradient_slot(int l) const;
  // Stage 2 under a zero-bubble schedule with more layers than slots: the gradients a layer's I
  // action writes are held aside (GradientBucket::held_grads), its slot taken at its W only.
  bool holds_input_pass_gradients() const { return holds_input_pass_gradients_; }
  // ZeRO stage 3: whether layer l's parameters are kept as shards, gathered into their parameter
  // slot before each use.
  bool parameters_sharded(int l) const;
  // ZeRO stage 3: the parameter slot layer l's values are gathered into (the stage's layers take
  // the ParallelPlan::zero_units_in_flight slots in turn, in layer order); -1 for none.
  int parameter_slot(int l) const;
  // A 16-bit run: rounds the fp32 main parameters into their bf16 or fp16 copies (nothing in
  // fp32). A sharded bucket (GradientBucket::main_values_sharded, values_staged) is left as the
  // optimizer's rounding of its shard and the gathers made it.
  void refresh_bf16_copies();
  const ModelConfig& config() const { return config_; }
  // In the order the backward pass makes them ready.
  std::vector<GradientBucket>& buckets() { return buckets_; }
  // The bucket that holds parameter `p`'s gradient.
  const GradientBucket& bucket_of(const Parameter& p) const;

 private:
  // The modules declare their parameters through it (graphs/src).
  friend class ParameterDeclarer;
  // Gradient buckets in the order the backward makes them ready, each parameter's value and
  // gradient moved into its bucket's flat storage.
  void make_buckets(const Mesh& mesh, int rank);
  // Stage 2 under a zero-bubble schedule: the gradients of `bucket`'s parameters the I action
  // writes moved into GradientBucket::held_grads.
  void hold_input_pass_gradients(GradientBucket& bucket);
  // `staged_grads`: a view into a gradient slot for a staged bucket (ZeRO stage 2), else empty.
  void make_bucket(const Mesh& mesh, int rank, std::string name, std::vector<Parameter*> params,
                   ops::Tensor staged_grads = {}, int slot = -1, ops::Tensor staged_values = {},
                   ops::Bf16Tensor staged_values16 = {});
  // std > 0: normal(0, std) draws; otherwise every element is `constant`. While !holding_, only
  // counts the parameter and returns a placeholder.
  Parameter& add(std::string name, const ops::Shape& local, std::int64_t logical_rows,
                 std::int64_t logical_cols, RowMap row_map, std::int64_t col_offset, double std,
                 double constant);
  // A zero-filled state tensor of `local` shape (shape only without materialize); while
  // !holding_, a placeholder.
  ModelState& add_state(std::string name, const ops::Shape& local);
  const ModelConfig& config_;
  devices::Device& device_;
  StageContents contents_;
  bool materialize_ = true;
  // The parameters' indices in the whole model (their random streams), counted over the
  // parameters this stage skips too; false while adding a part the stage does not hold.
  std::uint32_t next_index_ = 0;
  bool holding_ = true;
  Parameter skipped_;
  std::unique_ptr<EmbeddingParameters> embedding_;
  std::deque<Parameter> parameters_;
  std::deque<ModelState> states_;
  ModelState skipped_state_;
  std::vector<GradientBucket> buckets_;
  std::vector<ops::Tensor> gradient_slots_, parameter_slots_;
  std::vector<ops::Bf16Tensor> parameter_slots16_;  // a bf16 run's stage 3: the bf16 copies
  bool holds_input_pass_gradients_ = false;
  std::map<int, int> layer_slots_;            // layer -> its gradient slot (ZeRO stage 2)
  std::map<int, int> layer_parameter_slots_;  // layer -> its parameter slot (ZeRO stage 3)
  std::string current_bucket_;
  std::vector<LayerShard> layers_;
  std::unique_ptr<OutputLossParameters> output_loss_;
  int vocab_start_ = 0;
  int first_expert_ = 0;
  int local_experts_ = 0;
};

// A parameter's value or gradient, or an empty tensor for an absent one (a disabled bias).
inline ops::Tensor value_of(const Parameter* p) {
  return p ? p->value : ops::Tensor{};
}
inline ops::Tensor grad_of(const Parameter* p) {
  return p ? p->grad : ops::Tensor{};
}
inline ops::Bf16Tensor value16_of(const Parameter* p) {
  return p ? p->value16 : ops::Bf16Tensor{};
}
// The value the model computes with: `value`, or in a bf16 run its bf16 copy widened into a heap
// tensor (for the fp32 kernels that read the small parameters: norms' weights, residual biases).
ops::Tensor compute_value(const Parameter& p);
inline ops::Tensor compute_value_of(const Parameter* p) {
  return p ? compute_value(*p) : ops::Tensor{};
}

// The local rows and columns a parameter's storage is read as: [numel / last, last] for rank
// >= 2, [n, 1] for a vector.
std::int64_t local_rows(const Parameter& p);
std::int64_t local_cols(const Parameter& p);

}  // namespace weave::graphs
