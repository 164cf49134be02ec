#include "weave/graphs/model_shard.hpp"

#include <fmt/format.h>

#include <cmath>
#include <numbers>
#include <numeric>

#include "weave/ops/random.hpp"

namespace weave::graphs {

std::int64_t local_cols(const Parameter& p) {
  return p.value.rank() == 1 ? 1 : p.value.dim(-1);
}
std::int64_t local_rows(const Parameter& p) {
  return p.value.numel() / local_cols(p);
}

namespace {

std::vector<std::int64_t> iota_from(std::int64_t first, std::int64_t count) {
  std::vector<std::int64_t> v(static_cast<std::size_t>(count));
  std::iota(v.begin(), v.end(), first);
  return v;
}

// Standard normal for (key, row, col) by Box-Muller over two counter-based uniforms.
double normal(const ops::RandomKey& key, std::int64_t row, std::int64_t col) {
  float u[4];
  ops::uniform4(key, static_cast<std::uint64_t>(row), static_cast<std::uint64_t>(col), u);
  const double u1 = 1.0 - u[0], u2 = u[1];  // u1 in (0, 1]
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2 * std::numbers::pi * u2);
}

}  // namespace

Parameter& ModelShard::add(std::string name, const ops::Shape& local, std::int64_t logical_rows,
                           std::int64_t logical_cols, std::vector<std::int64_t> row_map,
                           std::int64_t col_offset, double std, double constant) {
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
  if (static_cast<std::int64_t>(p.row_map.size()) != rows)
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

ModelShard::ModelShard(const ModelConfig& m, const Mesh& mesh, int rank, devices::Device& device,
                       StageContents contents, bool materialize)
    : config_(m), device_(device), contents_(std::move(contents)), materialize_(materialize) {
  if (!contents_.layers.empty() && static_cast<int>(contents_.layers.size()) != m.num_layers)
    throw std::logic_error(fmt::format("stage contents list {} layers of a {}-layer model",
                                       contents_.layers.size(), m.num_layers));
  const MeshCoordinates at = mesh.coordinates(rank);
  const ParallelPlan& plan = mesh.plan();
  const int tp = plan.tensor_parallel, t = at.tp;
  const std::int64_t h = m.hidden_size, d = m.head_dim(), heads = m.num_attention_heads;
  const std::int64_t vocab = m.padded_vocab_size(tp), v_local = vocab / tp;
  const std::int64_t heads_local = heads / tp, f = m.ffn_hidden_size, f_local = f / tp;
  // Grouped-query attention: each tp rank holds whole key/value groups with their query heads.
  const std::int64_t groups = m.query_groups(), groups_local = groups / tp;
  const std::int64_t per_group = heads / groups;
  const bool biases = m.add_bias_linear;
  const bool layer_norm = m.normalization == Normalization::layer_norm;
  const bool tied = !m.untie_embeddings_and_output_weights;
  const bool swiglu = m.activation == Activation::swiglu;
  const double std = m.init_method_std;
  // Output layers of each block start smaller (Megatron's scaled init): 1/sqrt(2 layers).
  const double out_std = std / std::sqrt(2.0 * m.num_layers);
  vocab_start_ = static_cast<int>(t * v_local);
  const bool partial_over_tp = plan.sequence_parallel;

  auto replicated = [&](Parameter& p, bool sees_split_tokens) -> Parameter& {
    p.tensor_replicated = true;
    if (tp > 1 && sees_split_tokens) p.reduction = GradientReduction::tensor_partial;
    return p;
  };
  current_bucket_ = "embedding";
  const bool word_held = contents_.input_embedding || (tied && contents_.output_layer);
  holding_ = word_held;
  word_ =
      &add("embedding.word", {v_local, h}, vocab, h, iota_from(vocab_start_, v_local), 0, std, 0);
  holding_ = contents_.input_embedding;
  if (m.learned_positions())
    positions_ = &replicated(add("embedding.position", {m.positions(), h}, m.positions(), h,
                                 iota_from(0, m.positions()), 0, std, 0),
                             partial_over_tp);
  if (!contents_.input_embedding) positions_ = nullptr;
  if (!word_held) word_ = nullptr;
  layers_.resize(static_cast<std::size_t>(m.num_layers));
  for (int l = 0; l < m.num_layers; ++l) {
    LayerShard& L = layers_[l];
    holding_ = holds_layer(l);
    const std::string prefix = fmt::format("layers.{}.", l);
    auto norm = [&](const char* name, double value) -> Parameter* {
      return &replicated(add(prefix + name, {h}, h, 1, iota_from(0, h), 0, 0, value),
                         partial_over_tp);
    };
    current_bucket_ = prefix + "attention";
    L.ln1_weight = norm("input_norm.weight", 1);
    if (layer_norm) L.ln1_bias = norm("input_norm.bias", 0);
    // QKV: local rows (group, which, dim) for this rank's key/value groups, which running over
    // the group's query heads, then its key, then its value (one query head per group without
    // grouped-query attention); logical rows: every query head, then every key, then every
    // value head, d rows each.
    std::vector<std::int64_t> qkv_rows;
    for (std::int64_t gl = 0; gl < groups_local; ++gl) {
      const std::int64_t g = t * groups_local + gl;
      for (std::int64_t which = 0; which < per_group + 2; ++which) {
        const std::int64_t first = which < per_group
                                       ? (g * per_group + which) * d
                                       : (heads + (which - per_group) * groups + g) * d;
        for (std::int64_t i = 0; i < d; ++i)
          qkv_rows.push_back(first + i);
      }
    }
    const std::int64_t qkv_local = (heads_local + 2 * groups_local) * d;
    const std::int64_t qkv_logical = (heads + 2 * groups) * d;
    L.qkv_weight =
        &add(prefix + "attention.qkv.weight", {qkv_local, h}, qkv_logical, h, qkv_rows, 0, std, 0);
    if (biases)
      L.qkv_bias =
          &add(prefix + "attention.qkv.bias", {qkv_local}, qkv_logical, 1, qkv_rows, 0, 0, 0);
    L.proj_weight = &add(prefix + "attention.proj.weight", {h, heads_local * d}, h, h,
                         iota_from(0, h), t * heads_local * d, out_std, 0);
    if (biases)
      L.proj_bias =
          &replicated(add(prefix + "attention.proj.bias", {h}, h, 1, iota_from(0, h), 0, 0, 0),
                      partial_over_tp);
    current_bucket_ = prefix + "mlp";
    L.ln2_weight = norm("mlp_norm.weight", 1);
    if (layer_norm) L.ln2_bias = norm("mlp_norm.bias", 0);
    const std::int64_t f1 = swiglu ? 2 * f : f;
    if (m.is_moe_layer(l)) {
      L.moe = true;
      const int ep = plan.expert_parallel;
      local_experts_ = m.num_experts / ep;
      first_expert_ = at.ep * local_experts_;
      // The MoE layer routes this rank's share of the tokens: with tp > 1 the router's
      // gradient is a partial sum over the tensor-parallel ranks.
      L.router_weight = &replicated(add(prefix + "moe.router.weight", {m.num_experts, h},
                                        m.num_experts, h, iota_from(0, m.num_experts), 0, std, 0),
                                    true);
      // Split over the tensor-parallel group (mesh.experts_split()), each local expert's fc1
      // holds this rank's columns of the hidden layer (SwiGLU: its gates, then its values) and
      // fc2 the matching rows of the input dimension.
      const int etp = mesh.experts_split() ? tp : 1, et = mesh.experts_split() ? t : 0;
      const std::int64_t fe = f / etp, f1e = swiglu ? 2 * fe : fe;
      std::vector<std::int64_t> fc1_rows;
      for (std::int64_t e = first_expert_; e < first_expert_ + local_experts_; ++e) {
        for (std::int64_t i = 0; i < fe; ++i)
          fc1_rows.push_back(e * f1 + et * fe + i);
        if (swiglu)
          for (std::int64_t i = 0; i < fe; ++i)
            fc1_rows.push_back(e * f1 + f + et * fe + i);
      }
      L.expert_fc1 = &add(prefix + "moe.experts.fc1.weight", {local_experts_, f1e, h},
                          m.num_experts * f1, h, fc1_rows, 0, std, 0);
      L.expert_fc2 =
          &add(prefix + "moe.experts.fc2.weight", {local_experts_, h, fe}, m.num_experts * h, f,
               iota_from(first_expert_ * h, local_experts_ * h), et * fe, out_std, 0);
      L.expert_fc1->expert = L.expert_fc2->expert = true;
    } else {
      std::vector<std::int64_t> fc1_rows = iota_from(t * f_local, f_local);
      if (swiglu) {
        const auto values = iota_from(f + t * f_local, f_local);
        fc1_rows.insert(fc1_rows.end(), values.begin(), values.end());
      }
      const std::int64_t f1_local = swiglu ? 2 * f_local : f_local;
      L.fc1_weight = &add(prefix + "mlp.fc1.weight", {f1_local, h}, f1, h, fc1_rows, 0, std, 0);
      if (biases) L.fc1_bias = &add(prefix + "mlp.fc1.bias", {f1_local}, f1, 1, fc1_rows, 0, 0, 0);
      L.fc2_weight = &add(prefix + "mlp.fc2.weight", {h, f_local}, h, f, iota_from(0, h),
                          t * f_local, out_std, 0);
      if (biases)
        L.fc2_bias = &replicated(add(prefix + "mlp.fc2.bias", {h}, h, 1, iota_from(0, h), 0, 0, 0),
                                 partial_over_tp);
    }
    if (!holding_) L = LayerShard{.moe = L.moe};  // counted only: another stage holds it
  }
  current_bucket_ = "final_norm";
  holding_ = contents_.output_layer;
  final_ln_weight_ =
      &replicated(add("final_norm.weight", {h}, h, 1, iota_from(0, h), 0, 0, 1), partial_over_tp);
  if (layer_norm)
    final_ln_bias_ =
        &replicated(add("final_norm.bias", {h}, h, 1, iota_from(0, h), 0, 0, 0), partial_over_tp);
  // Untied: the output layer's own weight, [vocabulary shard, h] like the word embedding.
  current_bucket_ = "output";
  if (!tied)
    output_ =
        &add("output.weight", {v_local, h}, vocab, h, iota_from(vocab_start_, v_local), 0, std, 0);
  if (!holding_) final_ln_weight_ = final_ln_bias_ = output_ = nullptr;
  holding_ = true;
  // Buckets in backward order: the output layer, the final norm, then each layer from the last (MLP
  // half, then attention half), then the embeddings.
  std::vector<std::string> order{"output", "final_norm"};
  for (int l = m.num_layers - 1; l >= 0; --l) {
    order.push_back(fmt::format("layers.{}.mlp", l));
    order.push_back(fmt::format("layers.{}.attention", l));
  }
  order.push_back("embedding");
  for (const std::string& point : order)
    for (int kind = 0; kind < 3; ++kind) {
      GradientBucket bucket;
      for (Parameter& p : parameters_) {
        const int k = p.expert ? 2 : (p.reduction == GradientReduction::tensor_partial ? 1 : 0);
        if (p.bucket == point && k == kind) bucket.params.push_back(&p);
      }
      if (bucket.params.empty()) continue;
      static constexpr const char* kKind[] = {"dense", "tp_partial", "expert"};
      bucket.name = point + "/" + kKind[kind];
      bucket.expert = kind == 2;
      bucket.reduction = bucket.params.front()->reduction;
      const GroupKind replicas = bucket.expert ? GroupKind::expert_data : GroupKind::data_context;
      const devices::ProcessGroup& group = mesh.group(replicas, rank);
      bucket.replicas = group.size();
      bucket.replica = group.rank_of(static_cast<rt::DeviceId>(rank));
      std::int64_t total = 0;
      for (const Parameter* p : bucket.params)
        total += p->value.numel();
      // Padded so that every replica's shard is equal (and a whole number of cache lines).
      const std::int64_t quantum = 16 * bucket.replicas;
      const std::int64_t padded = (total + quantum - 1) / quantum * quantum;
      // Built without tensors, each is counted at the bytes the training precision keeps it in;
      // a materialized step is fp32.
      const ParameterBytes bytes = parameter_bytes(m.precision);
      auto zeros = [this](std::int64_t n, rt::MemoryCategory category, int element_bytes) {
        return materialize_ ? ops::Tensor::zeros({n}, device_, category)
                            : ops::Tensor::shape_only({n}, device_, category,
                                                      static_cast<std::size_t>(element_bytes));
      };
      bucket.values = zeros(padded, rt::MemoryCategory::parameters, bytes.parameter);
      bucket.grads = zeros(padded, rt::MemoryCategory::gradients, bytes.gradient);
      std::int64_t at = 0;
      for (Parameter* p : bucket.params) {
        const ops::Tensor value =
            bucket.values.slice(0, at, p->value.numel()).reshape(p->value.shape());
        if (materialize_) value.copy_from(p->value);
        p->value = value;
        p->grad = bucket.grads.slice(0, at, p->value.numel()).reshape(p->value.shape());
        p->bucket = bucket.name;
        at += p->value.numel();
      }
      bucket.sharded = mesh.plan().distributed_optimizer && bucket.replicas > 1;
      bucket.shard_size = bucket.sharded ? padded / bucket.replicas : padded;
      bucket.shard_begin = bucket.sharded ? bucket.replica * bucket.shard_size : 0;
      bucket.exp_avg = zeros(bucket.shard_size, rt::MemoryCategory::optimizer_state, 4);
      bucket.exp_avg_sq = zeros(bucket.shard_size, rt::MemoryCategory::optimizer_state, 4);
      // 16-bit training: the fp32 master weights (and for fp16 the fp32 gradients) of the shard,
      // beside the two moments.
      if (!materialize_ && bytes.optimizer_state > 8)
        bucket.master_state = zeros(bucket.shard_size, rt::MemoryCategory::optimizer_state,
                                    bytes.optimizer_state - 8);
      buckets_.push_back(std::move(bucket));
    }
}

void ModelShard::zero_grads() {
  for (GradientBucket& b : buckets_)
    b.grads.fill(0.f);
}

const GradientBucket& ModelShard::bucket_of(const Parameter& p) const {
  for (const GradientBucket& b : buckets_)
    if (b.name == p.bucket) return b;
  throw std::logic_error("parameter " + p.name + " has no gradient bucket");
}

}  // namespace weave::graphs
