#include "weave/graphs/generator.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>

#include "model/attention_block.hpp"
#include "model/dense_mlp.hpp"
#include "model/norm.hpp"
#include "moe/moe_experts.hpp"
#include "moe/moe_mlp.hpp"
#include "moe/moe_router.hpp"
#include "moe/moe_shared_experts.hpp"
#include "weave/devices/collective_matcher.hpp"
#include "weave/graphs/mesh.hpp"
#include "weave/graphs/pipeline_layout.hpp"
#include "weave/ops/attention.hpp"
#include "weave/ops/elementwise.hpp"
#include "weave/ops/embedding.hpp"
#include "weave/ops/experts.hpp"
#include "weave/ops/linear.hpp"
#include "weave/ops/random.hpp"
#include "weave/ops/router.hpp"

namespace weave::graphs {

using ops::Tensor;
using rt::TaskId;

std::int32_t sample_token(std::span<const float> logits, const SamplingOptions& options,
                          std::int64_t position) {
  if (logits.empty()) throw std::invalid_argument("sampling needs at least one logit");
  std::vector<std::int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  // Most likely first, ties to the lower id: the same order on every rank.
  std::stable_sort(order.begin(), order.end(),
                   [&](std::int32_t a, std::int32_t b) { return logits[a] > logits[b]; });
  if (options.temperature <= 0) return order.front();
  const std::size_t k =
      options.top_k > 0 ? std::min<std::size_t>(order.size(), options.top_k) : order.size();
  const double top = logits[order.front()];
  std::vector<double> weight(k);
  double total = 0;
  for (std::size_t i = 0; i < k; ++i)
    total += weight[i] = std::exp((logits[order[i]] - top) / options.temperature);
  // One uniform draw keyed by the seed and the position: a pure function, no generator state.
  const double u = ops::uniform({.seed = options.seed, .layer = 0, .site = 4},
                                static_cast<std::uint64_t>(position), 0) *
                   total;
  double acc = 0;
  for (std::size_t i = 0; i < k; ++i) {
    acc += weight[i];
    if (u < acc) return order[i];
  }
  return order[k - 1];
}

namespace {

// What one rank holds for decoding: its buffers (one token's rows) and its layers' caches.
struct RankDecode {
  int rank = 0;
  MeshCoordinates at;
  ModelShard* shard = nullptr;
  Tensor x, emb, norm, mean, rstd, qkv, attn, lse, proj, fc1, act, mlp_out;
  Tensor router_logits, probs, top_weight, rows_in, rows_pre, rows_hidden, rows_out;
  Tensor shared_fc1, shared_act, shared_out;  // the shared experts' (MoE layers)
  Tensor shared_gate;                         // --moe-shared-expert-gate's score
  Tensor final_norm, logits_local, logits_all;
  std::vector<std::int32_t> top_index, token_id{0};
  std::vector<std::int64_t> begin;
  AttentionDecodeState attention;        // what project_qkv keeps beyond the QKV
  std::vector<Tensor> k_cache, v_cache;  // by model layer (held layers only)
  std::vector<float> token{0.f};         // the sampled token, broadcast as a float
};

}  // namespace

struct Generator::Impl {
  ModelConfig model;
  ParallelPlan plan;
  TrainingStep& step;
  devices::DeviceSet& devices;
  devices::Communicator& comm;
  PipelineLayout layout;
  std::int64_t Hl = 0, Gl = 0, qpg = 0, d = 0, h = 0, Vl = 0, max_positions = 0;
  std::vector<LayerSpec> specs;  // by model layer
  std::vector<RankDecode> ranks;
  rt::Graph graph;
  // The step being run: its position, and the options its sampling uses.
  std::int64_t position = 0;
  SamplingOptions sampling;
  int last_stage_rank = 0;  // a rank of the last stage whose logits are read

  Impl(const ModelConfig& m, const ParallelPlan& p, TrainingStep& s, devices::DeviceSet& set,
       devices::Communicator& c)
      : model(m), plan(p), step(s), devices(set), comm(c), layout(make_pipeline_layout(m, p)) {
    const int tp = p.tensor_parallel;
    Hl = m.num_attention_heads / tp;
    Gl = m.query_groups() / tp;
    qpg = m.num_attention_heads / m.query_groups();
    d = m.head_dim();
    h = m.hidden_size;
    Vl = m.padded_vocab_size(tp) / tp;
    max_positions = m.positions();
    for (int l = 0; l < m.num_layers; ++l)
      specs.push_back(resolve_layer_spec(m, p, l));
    for (int r = 0; r < p.devices(); ++r)
      if (!s.holds(r))
        throw std::invalid_argument(fmt::format(
            "generation runs every rank of the layout in this process; rank {} is built "
            "elsewhere",
            r));
    allocate();
    build();
  }

  Tensor buffer(int rank, const ops::Shape& shape) {
    return Tensor::zeros(shape, devices[static_cast<rt::DeviceId>(rank)],
                         rt::MemoryCategory::activations);
  }

  void allocate() {
    const Mesh& mesh = step.mesh();
    const int E = model.num_experts, k = model.moe_router_topk;
    const std::int64_t f1l = (model.activation == Activation::swiglu ? 2 : 1) *
                             (model.ffn_hidden_size / plan.tensor_parallel);
    const int etp = mesh.experts_split() ? plan.tensor_parallel : 1;
    const std::int64_t fe = E > 0 ? model.expert_ffn_hidden_size() / etp : 0;
    const std::int64_t f1e = (model.activation == Activation::swiglu ? 2 : 1) * fe;
    ranks.resize(static_cast<std::size_t>(plan.devices()));
    for (int r = 0; r < plan.devices(); ++r) {
      RankDecode& R = ranks[static_cast<std::size_t>(r)];
      R.rank = r;
      R.at = mesh.coordinates(r);
      R.shard = &step.shard(r);
      R.x = buffer(r, {1, h});
      R.emb = buffer(r, {1, h});
      R.norm = buffer(r, {1, h});
      R.mean = buffer(r, {1});
      R.rstd = buffer(r, {1});
      R.qkv = buffer(r, {1, 1, Gl, (qpg + 2) * d});
      R.attn = buffer(r, {1, 1, Gl, qpg * d});
      R.lse = buffer(r, {1, Hl, 1});
      R.proj = buffer(r, {1, h});
      R.fc1 = buffer(r, {1, f1l});
      R.act = buffer(r, {1, model.ffn_hidden_size / plan.tensor_parallel});
      R.mlp_out = buffer(r, {1, h});
      R.attention = allocate_attention_decoding(
          specs.front(), [&](const ops::Shape& s) { return buffer(r, s); }, Gl, qpg, d);
      if (E > 0) {
        R.router_logits = buffer(r, {1, E});
        R.probs = buffer(r, {1, E});
        R.top_weight = buffer(r, {1, k});
        R.top_index.resize(static_cast<std::size_t>(k));
        R.rows_in = buffer(r, {k, h});
        R.rows_pre = buffer(r, {k, f1e});
        R.rows_hidden = buffer(r, {k, fe});
        R.rows_out = buffer(r, {k, h});
      }
      if (model.has_shared_experts()) {
        const std::int64_t fs = model.moe_shared_expert_intermediate_size / plan.tensor_parallel;
        R.shared_fc1 = buffer(r, {1, (model.activation == Activation::swiglu ? 2 : 1) * fs});
        R.shared_act = buffer(r, {1, fs});
        R.shared_out = buffer(r, {1, h});
        R.shared_gate = buffer(r, {1, 1});
      }
      R.final_norm = buffer(r, {1, h});
      R.logits_local = buffer(r, {1, Vl});
      R.logits_all = buffer(r, {Vl * plan.tensor_parallel});
      R.k_cache.resize(static_cast<std::size_t>(model.num_layers));
      R.v_cache.resize(static_cast<std::size_t>(model.num_layers));
      for (int l = 0; l < model.num_layers; ++l)
        if (R.shard->holds_layer(l)) {
          R.k_cache[static_cast<std::size_t>(l)] = buffer(r, {1, max_positions, Gl, d});
          R.v_cache[static_cast<std::size_t>(l)] = buffer(r, {1, max_positions, Gl, d});
        }
    }
  }

  // One rank's program for one decoding step, its tasks chained in order.
  struct Chain {
    rt::GraphBuilder& graph;
    devices::CollectiveMatcher& matcher;
    int rank;
    TaskId last = rt::kNoTask;

    void then(TaskId id) {
      if (last != rt::kNoTask && id != rt::kNoTask) graph.precede(last, id);
      if (id != rt::kNoTask) last = id;
    }
    void compute(const std::string& name, std::function<void()> fn) {
      then(graph.add({.device = static_cast<rt::DeviceId>(rank),
                      .stream = rt::kComputeStream,
                      .kind = rt::TaskKind::compute,
                      .name = name},
                     [fn = std::move(fn)](rt::TaskContext&) { fn(); }));
    }
    // The sum over `group` of every member's `values` (nothing for a group of one).
    void all_reduce(const devices::ProcessGroup& group, const Tensor& values,
                    const std::string& name) {
      if (group.size() == 1) return;
      then(matcher.all_reduce(group, group.rank_of(static_cast<rt::DeviceId>(rank)),
                              std::span<float>(values.data(), values.numel()),
                              devices::ReduceOp::sum, {.name = name}));
    }
  };

  void build() {
    rt::GraphBuilder builder;
    devices::CollectiveMatcher matcher(builder, comm);
    for (RankDecode& R : ranks) {
      Chain chain{builder, matcher, R.rank};
      program(R, chain);
    }
    matcher.finish();
    graph = builder.build();
  }

  void program(RankDecode& R, Chain& chain) {
    const Mesh& mesh = step.mesh();
    const devices::ProcessGroup& tensor = mesh.group(GroupKind::tensor, R.rank);
    const int K = layout.chunks(), me = R.at.pp;
    RankDecode* r = &R;
    Impl* self = this;
    auto peer = [&](int pp) { return mesh.rank_of(R.at.tp, R.at.cp, R.at.dp, pp); };
    for (int k = 0; k < K; ++k) {
      if (layout.rank_of(k) != me) continue;
      if (k == 0) {
        chain.compute("embedding", [r, self] {
          ops::embedding_forward<float>(
              r->token_id, r->shard->embedding().value,
              {r->shard->vocab_start(), self->model.padded_vocab_size(self->plan.tensor_parallel)},
              r->emb);
        });
        chain.all_reduce(tensor, R.emb, "embedding_reduce");
        chain.compute("positions", [r, self] {
          r->x.copy_from(r->emb);
          if (self->model.learned_positions()) {
            const float* row = r->shard->positions().value.row(self->position);
            for (std::int64_t c = 0; c < self->h; ++c)
              r->x.data()[c] += row[c];
          }
        });
      } else if (layout.rank_of(k - 1) != me) {
        const rt::DeviceId from = static_cast<rt::DeviceId>(peer(layout.rank_of(k - 1)));
        chain.then(chain.matcher.receive(from, static_cast<rt::DeviceId>(R.rank),
                                         std::span<float>(R.x.data(), R.x.numel()),
                                         {.name = fmt::format("hidden_chunk{}", k - 1)}));
      }
      for (int l = layout.first_layer(k); l < layout.end_layer(k); ++l)
        layer(R, chain, l);
      if (k + 1 < K && layout.rank_of(k + 1) != me) {
        const rt::DeviceId to = static_cast<rt::DeviceId>(peer(layout.rank_of(k + 1)));
        chain.then(chain.matcher.send(static_cast<rt::DeviceId>(R.rank), to,
                                      std::span<const float>(R.x.data(), R.x.numel()),
                                      {.name = fmt::format("hidden_chunk{}", k)}));
      }
    }
    const int last_pp = layout.rank_of(K - 1);
    if (me == last_pp) {
      if (R.at.tp == 0 && R.at.cp == 0 && R.at.dp == 0) last_stage_rank = R.rank;
      chain.compute("final_norm", [r, self] {
        norm_forward(self->model, r->x, r->shard->final_ln_weight(), r->shard->final_ln_bias(),
                     r->final_norm, r->mean, r->rstd);
        ops::linear_forward(r->final_norm, r->shard->output_weight().value, Tensor{},
                            r->logits_local);
      });
      // The vocabulary shards side by side, in tp rank order: the whole padded vocabulary.
      if (tensor.size() > 1)
        chain.then(chain.matcher.all_gather(
            tensor, tensor.rank_of(static_cast<rt::DeviceId>(R.rank)),
            std::span<const float>(R.logits_local.data(), R.logits_local.numel()),
            std::span<float>(R.logits_all.data(), R.logits_all.numel()),
            {.name = "logits_gather"}));
      else
        chain.compute("logits", [r] {
          r->logits_all.copy_from(r->logits_local.reshape({r->logits_all.numel()}));
        });
      chain.compute("sample", [r, self] {
        const std::span<const float> logits(r->logits_all.data(),
                                            static_cast<std::size_t>(self->model.vocab_size));
        r->token[0] = static_cast<float>(sample_token(logits, self->sampling, self->position));
      });
    }
    // The last stage's token to every stage (MindSpore's pipeline inference broadcasts it).
    if (plan.pipeline_parallel > 1) {
      const devices::ProcessGroup& stages = mesh.group(GroupKind::pipeline, R.rank);
      const int root = stages.rank_of(static_cast<rt::DeviceId>(peer(last_pp)));
      chain.then(chain.matcher.broadcast(stages, stages.rank_of(static_cast<rt::DeviceId>(R.rank)),
                                         std::span<float>(R.token), root,
                                         {.name = "token_broadcast"}));
    }
  }

  void layer(RankDecode& R, Chain& chain, int l) {
    const Mesh& mesh = step.mesh();
    const devices::ProcessGroup& tensor = mesh.group(GroupKind::tensor, R.rank);
    RankDecode* r = &R;
    Impl* self = this;
    const std::string at = fmt::format("L{}.", l);
    chain.compute(at + "attention_input", [r, self, l] {
      const ModelConfig& m = self->model;
      const LayerShard& W = r->shard->layer(l);
      norm_forward(m, r->x, *W.attention.ln1_weight, W.attention.ln1_bias, r->norm, r->mean,
                   r->rstd);
      const std::int64_t d = self->d, keys = self->qpg * d, pos = self->position;
      const std::int64_t positions[] = {pos};
      project_qkv(self->specs[static_cast<std::size_t>(l)], m, W.attention, r->norm, r->qkv,
                  positions, r->attention);
      // The incremental part: this position's key and value join the cache, the query attends
      // to every cached position.
      const Tensor& kc = r->k_cache[static_cast<std::size_t>(l)];
      const Tensor& vc = r->v_cache[static_cast<std::size_t>(l)];
      kc.slice(1, pos, 1).copy_from(r->qkv.slice(3, keys, d));
      vc.slice(1, pos, 1).copy_from(r->qkv.slice(3, keys + d, d));
      ops::attention_forward({.q_offset = pos}, r->qkv.slice(3, 0, keys), kc.slice(1, 0, pos + 1),
                             vc.slice(1, 0, pos + 1), r->attn, r->lse);
      ops::linear_forward(r->attn.reshape({1, self->Hl * d}), W.attention.proj_weight->value,
                          Tensor{}, r->proj);
    });
    chain.all_reduce(tensor, R.proj, at + "attention_reduce");
    chain.compute(at + "mlp_input", [r, self, l] {
      const LayerShard& W = r->shard->layer(l);
      if (W.attention.proj_bias)
        ops::accumulate(W.attention.proj_bias->value.reshape({1, self->h}), r->proj);
      ops::accumulate(r->proj, r->x);
      norm_forward(self->model, r->x, *W.ln2_weight, W.ln2_bias, r->norm, r->mean, r->rstd);
    });
    if (specs[static_cast<std::size_t>(l)].moe()) {
      chain.compute(at + "experts", [r, self, l] { self->experts(*r, l); });
      chain.all_reduce(mesh.group(GroupKind::expert, R.rank), R.mlp_out, at + "experts_reduce");
      if (mesh.experts_split()) chain.all_reduce(tensor, R.mlp_out, at + "experts_tp_reduce");
      if (model.has_shared_experts()) {
        // The shared experts: every token's, tensor-parallel as a dense MLP, added to the routed
        // experts' output.
        chain.compute(at + "shared_expert", [r, self, l] {
          dense_mlp_forward(self->model, r->shard->layer(l).moe_mlp().shared, r->norm,
                            r->shared_fc1, r->shared_act, r->shared_out);
        });
        chain.all_reduce(tensor, R.shared_out, at + "shared_expert_reduce");
        chain.compute(at + "shared_expert_add", [r, l] {
          // --moe-shared-expert-gate: the token's sigmoid(w . x) on their output.
          if (const Parameter* gate = r->shard->layer(l).moe_mlp().shared_gate)
            shared_expert_gate_forward(gate->value, r->norm, r->shared_out, Tensor{},
                                       r->shared_gate);
          ops::accumulate(r->shared_out, r->mlp_out);
        });
      }
    } else {
      chain.compute(at + "mlp", [r, self, l] {
        dense_mlp_forward(self->model, r->shard->layer(l).dense_mlp(), r->norm, r->fc1, r->act,
                          r->mlp_out);
      });
      chain.all_reduce(tensor, R.mlp_out, at + "mlp_reduce");
    }
    chain.compute(at + "mlp_residual", [r, self, l] {
      const LayerShard& W = r->shard->layer(l);
      const Parameter* bias = W.moe() ? nullptr : W.dense_mlp().fc2_bias;  // MoE: no bias
      if (bias) ops::accumulate(bias->value.reshape({1, self->h}), r->mlp_out);
      ops::accumulate(r->mlp_out, r->x);
    });
  }

  // The token's top-k experts that this rank holds, weighted: its share of the layer's output.
  void experts(RankDecode& R, int l) {
    const MoeMlpParameters& W = R.shard->layer(l).moe_mlp();
    const int k = model.moe_router_topk, first = R.shard->first_expert(),
              local = R.shard->local_experts();
    route_tokens(model, W.router, R.norm, R.router_logits, R.probs, R.top_index, R.top_weight);
    // The rows of this rank's picked experts, grouped by local expert.
    R.begin.assign(static_cast<std::size_t>(local) + 1, 0);
    std::vector<std::pair<int, float>> picked;  // (local expert, weight)
    for (int j = 0; j < k; ++j) {
      const int e = R.top_index[static_cast<std::size_t>(j)] - first;
      if (e >= 0 && e < local) picked.emplace_back(e, R.top_weight.data()[j]);
    }
    std::sort(picked.begin(), picked.end());
    R.mlp_out.fill(0.f);
    if (picked.empty()) return;
    for (const auto& [e, w] : picked)
      ++R.begin[static_cast<std::size_t>(e) + 1];
    std::partial_sum(R.begin.begin(), R.begin.end(), R.begin.begin());
    const std::int64_t n = static_cast<std::int64_t>(picked.size());
    for (std::int64_t i = 0; i < n; ++i)
      R.rows_in.slice(0, i, 1).copy_from(R.norm);
    ops::experts_forward(expert_activation(model), R.rows_in.slice(0, 0, n), R.begin,
                         W.experts.fc1->value, W.experts.fc2->value, R.rows_pre.slice(0, 0, n),
                         R.rows_hidden.slice(0, 0, n), R.rows_out.slice(0, 0, n));
    for (std::int64_t i = 0; i < n; ++i) {
      const float w = picked[static_cast<std::size_t>(i)].second;
      const float* row = R.rows_out.row(i);
      for (std::int64_t c = 0; c < h; ++c)
        R.mlp_out.data()[c] += w * row[c];
    }
  }

  // One step at the next position; the last stage's logits are left in logits_all.
  void run(std::int32_t token) {
    if (position >= max_positions)
      throw std::invalid_argument(fmt::format(
          "generation reached the model's {} positions (--max-position-embeddings): shorten the "
          "prompt or --max-new-tokens",
          max_positions));
    if (token < 0 || token >= model.vocab_size)
      throw std::invalid_argument(
          fmt::format("token {} is outside the model's vocabulary of {}", token, model.vocab_size));
    for (RankDecode& R : ranks)
      R.token_id[0] = token;
    devices.executor().run(graph);
    ++position;
  }
};

Generator::Generator(const ModelConfig& model, const ParallelPlan& plan, TrainingStep& step,
                     devices::DeviceSet& devices, devices::Communicator& comm)
    : impl_(std::make_unique<Impl>(model, plan, step, devices, comm)) {}

Generator::~Generator() = default;

int Generator::max_length() const {
  return static_cast<int>(impl_->max_positions);
}

void Generator::reset() {
  impl_->position = 0;
}

std::vector<float> Generator::feed(std::int32_t token) {
  impl_->run(token);
  return impl_->ranks[static_cast<std::size_t>(impl_->last_stage_rank)].logits_all.to_vector();
}

std::vector<std::int32_t> Generator::generate(std::span<const std::int32_t> prompt,
                                              const SamplingOptions& options,
                                              const std::function<bool(std::int32_t)>& on_token) {
  if (prompt.empty())
    throw std::invalid_argument("generation needs a prompt of at least one token");
  if (options.max_new_tokens < 0 || options.top_k < 0 || !(options.temperature >= 0))
    throw std::invalid_argument(fmt::format(
        "sampling options must be >= 0: --max-new-tokens {}, --top-k {}, --temperature {}",
        options.max_new_tokens, options.top_k, options.temperature));
  const std::int64_t length = static_cast<std::int64_t>(prompt.size()) + options.max_new_tokens;
  if (length > max_length())
    throw std::invalid_argument(fmt::format(
        "a prompt of {} tokens and --max-new-tokens {} need {} positions; the model has {} "
        "(--max-position-embeddings): shorten the prompt or lower --max-new-tokens",
        prompt.size(), options.max_new_tokens, length, max_length()));
  reset();
  impl_->sampling = options;
  std::vector<std::int32_t> out;
  for (std::size_t i = 0; i + 1 < prompt.size(); ++i)
    impl_->run(prompt[i]);
  std::int32_t next = prompt.back();
  for (int i = 0; i < options.max_new_tokens; ++i) {
    impl_->run(next);
    // Every stage now holds the sampled token (broadcast from the last stage); read the first's.
    next = static_cast<std::int32_t>(impl_->ranks.front().token[0]);
    out.push_back(next);
    if (on_token && !on_token(next)) break;
  }
  return out;
}

}  // namespace weave::graphs
