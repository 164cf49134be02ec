#include "step/optimizer_program.hpp"

#include <cmath>
#include <numeric>

#include "step/comm_streams.hpp"
#include "step/step_costs.hpp"
#include "weave/ops/optimizer.hpp"

namespace weave::graphs {

namespace {

// The squared norm of the gradient elements this rank owns: each distinct element once, tensor-
// parallel copies on tp rank 0 only, data-parallel copies on the replica that owns the element
// (its shard, or replica 0).
double owned_gradient_squared_norm(RankProgram& p) {
  const bool tp_first = p.at.tp == 0;
  ModelShard& shard = p.shard();
  // The output layer's copy of the word embedding counts on the first stage only.
  const Parameter* copy = shard.holds_embedding_copy() ? &shard.embedding() : nullptr;
  double sum = 0;
  for (const GradientBucket& bucket : shard.buckets()) {
    if (!bucket.sharded && bucket.replica != 0) continue;
    const std::int64_t lo = bucket.shard_begin, hi = lo + bucket.shard_size;
    // The shard's gradients: element e of the bucket at g[e - lo].
    const float* g = bucket.shard_grads().data();
    std::int64_t at = 0;
    for (const Parameter* q : bucket.params) {
      const std::int64_t n = q->grad.numel();
      const std::int64_t from = std::max(at, lo), to = std::min(at + n, hi);
      if (from < to && q != copy && (!q->tensor_replicated || tp_first)) {
        for (std::int64_t e = from; e < to; ++e)
          sum += static_cast<double>(g[e - lo]) * g[e - lo];
      }
      at += n;
    }
  }
  return sum;
}

// With a loss scaler: multiplies the gradient elements this rank updates (its shard of each
// bucket, or the whole bucket) by the inverse scale, as Megatron-LM's
// _unscale_main_grads_and_check_for_nan does, and sets found_inf when one of them is not finite.
// Under ZeRO stage 2 a layer's shard is its own tensor (GradientBucket::grad_shard, the step's
// reduce-scatters summed), not a slice of the layer's gradient slot, which the next layer's
// gradients have overwritten: the unscaling reads the shard wherever it is kept.
void unscale_and_check(RankProgram& p) {
  const float inverse = static_cast<float>(1.0 / static_cast<double>(p.inputs.loss_scale));
  bool found = false;
  for (GradientBucket& bucket : p.shard().buckets()) {
    const Tensor shard = bucket.shard_grads();
    float* g = shard.data();
    for (std::int64_t i = 0; i < shard.numel(); ++i) {
      g[i] *= inverse;
      found |= !std::isfinite(g[i]);
    }
  }
  p.state.found_inf.data()[0] = found ? 1.f : 0.f;
}

// Clips the gradients by the summed norm and runs AdamW on the elements this rank updates: its
// shard of each bucket, or the whole bucket. A step whose gradients were not finite on some rank
// changes nothing (Megatron-LM's optimizer returns before clipping).
void clip_and_update(RankProgram& p) {
  if (!p.inputs.update) return;
  if (p.opt.loss_scaling && p.state.found_inf.data()[0] != 0.f) return;
  const double norm = std::sqrt(static_cast<double>(p.state.norm_sq.data()[0]));
  const double clip = p.opt.clip_grad;
  const double coef = clip > 0 ? ops::clip_coefficient(norm, clip) : 1.0;
  ops::AdamWOptions o = p.opt.adamw;
  o.lr = p.inputs.learning_rate;
  for (GradientBucket& bucket : p.shard().buckets()) {
    const Tensor grads = bucket.shard_grads();
    if (coef < 1.0) {
      float* g = grads.data();
      for (std::int64_t i = 0; i < grads.numel(); ++i)
        g[i] *= static_cast<float>(coef);
    }
    ops::adamw_step(o, p.inputs.optimizer_step > 0 ? p.inputs.optimizer_step : p.inputs.iteration,
                    bucket.shard_values(), grads, bucket.exp_avg, bucket.exp_avg_sq);
    // A 16-bit run's sharded bucket: the updated shard's 16-bit copy, which the gathers send
    // (Megatron-LM's distributed optimizer: _copy_main_params_to_model_params, then the
    // parameters' all-gather), after this update or before the next step's layers (stage 3).
    if (p.half()) bucket.round_shard_to_half(p.precision());
  }
}

// The bytes the optimizer step streams for each element it updates. AdamW reads value, gradient
// and two moments and writes three, in fp32 whatever the training precision (28 bytes). A 16-bit
// run keeps fp32 main parameters beside its 16-bit ones, as Megatron-LM's
// Float16OptimizerWithFloat16Params does: after the update _copy_main_params_to_model_params
// reads each fp32 value and writes its 16-bit copy (6 bytes); the gradients of either 16-bit
// format are accumulated in fp32 already (ParameterBytes), which .float() leaves uncopied. A
// loss scaler's
// unscaling with its check for inf (_unscale_main_grads_and_check_for_nan) is a task of its own
// (kUnscaleBytesPerElement).
double optimizer_bytes_per_element(Precision precision) {
  const double adam = 7 * 4;
  switch (precision) {
    case Precision::bf16:
    case Precision::fp16:
      return adam + (4 + 2);
    case Precision::fp32:
      break;
  }
  return adam;
}

// A loss scaler's unscaling reads and writes each fp32 main gradient the rank updates.
constexpr double kUnscaleBytesPerElement = 4 + 4;

// With a loss scaler: the unscaling and check of the rank's gradients, after everything its
// communication streams carry is in, then found_inf's maximum over every rank (Megatron-LM
// all-reduces it over the model-parallel group and the data-parallel one; every rank's here).
// Returns the last of them: the norm and the update wait for it.
TaskId add_unscale_and_check(RankProgram& P, const rt::TaskTags& tags, double updated) {
  RankProgram* p = &P;
  const TaskId unscale = P.compute("unscale_and_check_inf", tags,
                                   cost::streamed_bytes(updated, kUnscaleBytesPerElement),
                                   [p] { unscale_and_check(*p); });
  for (const auto& [stream, tail] : P.comm_tails())
    P.after(tail, unscale);
  if (P.mesh.size() <= 1) return unscale;
  std::vector<rt::DeviceId> all(static_cast<std::size_t>(P.mesh.size()));
  std::iota(all.begin(), all.end(), 0u);
  const TaskId reduced = P.matcher.all_reduce(devices::ProcessGroup("world", all), P.rank,
                                              all_of(P.state.found_inf), devices::ReduceOp::max,
                                              {.name = "found_inf_max",
                                               .tags = tags,
                                               .stream = "world",
                                               .stream_kind = stream_kind(CommGroup::world)});
  P.after(unscale, reduced);
  return reduced;
}

// The rank's part of the norm, after everything its communication streams carry is in (and the
// unscaling, `ready`); then its sum over every rank (kNoTask on one device).
TaskId add_gradient_norm(RankProgram& P, const rt::TaskTags& tags, double gradients, TaskId ready) {
  RankProgram* p = &P;
  // Every gradient read once, in the precision it is kept in.
  const rt::CostHint read_gradients =
      cost::streamed_bytes(gradients, parameter_bytes(P.shape.model.precision).gradient);
  const TaskId norm = P.compute("grad_norm", tags, read_gradients, [p] {
    p->state.norm_sq.data()[0] = static_cast<float>(owned_gradient_squared_norm(*p));
  });
  for (const auto& [stream, tail] : P.comm_tails())
    P.after(tail, norm);
  P.after(ready, norm);
  if (P.mesh.size() <= 1) return rt::kNoTask;
  std::vector<rt::DeviceId> all(static_cast<std::size_t>(P.mesh.size()));
  std::iota(all.begin(), all.end(), 0u);
  const TaskId summed = P.matcher.all_reduce(devices::ProcessGroup("world", all), P.rank,
                                             all_of(P.state.norm_sq), devices::ReduceOp::sum,
                                             {.name = "grad_norm_sum",
                                              .tags = tags,
                                              .stream = "world",
                                              .stream_kind = stream_kind(CommGroup::world)});
  P.after(norm, summed);
  return summed;
}

// Distributed optimizer: bucket's shard on each replica gathered whole, over `data` (dense
// buckets) or `expert_data` (the experts'), after `ready`; kNoTask for a bucket not sharded.
TaskId gather_shard(GradientBucket& bucket, const GroupHandle& data, const GroupHandle& expert_data,
                    TaskId ready, const rt::TaskTags& tags) {
  // Stage 3 gathers a layer's values before each use instead (step/parameter_slots.hpp).
  if (!bucket.sharded || bucket.values_staged) return rt::kNoTask;
  const GroupHandle& replicas = bucket.expert ? expert_data : data;
  // A materialized 16-bit run's main values are shards (GradientBucket::main_values_sharded):
  // the gathers move the 16-bit copies, the updated shard's rounded by the optimizer, in place;
  // predicted, the shard's shape at the group's 2 bytes an element: the same bytes.
  if (bucket.main_values_sharded)
    return replicas.all_gather_halves(
        ready, bucket.values16.slice(0, bucket.shard_begin, bucket.shard_size), bucket.values16,
        bucket.name + ".gather", tags);
  return replicas.all_gather(ready, part_of(bucket.values, bucket.shard_begin, bucket.shard_size),
                             all_of(bucket.values), bucket.name + ".gather", tags);
}

// Distributed optimizer: each replica updated its shard; gather the whole values back.
void gather_updated_shards(RankProgram& P, TaskId step, const rt::TaskTags& tags) {
  for (GradientBucket& bucket : P.shard().buckets())
    gather_shard(bucket, P.data, P.expert_data, step, tags);
}

// The point a bucket is named after: "layers.3.attention" of "layers.3.attention/dense".
std::string point_of(const GradientBucket& bucket) {
  return bucket.name.substr(0, bucket.name.find('/'));
}

}  // namespace

void build_optimizer(RankProgram& P) {
  RankProgram* p = &P;
  const rt::TaskTags tags{.phase = rt::Phase::weight};
  double gradients = 0, updated = 0;
  for (const GradientBucket& b : P.shard().buckets()) {
    gradients += static_cast<double>(b.grads.numel());
    updated += static_cast<double>(b.shard_size);
  }
  const TaskId checked = P.opt.loss_scaling ? add_unscale_and_check(P, tags, updated) : rt::kNoTask;
  const TaskId summed = add_gradient_norm(P, tags, gradients, checked);
  // AdamW reads value, gradient and two moments and writes three, in fp32 whatever the training
  // precision (a 16-bit run updates its fp32 master weights).
  const TaskId step =
      P.compute("optimizer", tags,
                cost::streamed_bytes(updated, optimizer_bytes_per_element(P.shape.model.precision)),
                [p] { clip_and_update(*p); });
  P.after(summed, step);
  P.after(checked, step);
  if (!P.shape.plan.distributed_optimizer) return;
  if (!P.shape.plan.overlap_param_gather) {
    gather_updated_shards(P, step, tags);
    return;
  }
  // The step's gathers write the whole values, the rank's shard included: the update comes after.
  for (const auto& [point, gathers] : P.parameter_gathers)
    for (const TaskId gather : gathers)
      P.after(gather, step);
}

void start_parameter_gathers(RankProgram& P) {
  if (!P.shape.plan.distributed_optimizer || !P.shape.plan.overlap_param_gather) return;
  // The buckets are kept in backward order; the forward reads them the other way round. One
  // group's stream runs its collectives in issue order, so the first layers' gathers end first.
  std::vector<GradientBucket>& buckets = P.shard().buckets();
  for (auto b = buckets.rbegin(); b != buckets.rend(); ++b) {
    const TaskId gather =
        gather_shard(*b, P.data, P.expert_data, rt::kNoTask, {.phase = rt::Phase::forward});
    if (gather != rt::kNoTask) P.parameter_gathers[point_of(*b)].push_back(gather);
  }
}

void add_parameter_gathers(RankProgram& P, devices::CollectiveMatcher& matcher,
                           rt::GraphBuilder& graph) {
  std::map<std::string, TaskId> tails;
  const auto handle = [&](GroupKind kind, const char* stream, CommGroup stream_group) {
    const devices::ProcessGroup& group = P.mesh.group(kind, P.rank);
    return GroupHandle(matcher, graph, group, group.rank_of(static_cast<rt::DeviceId>(P.rank)),
                       stream, stream_group, &tails,
                       static_cast<std::size_t>(P.shape.model.activation_bytes()));
  };
  const GroupHandle data = handle(GroupKind::data_context, "dp_cp", CommGroup::data_context);
  const GroupHandle expert_data = handle(GroupKind::expert_data, "edp", CommGroup::expert_data);
  std::vector<GradientBucket>& buckets = P.shard().buckets();
  for (auto b = buckets.rbegin(); b != buckets.rend(); ++b)
    gather_shard(*b, data, expert_data, rt::kNoTask, {.phase = rt::Phase::weight});
}

}  // namespace weave::graphs
