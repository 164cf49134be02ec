#include "weave/graphs/model_shard.hpp"

#include <fmt/format.h>

#include <cmath>
#include <numbers>
#include <numeric>

#include "model/embedding.hpp"
#include "model/half_precision.hpp"
#include "model/layer_shard.hpp"
#include "model/output_loss.hpp"
#include "model/parameter_declarer.hpp"
#include "model/transformer_layer.hpp"
#include "weave/ops/random.hpp"

namespace weave::graphs {

std::int64_t local_cols(const Parameter& p) {
  return p.value.rank() == 1 ? 1 : p.value.dim(-1);
}
ops::Tensor compute_value(const Parameter& p) {
  if (!p.value16.defined()) return p.value;
  const ops::Tensor wide = ops::Tensor::empty(p.value16.shape());
  widen_to_fp32(p.fp16 ? Precision::fp16 : Precision::bf16, p.value16, wide);
  return wide;
}

std::int64_t local_rows(const Parameter& p) {
  return p.value.numel() / local_cols(p);
}

namespace {

// Standard normal for (key, row, col) by Box-Muller over two counter-based uniforms.
double normal(const ops::RandomKey& key, std::int64_t row, std::int64_t col) {
  float u[4];
  ops::uniform4(key, static_cast<std::uint64_t>(row), static_cast<std::uint64_t>(col), u);
  const double u1 = 1.0 - u[0], u2 = u[1];  // u1 in (0, 1]
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2 * std::numbers::pi * u2);
}

// A 16-bit run's parameters: the bucket's fp32 main values rounded into its 16-bit copy. A
// sharded bucket's copy is the optimizer's rounding of its shard (round_shard_to_half) and the
// gathers (step/optimizer_program.cpp, step/parameter_slots.cpp).
void refresh(GradientBucket& bucket, Precision precision) {
  if (bucket.main_values_sharded || bucket.values_staged) return;
  round_to_half(precision, bucket.values, bucket.values16);
}

}  // namespace

void GradientBucket::round_shard_to_half(Precision precision) const {
  if (main_values_sharded)
    round_to_half(precision, value_shard, values16.slice(0, shard_begin, shard_size));
  else if (values_staged && value_shard16.has_storage())
    round_to_half(precision, value_shard, value_shard16);
}

Parameter& ModelShard::add(std::string name, const ops::Shape& local, std::int64_t logical_rows,
                           std::int64_t logical_cols, RowMap row_map, std::int64_t col_offset,
                           double std, double constant) {
  const std::uint32_t index = next_index_++;
  if (!holding_) {
    skipped_ = Parameter{};
    return skipped_;
  }
  Parameter& p = parameters_.emplace_back();
  p.name = std::move(name);
  // Initialised here, then moved into its bucket; only a shape without tensors.
  p.value = materialize_ ? ops::Tensor::empty(local) : ops::Tensor::shape_only(local);
  p.bucket = current_bucket_;
  p.logical_rows = logical_rows;
  p.logical_cols = logical_cols;
  p.row_map = std::move(row_map);
  p.col_offset = col_offset;
  const std::int64_t rows = local_rows(p), cols = local_cols(p);
  if (p.row_map.size() != rows)
    throw std::logic_error(fmt::format("parameter {}: {} row mappings for {} local rows", p.name,
                                       p.row_map.size(), rows));
  // The parameter's index in the model is its random stream: the same on every device.
  if (!materialize_) return p;
  const ops::RandomKey key{.seed = config_.seed, .layer = index, .site = 0};
  float* v = p.value.data();
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c)
      v[r * cols + c] = std > 0
                            ? static_cast<float>(std * normal(key, p.row_map[r], col_offset + c))
                            : static_cast<float>(constant);
  return p;
}

ModelState& ModelShard::add_state(std::string name, const ops::Shape& local) {
  if (!holding_) {
    skipped_state_ = ModelState{};
    return skipped_state_;
  }
  return states_.emplace_back(ModelState{
      std::move(name), materialize_ ? ops::Tensor::zeros(local) : ops::Tensor::shape_only(local)});
}

ParameterDeclarer::ParameterDeclarer(ModelShard& shard, const ModelConfig& m, const Mesh& mesh,
                                     int rank)
    : model(m),
      mesh(mesh),
      at(mesh.coordinates(rank)),
      tp(mesh.plan().tensor_parallel),
      std(m.init_method_std),
      out_std(m.init_method_std / std::sqrt(2.0 * m.num_layers)),
      shard_(shard) {}

void ParameterDeclarer::bucket(std::string name) {
  shard_.current_bucket_ = std::move(name);
}

void ParameterDeclarer::hold(bool held) {
  shard_.holding_ = held;
}

std::int64_t ParameterDeclarer::vocab_start() const {
  return at.tp * (model.padded_vocab_size(tp) / tp);
}

Parameter& ParameterDeclarer::add(const std::string& name, const ops::Shape& local,
                                  std::int64_t logical_rows, std::int64_t logical_cols,
                                  RowMap row_map, std::int64_t col_offset, double init_std,
                                  double constant) {
  return shard_.add(name, local, logical_rows, logical_cols, std::move(row_map), col_offset,
                    init_std, constant);
}

ModelState& ParameterDeclarer::state(const std::string& name, const ops::Shape& local) {
  return shard_.add_state(name, local);
}

Parameter& ParameterDeclarer::replicated(Parameter& p, bool sees_split_tokens) const {
  p.tensor_replicated = true;
  if (tp > 1 && sees_split_tokens) p.reduction = GradientReduction::tensor_partial;
  return p;
}

Parameter* ParameterDeclarer::norm(const std::string& name, double value) {
  const std::int64_t h = model.hidden_size;
  return &replicated(add(name, {h}, h, 1, RowMap::range(0, h), 0, 0, value),
                     mesh.plan().sequence_parallel);
}

ModelShard::ModelShard(const ModelConfig& m, const Mesh& mesh, int rank, devices::Device& device,
                       StageContents contents, bool materialize)
    : config_(m),
      device_(device),
      contents_(std::move(contents)),
      materialize_(materialize),
      embedding_(std::make_unique<EmbeddingParameters>()),
      output_loss_(std::make_unique<OutputLossParameters>()) {
  if (!contents_.layers.empty() && static_cast<int>(contents_.layers.size()) != m.num_layers)
    throw std::logic_error(fmt::format("stage contents list {} layers of a {}-layer model",
                                       contents_.layers.size(), m.num_layers));
  const ParallelPlan& plan = mesh.plan();
  ParameterDeclarer declarer(*this, m, mesh, rank);
  vocab_start_ = static_cast<int>(declarer.vocab_start());
  if (m.num_experts > 0) {
    local_experts_ = m.num_experts / plan.expert_parallel;
    first_expert_ = declarer.at.ep * local_experts_;
  }
  // In the model's order, which is the parameters' random streams.
  Embedding::declare_parameters(declarer, contents_, *embedding_);
  layers_.resize(static_cast<std::size_t>(m.num_layers));
  for (int l = 0; l < m.num_layers; ++l) {
    LayerShard& L = layers_[static_cast<std::size_t>(l)];
    declarer.hold(holds_layer(l));
    TransformerLayer::declare_parameters(declarer, resolve_layer_spec(m, plan, l), l, L);
    // Counted only: another stage holds it; the layer keeps its kind of MLP.
    if (!holding_) L = L.moe() ? LayerShard{.mlp = MoeMlpParameters{}} : LayerShard{};
  }
  OutputLoss::declare_parameters(declarer, contents_, *output_loss_);
  declarer.hold(true);
  make_buckets(mesh, rank);
}

ModelShard::~ModelShard() = default;

const LayerShard& ModelShard::layer(int l) const {
  return layers_.at(static_cast<std::size_t>(l));
}

Parameter& ModelShard::embedding() {
  return *embedding_->word;
}
Parameter& ModelShard::positions() {
  return *embedding_->positions;
}
Parameter& ModelShard::output_weight() {
  return output_loss_->output_weight ? *output_loss_->output_weight : *embedding_->word;
}
Parameter& ModelShard::final_ln_weight() {
  return *output_loss_->final_norm_weight;
}
Parameter* ModelShard::final_ln_bias() {
  return output_loss_->final_norm_bias;
}

namespace {

// The layer a bucket named "layers.3.mlp/dense" belongs to; -1 for the embeddings and the end.
int layer_of_bucket(const std::string& name) {
  if (name.rfind("layers.", 0) != 0) return -1;
  return std::stoi(name.substr(7));
}

// The copies of a parameter's gradient over its replicas: dp x cp, or for an expert the expert
// data-parallel group.
std::int64_t replicas_of(const Mesh& mesh, int rank, const Parameter& p) {
  return mesh.group(p.expert ? GroupKind::expert_data : GroupKind::data_context, rank).size();
}

// A bucket's elements, padded so that every replica's shard is equal (and a whole number of
// cache lines).
std::int64_t padded_elements(const std::vector<Parameter*>& params, std::int64_t replicas) {
  std::int64_t total = 0;
  for (const Parameter* p : params)
    total += p->value.numel();
  const std::int64_t quantum = 16 * replicas;
  return (total + quantum - 1) / quantum * quantum;
}

}  // namespace

void ModelShard::make_buckets(const Mesh& mesh, int rank) {
  // Buckets in backward order: the output layer, the final norm, then each layer from the last
  // (MLP half, then attention half), then the embeddings.
  std::vector<std::string> order{"output", "final_norm"};
  for (int l = config_.num_layers - 1; l >= 0; --l) {
    order.push_back(fmt::format("layers.{}.mlp", l));
    order.push_back(fmt::format("layers.{}.attention", l));
  }
  order.push_back("embedding");
  struct Planned {
    std::string name;
    std::vector<Parameter*> params;
  };
  std::vector<Planned> planned;
  for (const std::string& point : order)
    for (int kind = 0; kind < 3; ++kind) {
      std::vector<Parameter*> params;
      for (Parameter& p : parameters_) {
        const int k = p.expert ? 2 : (p.reduction == GradientReduction::tensor_partial ? 1 : 0);
        if (p.bucket == point && k == kind) params.push_back(&p);
      }
      if (params.empty()) continue;
      static constexpr const char* kKind[] = {"dense", "tp_partial", "expert"};
      planned.push_back({point + "/" + kKind[kind], std::move(params)});
    }
  // ZeRO stage 2: the layers' sharded buckets are laid out in gradient slots, layer after layer
  // of the stage taking slot 0, 1, ... in turn; each slot as large as its largest layer.
  std::vector<std::int64_t> staged_at(planned.size(), -1);
  std::vector<int> slot_of(planned.size(), -1), values_slot_of(planned.size(), -1);
  if (mesh.plan().shard_gradients && mesh.plan().distributed_optimizer) {
    std::map<int, std::int64_t> layer_bytes;  // elements of each layer's staged buckets
    for (std::size_t b = 0; b < planned.size(); ++b) {
      const int l = layer_of_bucket(planned[b].name);
      const std::int64_t replicas = replicas_of(mesh, rank, *planned[b].params.front());
      if (l < 0 || replicas <= 1) continue;
      staged_at[b] = layer_bytes[l];
      layer_bytes[l] += padded_elements(planned[b].params, replicas);
    }
    // The slots are taken in turn. Under a zero-bubble schedule the W actions take them, a
    // layer's W after the I actions of the layers below, which write their gradients (the
    // norms', the biases') too: with more layers than slots, what the I actions write is held
    // aside until the W (hold_input_pass_gradients). Ampipe's attention and --use-pipe-experts'
    // items write weight gradients in the I action as well: there, as with no more layers than
    // slots, each layer keeps a slot of its own. The parameter slots (stage 3) are the units in
    // flight whatever the schedule: the W actions read no values.
    const ParallelPlan& plan = mesh.plan();
    const bool zero_bubble = plan.pipeline_scheduler.rfind("zb", 0) == 0;
    holds_input_pass_gradients_ = zero_bubble && layer_bytes.size() > kGradientSlots &&
                                  plan.ampipe_degree == 1 && !plan.pipe_experts;
    const std::size_t gradient_slot_count =
        zero_bubble && !holds_input_pass_gradients_ ? layer_bytes.size() : kGradientSlots;
    const auto units_in_flight = static_cast<std::size_t>(mesh.plan().zero_units_in_flight);
    std::vector<std::int64_t> slot_elements(gradient_slot_count, 0),
        parameter_slot_elements(units_in_flight, 0);
    int ordinal = 0;
    for (const auto& [l, elements] : layer_bytes) {
      const auto at = static_cast<std::size_t>(ordinal++);
      const std::size_t slot = at % gradient_slot_count, values_slot = at % units_in_flight;
      layer_slots_[l] = static_cast<int>(slot);
      layer_parameter_slots_[l] = static_cast<int>(values_slot);
      slot_elements[slot] = std::max(slot_elements[slot], elements);
      parameter_slot_elements[values_slot] =
          std::max(parameter_slot_elements[values_slot], elements);
    }
    const ParameterBytes bytes = parameter_bytes(config_.precision);
    const auto slot = [this](std::int64_t elements, rt::MemoryCategory category,
                             int element_bytes) {
      return materialize_ ? ops::Tensor::zeros({elements}, device_, category)
                          : ops::Tensor::shape_only({elements}, device_, category,
                                                    static_cast<std::size_t>(element_bytes));
    };
    for (const std::int64_t elements : slot_elements)
      if (elements > 0)
        gradient_slots_.push_back(slot(elements, rt::MemoryCategory::gradients, bytes.gradient));
    // Stage 3: the gathered values laid out as the gradients are, in the layer's parameter slot
    // (the slots taken in layer order, so an empty one is only ever last). A materialized 16-bit
    // run gathers the 16-bit values straight into its 16-bit slots (2 bytes a value, as
    // predicted) and keeps no fp32 copy of them: its fp32 slots are shapes only, which nothing
    // reads.
    if (mesh.plan().shard_parameters)
      for (const std::int64_t elements : parameter_slot_elements)
        if (elements > 0) {
          if (materialize_ && config_.precision != Precision::fp32) {
            parameter_slots_.push_back(ops::Tensor::shape_only({elements}));
            parameter_slots16_.push_back(
                ops::Bf16Tensor::zeros({elements}, device_, rt::MemoryCategory::parameters));
          } else {
            parameter_slots_.push_back(
                slot(elements, rt::MemoryCategory::parameters, bytes.parameter));
          }
        }
    for (std::size_t b = 0; b < planned.size(); ++b)
      if (staged_at[b] >= 0) {
        slot_of[b] = layer_slots_.at(layer_of_bucket(planned[b].name));
        values_slot_of[b] = layer_parameter_slots_.at(layer_of_bucket(planned[b].name));
      }
  }
  for (std::size_t b = 0; b < planned.size(); ++b) {
    ops::Tensor staged, staged_values;
    ops::Bf16Tensor staged_values16;
    if (staged_at[b] >= 0) {
      const std::int64_t n =
          padded_elements(planned[b].params, replicas_of(mesh, rank, *planned[b].params.front()));
      const auto s = static_cast<std::size_t>(slot_of[b]);
      staged = gradient_slots_[s].slice(0, staged_at[b], n);
      const auto v = static_cast<std::size_t>(values_slot_of[b]);
      if (!parameter_slots_.empty()) staged_values = parameter_slots_[v].slice(0, staged_at[b], n);
      if (!parameter_slots16_.empty())
        staged_values16 = parameter_slots16_[v].slice(0, staged_at[b], n);
    }
    make_bucket(mesh, rank, std::move(planned[b].name), std::move(planned[b].params), staged,
                slot_of[b], staged_values, staged_values16);
    if (staged.defined() && holds_input_pass_gradients_) hold_input_pass_gradients(buckets_.back());
  }
}

namespace {

// Whether a zero-bubble W action writes parameter `name`'s gradient: the products' weights (and
// the biases computed with them), whose weight halves wait for it. The I action writes the rest:
// the norms, the biases added to the residual, the router, the shared experts' gate.
bool written_by_weight_pass(const std::string& name) {
  static const char* const kWeightPass[] = {".attention.qkv.weight",
                                            ".attention.qkv.bias",
                                            ".attention.proj.weight",
                                            ".mlp.fc1.weight",
                                            ".mlp.fc1.bias",
                                            ".mlp.fc2.weight",
                                            ".moe.experts.fc1.weight",
                                            ".moe.experts.fc2.weight",
                                            ".moe.shared_experts.fc1.weight",
                                            ".moe.shared_experts.fc2.weight"};
  for (const char* suffix : kWeightPass) {
    const std::string s = suffix;
    if (name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0)
      return true;
  }
  return false;
}

}  // namespace

void ModelShard::hold_input_pass_gradients(GradientBucket& bucket) {
  std::int64_t at = 0, held = 0;
  for (const Parameter* p : bucket.params) {
    const std::int64_t n = p->value.numel();
    if (!written_by_weight_pass(p->name)) {
      bucket.held_at.push_back({.at = at, .held = held, .size = n});
      held += n;
    }
    at += n;
  }
  if (held == 0) return;
  const ParameterBytes bytes = parameter_bytes(config_.precision);
  bucket.held_grads = materialize_
                          ? ops::Tensor::zeros({held}, device_, rt::MemoryCategory::gradients)
                          : ops::Tensor::shape_only({held}, device_, rt::MemoryCategory::gradients,
                                                    static_cast<std::size_t>(bytes.gradient));
  std::size_t i = 0;
  for (Parameter* p : bucket.params)
    if (!written_by_weight_pass(p->name)) {
      const GradientBucket::HeldRange& r = bucket.held_at[i++];
      p->grad = bucket.held_grads.slice(0, r.held, r.size).reshape(p->value.shape());
    }
}

bool ModelShard::parameters_sharded(int l) const {
  return !parameter_slots_.empty() && gradient_slot(l) >= 0;
}

int ModelShard::parameter_slot(int l) const {
  const auto found = layer_parameter_slots_.find(l);
  return found == layer_parameter_slots_.end() ? -1 : found->second;
}

int ModelShard::gradient_slot(int l) const {
  const auto found = layer_slots_.find(l);
  return found == layer_slots_.end() ? -1 : found->second;
}

void ModelShard::make_bucket(const Mesh& mesh, int rank, std::string name,
                             std::vector<Parameter*> params, ops::Tensor staged_grads, int slot,
                             ops::Tensor staged_values, ops::Bf16Tensor staged_values16) {
  GradientBucket bucket;
  bucket.name = std::move(name);
  bucket.params = std::move(params);
  bucket.expert = bucket.params.front()->expert;
  bucket.reduction = bucket.params.front()->reduction;
  const GroupKind replicas = bucket.expert ? GroupKind::expert_data : GroupKind::data_context;
  const devices::ProcessGroup& group = mesh.group(replicas, rank);
  bucket.replicas = group.size();
  bucket.replica = group.rank_of(static_cast<rt::DeviceId>(rank));
  const std::int64_t padded = padded_elements(bucket.params, bucket.replicas);
  // Built without tensors, each is counted at the bytes the training precision keeps it in; a
  // materialized step is fp32.
  const ParameterBytes bytes = parameter_bytes(config_.precision);
  auto zeros = [this](std::int64_t n, rt::MemoryCategory category, int element_bytes) {
    return materialize_ ? ops::Tensor::zeros({n}, device_, category)
                        : ops::Tensor::shape_only({n}, device_, category,
                                                  static_cast<std::size_t>(element_bytes));
  };
  const bool bf16 = materialize_ && config_.precision != Precision::fp32;
  bucket.sharded = mesh.plan().distributed_optimizer && bucket.replicas > 1;
  bucket.shard_size = bucket.sharded ? padded / bucket.replicas : padded;
  bucket.shard_begin = bucket.sharded ? bucket.replica * bucket.shard_size : 0;
  // A materialized 16-bit run holds the fp32 main values in the optimizer and a 16-bit copy as
  // the model's parameters (Bf16Tensor storage, read as fp16 in an fp16 run); sharded, the main
  // values of its shard only (GradientBucket::main_values_sharded).
  bucket.values_staged = staged_values.defined();
  bucket.main_values_sharded = bf16 && bucket.sharded && !bucket.values_staged;
  if (bucket.values_staged)
    bucket.values = staged_values;
  else if (bucket.main_values_sharded)
    bucket.values = ops::Tensor::shape_only({padded});
  else
    bucket.values =
        zeros(padded, bf16 ? rt::MemoryCategory::optimizer_state : rt::MemoryCategory::parameters,
              bytes.parameter);
  if (bf16)
    bucket.values16 = bucket.values_staged ? staged_values16
                                           : ops::Bf16Tensor::zeros({padded}, device_,
                                                                    rt::MemoryCategory::parameters);
  bucket.staged = staged_grads.defined();
  bucket.slot = slot;
  bucket.grads =
      bucket.staged ? staged_grads : zeros(padded, rt::MemoryCategory::gradients, bytes.gradient);
  // The initial values, laid out as the bucket's: in `values`, or, where a 16-bit run keeps no
  // fp32 values whole, in a buffer of their own that only passes them to the shard (and to the
  // 16-bit copy).
  const ops::Tensor initial =
      materialize_ && !bucket.values.has_storage() ? ops::Tensor::zeros({padded}) : bucket.values;
  std::int64_t at = 0;
  for (Parameter* p : bucket.params) {
    if (materialize_)
      initial.slice(0, at, p->value.numel()).reshape(p->value.shape()).copy_from(p->value);
    p->value = bucket.values.slice(0, at, p->value.numel()).reshape(p->value.shape());
    p->grad = bucket.grads.slice(0, at, p->value.numel()).reshape(p->value.shape());
    if (bf16) p->value16 = bucket.values16.slice(0, at, p->value.numel()).reshape(p->value.shape());
    p->fp16 = bf16 && config_.precision == Precision::fp16;
    p->bucket = bucket.name;
    at += p->value.numel();
  }
  if (bucket.staged)
    bucket.grad_shard = zeros(bucket.shard_size, rt::MemoryCategory::gradients, bytes.gradient);
  // Stage 3, or a 16-bit run's sharded main values: the replica keeps its shard of the initial
  // values; a stage 3 slot is another layer's next.
  if (bucket.values_staged || bucket.main_values_sharded) {
    // In bf16 the fp32 main values (optimizer state, as `values` is unsharded) and, at stage 3,
    // their copy rounded for the gathers.
    bucket.value_shard =
        zeros(bucket.shard_size,
              bf16 ? rt::MemoryCategory::optimizer_state : rt::MemoryCategory::parameters,
              bytes.parameter);
    if (materialize_)
      bucket.value_shard.copy_from(initial.slice(0, bucket.shard_begin, bucket.shard_size));
    if (bf16 && bucket.values_staged)
      bucket.value_shard16 =
          ops::Bf16Tensor::zeros({bucket.shard_size}, device_, rt::MemoryCategory::parameters);
  }
  bucket.exp_avg = zeros(bucket.shard_size, rt::MemoryCategory::optimizer_state, 4);
  bucket.exp_avg_sq = zeros(bucket.shard_size, rt::MemoryCategory::optimizer_state, 4);
  // 16-bit training: the fp32 master weights (and for fp16 the fp32 gradients) of the shard,
  // beside the two moments.
  if (bucket.main_values_sharded)  // every replica's shard as the gathers would bring it
    round_to_half(config_.precision, initial, bucket.values16);
  else if (bucket.values_staged && bf16)  // what the first step's gathers send
    bucket.round_shard_to_half(config_.precision);
  else if (bf16)
    refresh(bucket, config_.precision);
  if (!materialize_ && bytes.optimizer_state > 8)
    bucket.master_state =
        zeros(bucket.shard_size, rt::MemoryCategory::optimizer_state, bytes.optimizer_state - 8);
  buckets_.push_back(std::move(bucket));
}

void ModelShard::refresh_bf16_copies() {
  for (GradientBucket& b : buckets_)
    if (b.values16.defined()) refresh(b, config_.precision);
}

void ModelShard::zero_grads() {
  for (GradientBucket& b : buckets_) {
    b.grads.fill(0.f);
    if (b.staged) b.grad_shard.fill(0.f);
    if (b.held_grads.defined()) b.held_grads.fill(0.f);
  }
}

const GradientBucket& ModelShard::bucket_of(const Parameter& p) const {
  for (const GradientBucket& b : buckets_)
    if (b.name == p.bucket) return b;
  throw std::logic_error("parameter " + p.name + " has no gradient bucket");
}

}  // namespace weave::graphs
