// The training step: its builder's construction (sizes, rules, per-device buffers), the
// graph's outline and the public interface.
#include "training_step_impl.hpp"

#include <set>

namespace weave::graphs {

TrainingStep::Impl::Impl(const ModelConfig& model, const ParallelPlan& p, const OptimizerConfig& o,
                         devices::DeviceSet& set, devices::Communicator& c)
    : m(model), plan(p), opt(o), devices(set), comm(c), mesh(p) {
  if (static_cast<int>(set.size()) != plan.devices())
    throw ConfigError(
        fmt::format("the plan needs {} devices (tp {} x cp {} x dp {} x pp {}), "
                    "the device set has {}",
                    plan.devices(), plan.tensor_parallel, plan.context_parallel, plan.data_parallel,
                    plan.pipeline_parallel, set.size()));
  layout = make_pipeline_layout(m, plan);
  tp = plan.tensor_parallel;
  t_sp = plan.sequence_parallel ? tp : 1;
  M = plan.micro_batches();
  cp = plan.context_parallel;
  S = m.seq_length;
  Sc = S / cp;
  chunk = cp > 1 ? Sc / 2 : Sc;
  B = plan.micro_batch_size;
  Sl = Sc / t_sp;
  h = m.hidden_size;
  d = m.head_dim();
  Hl = m.num_attention_heads / tp;
  f = m.ffn_hidden_size;
  fl = f / tp;
  f1l = m.activation == Activation::swiglu ? 2 * fl : fl;
  Vl = m.padded_vocab_size(tp) / tp;
  T = Sc / tp * B;
  if (m.num_experts > 0 && tp > 1 && Sc % tp != 0)
    throw ConfigError(fmt::format(
        "--seq-length ({}) must be divisible by --tensor-model-parallel-size x "
        "--context-parallel-size ({}) in a MoE model: each tensor-parallel rank routes its "
        "share of the positions",
        S, tp * cp));
  batches.assign(static_cast<std::size_t>(plan.data_parallel), std::vector<MicroBatch>(M));
  for (auto& per_dp : batches)
    for (auto& mb : per_dp) {
      mb.tokens.assign(static_cast<std::size_t>(S * B), 0);
      mb.targets.assign(static_cast<std::size_t>(S * B), 0);
    }
  assign_sets();
  ranks.resize(static_cast<std::size_t>(mesh.size()));
  last_comm.assign(ranks.size(), rt::kNoTask);
  last_grad.assign(ranks.size(), rt::kNoTask);
  for (int r = 0; r < mesh.size(); ++r)
    allocate(r);
  build();
}

void TrainingStep::Impl::assign_sets() {
  const PipelineSchedule& schedule = layout.schedule;
  const int K = layout.chunks();
  for (int k = 0; k < K; ++k)
    for (int l = layout.first_layer(k); l < layout.end_layer(k); ++l)
      chunk_of_layer.push_back(k);
  // Chunks with the same layers, position by position, can share sets.
  auto same_layers = [&](int a, int b) {
    if (layout.end_layer(a) - layout.first_layer(a) != layout.end_layer(b) - layout.first_layer(b))
      return false;
    for (int i = 0; i < layout.end_layer(a) - layout.first_layer(a); ++i)
      if (m.is_moe_layer(layout.first_layer(a) + i) != m.is_moe_layer(layout.first_layer(b) + i))
        return false;
    return true;
  };
  for (const auto& list : schedule.actions)
    for (const Action& a : list)
      splits_backward_ = splits_backward_ || a.type == ActionType::BackwardInput;
  set_chunks.assign(static_cast<std::size_t>(schedule.ranks), {});
  output_sets.assign(static_cast<std::size_t>(schedule.ranks), 0);
  for (int pp = 0; pp < schedule.ranks; ++pp) {
    std::vector<int> held;
    for (int k = 0; k < K; ++k)
      if (layout.rank_of(k) == pp) held.push_back(k);
    bool shared = true;
    for (int k : held)
      shared = shared && same_layers(held.front(), k);
    // A set frees up after the micro-batch's last backward action on the chunk: its W when the
    // backward is split (the weight gradients read the activations), its B otherwise.
    std::map<int, std::set<int>> free;  // by pool (one, or one per chunk): free sets, lowest first
    std::set<int> free_outputs;
    for (const Action& a : schedule.actions[static_cast<std::size_t>(pp)]) {
      if (a.type == ActionType::Idle) continue;
      const int k = schedule.stage(pp, a.chunk);
      const auto key = std::make_tuple(pp, k, a.micro_batch);
      std::set<int>& pool = free[shared ? 0 : k];
      if (a.type == ActionType::Forward) {
        if (pool.empty()) {
          pool.insert(static_cast<int>(set_chunks[pp].size()));
          set_chunks[pp].push_back(k);
        }
        set_index[key] = *pool.begin();
        pool.erase(pool.begin());
        if (k == K - 1) {
          if (free_outputs.empty()) free_outputs.insert(output_sets[pp]++);
          output_index[a.micro_batch] = *free_outputs.begin();
          free_outputs.erase(free_outputs.begin());
        }
      } else if (a.type == ActionType::Backward || a.type == ActionType::BackwardWeight) {
        pool.insert(set_index.at(key));
        if (k == K - 1) free_outputs.insert(output_index.at(a.micro_batch));
      }
    }
  }
}

void TrainingStep::Impl::allocate(int r) {
  RankState& R = ranks[r];
  const int pp = mesh.coordinates(r).pp;
  const StageContents contents = layout.contents(pp);
  R.shard = std::make_unique<ModelShard>(m, mesh, r, dev(r), contents);
  const bool sp = t_sp > 1;
  R.sets.resize(set_chunks[pp].size());
  for (std::size_t i = 0; i < R.sets.size(); ++i)
    allocate_set(r, R.sets[i], set_chunks[pp][i]);
  R.outputs.resize(static_cast<std::size_t>(output_sets[pp]));
  for (OutputSet& O : R.outputs)
    allocate_output(r, O);
  R.norm_sq = act(r, {1});
  R.loss.assign(static_cast<std::size_t>(M), 0.0);
  R.aux.assign(static_cast<std::size_t>(M), 0.0);
  BackwardWorkspace& W = R.ws;
  W.d_x = act(r, {Sl, B, h});
  W.d_x_mid = act(r, {Sl, B, h});
  W.d_tmp = act(r, {Sl, B, h});
  W.d_mlp = act(r, {Sl, B, h});
  W.d_mlp_full = sp ? act(r, {Sc, B, h}) : W.d_mlp;
  W.d_act = act(r, {Sc, B, fl});
  W.d_fc1 = act(r, {Sc, B, f1l});
  W.d_norm_full = act(r, {Sc, B, h});
  W.d_norm = sp ? act(r, {Sl, B, h}) : W.d_norm_full;
  W.d_attn = act(r, {Sc, B, Hl * d});
  W.d_qkv = act(r, {Sc, B, Hl, 3 * d});
  if (cp > 1) {
    for (int i = 0; i < 2; ++i) {
      W.ring[i] = act(r, {Sc, B, Hl, 2 * d});
      W.dring[i] = act(r, {Sc, B, Hl, 2 * d});
    }
    if (ampipe() > 1) {
      W.dkv_send = act(r, {cp * Sc, B, Hl, 2 * d});
      W.dkv_recv = act(r, {cp * Sc, B, Hl, 2 * d});
    }
    W.o_part = act(r, {chunk, B, Hl, d});
    W.dq_part = act(r, {chunk, B, Hl, d});
    W.lse_part = act(r, {B, Hl, chunk});
    const int me = mesh.coordinates(r).cp;
    W.ring_send.assign(static_cast<std::size_t>(cp), 0);
    W.ring_send[(me + 1) % cp] = Sc;
    W.ring_recv.assign(static_cast<std::size_t>(cp), 0);
  }
  if (contents.output_layer) {
    W.d_logits = act(r, {Sc * B, Vl});
    W.d_final_full = act(r, {Sc, B, h});
  }
}

void TrainingStep::Impl::allocate_set(int r, ActivationSet& X, int k) {
  const bool sp = t_sp > 1;
  const StageContents& holds = ranks[r].shard->contents();
  // Sets shared by chunks serve every one of them: the first chunk's embedding, a later
  // chunk's transfers.
  X.x_in = act(r, {Sl, B, h});
  if (holds.input_embedding) X.emb_partial = sp ? act(r, {Sc, B, h}) : X.x_in;
  if (layout.chunks() > 1) {
    X.d_send = act(r, {Sl, B, h});
    X.d_recv = act(r, {Sl, B, h});
  }
  Tensor x = X.x_in;
  X.layers.resize(static_cast<std::size_t>(layout.end_layer(k) - layout.first_layer(k)));
  for (int l = layout.first_layer(k); l < layout.end_layer(k); ++l) {
    LayerActivations& A = X.layers[static_cast<std::size_t>(l - layout.first_layer(k))];
    A.x_in = x;
    A.ln1 = act(r, {Sl, B, h});
    A.ln1_mean = act(r, {Sl * B});
    A.ln1_rstd = act(r, {Sl * B});
    A.ln1_full = sp ? act(r, {Sc, B, h}) : A.ln1;
    A.qkv = act(r, {Sc, B, Hl, 3 * d});
    A.attn = act(r, {Sc, B, Hl, d});
    // Ampipe: one [B, Hl, q] block per (chunk, piece).
    A.lse = ampipe() > 1 && ranks[r].shard->layer(l).moe
                ? act(r, {ampipe() * t_sp, B, Hl, piece_rows()})
                : act(r, {cp > 1 ? 2 : 1, B, Hl, chunk});
    A.proj_partial = act(r, {Sc, B, h});
    if (cp > 1 && ampipe() > 1 && ranks[r].shard->layer(l).moe) {
      A.kv_store = act(r, {cp * Sc, B, Hl, 2 * d});
      A.kv_local = A.kv_store.slice(0, mesh.coordinates(r).cp * Sc, Sc);
    } else if (cp > 1) {
      A.kv_local = act(r, {Sc, B, Hl, 2 * d});
    }
    A.proj_out = sp ? act(r, {Sl, B, h}) : A.proj_partial;
    A.x_mid = act(r, {Sl, B, h});
    A.ln2 = act(r, {Sl, B, h});
    A.ln2_mean = act(r, {Sl * B});
    A.ln2_rstd = act(r, {Sl * B});
    if (ranks[r].shard->layer(l).moe) {
      const std::int64_t E = m.num_experts;
      A.stats_total = act(r, {2 * E + 2});
      A.mlp_out = sp || tp == 1 ? act(r, {Sl, B, h}) : act(r, {Sc, B, h});
      const int slots = ampipe();
      A.moe.resize(static_cast<std::size_t>(slots));
      for (int c = 0; c < slots; ++c)
        allocate_slot(r, A, c);
    } else {
      A.ln2_full = sp ? act(r, {Sc, B, h}) : A.ln2;
      A.fc1 = act(r, {Sc, B, f1l});
      A.act = act(r, {Sc, B, fl});
      A.fc2_partial = act(r, {Sc, B, h});
      A.mlp_out = sp ? act(r, {Sl, B, h}) : A.fc2_partial;
    }
    A.x_out = act(r, {Sl, B, h});
    x = A.x_out;
    if (splits_backward_) {
      A.saved_d_proj = act(r, {Sc, B, h});
      A.saved_d_qkv = act(r, {Sc, B, Hl * 3 * d});
      if (!ranks[r].shard->layer(l).moe) {
        A.saved_d_fc2 = act(r, {Sc, B, h});
        A.saved_d_fc1 = act(r, {Sc, B, f1l});
      }
    }
  }
}

void TrainingStep::Impl::allocate_output(int r, OutputSet& O) {
  O.final_ln = act(r, {Sl, B, h});
  O.final_mean = act(r, {Sl * B});
  O.final_rstd = act(r, {Sl * B});
  O.final_full = t_sp > 1 ? act(r, {Sc, B, h}) : O.final_ln;
  O.logits = act(r, {Sc * B, Vl});
  O.row_max = act(r, {Sc * B});
  O.partials = act(r, {Sc * B, ops::kCrossEntropyPartials});
  O.lse = act(r, {Sc * B});
  if (splits_backward_) O.saved_d_logits = act(r, {Sc * B, Vl});
}

void TrainingStep::Impl::weight_grad(const std::string& name, rt::TaskTags tags,
                                     std::function<void(int)> fn) {
  if (!split_) {
    each(name, tags, std::move(fn));
    return;
  }
  tags.phase = rt::Phase::weight;
  weight_work.push_back([this, name, tags, fn = std::move(fn)] { return each(name, tags, fn); });
}

std::vector<TaskId> TrainingStep::Impl::each(const std::string& name, rt::TaskTags tags,
                                             std::function<void(int)> fn) {
  if (tags.virtual_stage < 0 && layout.chunks() > 1) tags.virtual_stage = chunk_;
  auto shared = std::make_shared<std::function<void(int)>>(std::move(fn));
  std::vector<TaskId> ids;
  for (int r = 0; r < mesh.size(); ++r) {
    if (!in_stage(r)) {
      ids.push_back(rt::kNoTask);
      continue;
    }
    ids.push_back(b.add({.device = static_cast<rt::DeviceId>(r),
                         .stream = compute_stream,
                         .kind = rt::TaskKind::compute,
                         .name = name,
                         .tags = tags,
                         .cost = {.flops = flops_of(name)}},
                        [shared, r](rt::TaskContext&) { (*shared)(r); }));
  }
  return ids;
}

void TrainingStep::Impl::build() {
  const rt::TaskTags tags{};
  each("zero_grads", tags, [this](int r) {
    ranks[r].shard->zero_grads();
    std::fill(ranks[r].loss.begin(), ranks[r].loss.end(), 0.0);
    std::fill(ranks[r].aux.begin(), ranks[r].aux.end(), 0.0);
    ranks[r].routed_picks = ranks[r].dropped_picks = 0;
  });
  build_pipeline();
  build_optimizer();
  graph = b.build();
}

StepResult TrainingStep::Impl::result() const {
  StepResult out;
  for (int r = 0; r < mesh.size(); ++r) {
    out.routed_picks += ranks[r].routed_picks;
    out.dropped_picks += ranks[r].dropped_picks;
    const MeshCoordinates at = mesh.coordinates(r);
    if (at.tp != 0) continue;  // tensor-parallel ranks hold the same losses
    for (int mb = 0; mb < M; ++mb) {
      out.loss += ranks[r].loss[mb];  // context-parallel ranks hold different tokens' losses
      // The MoE losses are statistics of whole micro-batches, the same on every cp rank.
      if (at.cp == 0) out.aux_loss += ranks[r].aux[mb] / (M * plan.data_parallel);
    }
  }
  out.grad_norm = std::sqrt(static_cast<double>(ranks[0].norm_sq.data()[0]));
  return out;
}

TrainingStep::TrainingStep(const ModelConfig& model, const ParallelPlan& plan,
                           const OptimizerConfig& optimizer, devices::DeviceSet& devices,
                           devices::Communicator& comm)
    : impl_(std::make_unique<Impl>(model, plan, optimizer, devices, comm)) {}
TrainingStep::~TrainingStep() = default;
const rt::Graph& TrainingStep::graph() const {
  return impl_->graph;
}
const Mesh& TrainingStep::mesh() const {
  return impl_->mesh;
}
MicroBatch& TrainingStep::micro_batch(int dp, int m) {
  return impl_->batches.at(static_cast<std::size_t>(dp)).at(static_cast<std::size_t>(m));
}
void TrainingStep::prepare(std::int64_t iteration, double learning_rate) {
  if (iteration < 1) throw std::invalid_argument("iterations count from 1");
  impl_->iteration = iteration;
  impl_->learning_rate = learning_rate;
}
StepResult TrainingStep::result() const {
  return impl_->result();
}
ModelShard& TrainingStep::shard(int rank) {
  return *impl_->ranks.at(static_cast<std::size_t>(rank)).shard;
}
int TrainingStep::activation_sets(int rank) const {
  return static_cast<int>(impl_->ranks.at(static_cast<std::size_t>(rank)).sets.size());
}
void TrainingStep::set_update_parameters(bool update) {
  impl_->update = update;
}

}  // namespace weave::graphs
