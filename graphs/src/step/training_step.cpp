// The training step: the union of its ranks' programs, and the public interface.
#include "weave/graphs/training_step.hpp"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>

#include "step/memory_recording.hpp"
#include "step/optimizer_program.hpp"
#include "step/rank_program.hpp"

namespace weave::graphs {

struct TrainingStep::Impl {
  Impl(const ModelConfig& model, const ParallelPlan& plan, const OptimizerConfig& o,
       devices::DeviceSet& set, devices::Communicator& comm, const StepBuildOptions& options);

  StepResult result() const;
  RankProgram& program(int rank) const;

  OptimizerConfig opt;
  Mesh mesh;
  PipelineLayout layout;
  StepShape shape;
  ActivationSetPlan set_plan;
  StepInputs inputs;
  rt::GraphBuilder builder;
  devices::CollectiveMatcher matcher;
  std::vector<std::unique_ptr<RankProgram>> programs;  // by rank; null where not built here
  rt::Graph graph;
  // --overlap-param-gather: the step's parameter gathers alone (TrainingStep's
  // parameter_gather_graph); empty otherwise.
  rt::GraphBuilder gather_builder;
  std::unique_ptr<devices::CollectiveMatcher> gather_matcher;
  rt::Graph gather_graph;
  std::vector<MemoryEvent> memory_events;  // StepBuildOptions::record_memory
  bool materialize = true;
  devices::ProcessSet& processes;
};

namespace {

void check_devices(const ParallelPlan& plan, const devices::DeviceSet& set) {
  if (static_cast<int>(set.size()) != plan.devices())
    throw ConfigError(
        fmt::format("the plan needs {} devices (tp {} x cp {} x dp {} x pp {}), "
                    "the device set has {}",
                    plan.devices(), plan.tensor_parallel, plan.context_parallel, plan.data_parallel,
                    plan.pipeline_parallel, set.size()));
}

}  // namespace

TrainingStep::Impl::Impl(const ModelConfig& model, const ParallelPlan& plan,
                         const OptimizerConfig& o, devices::DeviceSet& set,
                         devices::Communicator& comm, const StepBuildOptions& options)
    : opt(o),
      mesh((check_devices(plan, set), plan)),
      layout(make_pipeline_layout(model, plan)),
      shape(model, plan),
      set_plan(plan_activation_sets(model, layout)),
      matcher(builder, comm),
      materialize(options.materialize),
      processes(comm.processes()) {
  shape.splits_backward = set_plan.splits_backward;
  // The tracker's observer and the thread's recording point into this step: cleared however the
  // build ends.
  MemoryRecording labels;
  std::vector<std::pair<int, int>> event_sets;  // per event: (rank, activation set) or (-1, -1)
  struct Recording {
    rt::MemoryTracker* tracker = nullptr;
    ~Recording() {
      if (!tracker) return;
      tracker->set_observer({});
      active_memory_recording() = nullptr;
    }
  } recording;
  if (options.record_memory) {
    recording.tracker = &set.memory();
    active_memory_recording() = &labels;
    set.memory().set_observer(
        [this, &labels, &event_sets](rt::DeviceId d, rt::MemoryCategory c, std::int64_t bytes) {
          memory_events.push_back(
              {.device = d, .category = c, .bytes = bytes, .tasks_built = builder.size()});
          event_sets.emplace_back(labels.set >= 0 ? labels.rank : -1, labels.set);
        });
  }
  if (o.loss_scaling && model.precision == Precision::fp32)
    throw ConfigError(
        "a loss scaler (OptimizerConfig::loss_scaling) is for 16-bit runs: give --fp16 or --bf16, "
        "or drop --loss-scale");
  inputs.batches.assign(static_cast<std::size_t>(plan.data_parallel),
                        std::vector<MicroBatch>(static_cast<std::size_t>(shape.M)));
  // A step built without tensors reads no tokens: with thousands of micro-batches of long
  // sequences their buffers would be most of what a prediction holds.
  if (materialize)
    for (auto& per_dp : inputs.batches)
      for (auto& mb : per_dp) {
        mb.tokens.assign(static_cast<std::size_t>(shape.S * shape.B), 0);
        mb.targets.assign(static_cast<std::size_t>(shape.S * shape.B), 0);
      }
  std::vector<int> ranks = options.ranks;
  if (ranks.empty())
    for (int r = 0; r < mesh.size(); ++r)
      ranks.push_back(r);
  programs.resize(static_cast<std::size_t>(mesh.size()));
  for (int r : ranks) {
    if (r < 0 || r >= mesh.size())
      throw std::invalid_argument(fmt::format(
          "StepBuildOptions::ranks names rank {}, outside the mesh of {} ranks", r, mesh.size()));
    if (programs[static_cast<std::size_t>(r)])
      throw std::invalid_argument(
          fmt::format("StepBuildOptions::ranks names rank {} twice; list each rank once", r));
    programs[static_cast<std::size_t>(r)] = std::make_unique<RankProgram>(
        shape, mesh, layout, set_plan, inputs, opt, r, set[static_cast<rt::DeviceId>(r)], builder,
        matcher, options.materialize);
  }
  for (int r : ranks)
    programs[static_cast<std::size_t>(r)]->build();
  // Every collective has met all its members here when this process built every rank, or
  // exactly the ranks a multi-process backend holds here (it reaches the others).
  bool complete = true;
  for (int r = 0; r < mesh.size(); ++r)
    complete &= (programs[static_cast<std::size_t>(r)] != nullptr) ==
                comm.holds(static_cast<rt::DeviceId>(r));
  if (complete) matcher.finish();
  graph = builder.build();
  if (plan.distributed_optimizer && plan.overlap_param_gather) {
    gather_matcher = std::make_unique<devices::CollectiveMatcher>(gather_builder, comm);
    for (int r : ranks)
      add_parameter_gathers(*programs[static_cast<std::size_t>(r)], *gather_matcher,
                            gather_builder);
    if (complete) gather_matcher->finish();
  }
  gather_graph = gather_builder.build();
  // An activation set's buffers count from the first task built using it.
  for (std::size_t i = 0; i < event_sets.size(); ++i) {
    const auto use = labels.first_use.find(event_sets[i]);
    if (event_sets[i].second >= 0 && use != labels.first_use.end())
      memory_events[i].tasks_built = use->second;
  }
}

MemoryRecording*& active_memory_recording() {
  thread_local MemoryRecording* recording = nullptr;
  return recording;
}

RankProgram& TrainingStep::Impl::program(int rank) const {
  if (rank < 0 || rank >= mesh.size() || !programs[static_cast<std::size_t>(rank)])
    throw std::out_of_range(
        fmt::format("rank {} is not built in this step (mesh of {} ranks)", rank, mesh.size()));
  return *programs[static_cast<std::size_t>(rank)];
}

StepResult TrainingStep::Impl::result() const {
  if (!materialize)
    throw std::logic_error(
        "this step was built without tensors (StepBuildOptions::materialize = false) and never "
        "runs: it has no result; build it with tensors to train");
  // Every rank's terms, by rank: [built, squared norm, routed, dropped, loss per micro-batch,
  // aux per micro-batch, routing digest's high and low 32 bits]; zero for ranks not built here.
  // Over processes they are summed element-wise (each term comes from one process, so the sum is
  // that term exactly), then added up in rank order as in one process: the same bits however the
  // ranks are spread.
  const int ranks = mesh.size(), M = shape.M;
  const std::size_t width = 6 + 2 * static_cast<std::size_t>(M);
  std::vector<double> terms(static_cast<std::size_t>(ranks) * width, 0.0);
  for (int r = 0; r < ranks; ++r) {
    const auto& program = programs[static_cast<std::size_t>(r)];
    if (!program) continue;
    const RankState& R = program->state;
    double* t = terms.data() + static_cast<std::size_t>(r) * width;
    t[0] = 1;
    t[1] = static_cast<double>(R.norm_sq.data()[0]);
    t[2] = static_cast<double>(R.routed_picks);
    t[3] = static_cast<double>(R.dropped_picks);
    for (int mb = 0; mb < M; ++mb) {
      t[4 + mb] = R.loss[static_cast<std::size_t>(mb)];
      t[4 + M + mb] = R.aux[static_cast<std::size_t>(mb)];
    }
    t[4 + 2 * M] = static_cast<double>(R.routing_digest >> 32);
    t[5 + 2 * M] = static_cast<double>(R.routing_digest & 0xFFFFFFFFull);
  }
  if (processes.size() > 1) processes.sum(terms);
  StepResult out;
  // After its all-reduce every rank holds the same flag; each process holds a rank.
  if (opt.loss_scaling)
    for (const auto& program : programs)
      if (program) {
        out.found_inf = program->state.found_inf.data()[0] != 0.f;
        break;
      }
  // The MoE losses: Megatron-Core's router reduces its statistics over the tp and cp ranks, so
  // every one of them holds the micro-batch's losses and tp 0, cp 0 gives them. MindSpeed's
  // deepspeed_moe gate gates each rank's own tokens (its SP shard, its cp share; under tp without
  // SP the same tokens on every tp rank) and back-propagates each call's loss; weave sums the
  // router's gradient over those ranks, so the step trains the sum of their calls' losses, which
  // is reported (one device making the same gate calls reports the same). MindSpeed itself logs
  // no figure for that gate: its SwitchMLP wrapper drops the loss the layer returns.
  const bool gated_per_rank = shape.model.moe_gate == MoeGate::deepspeed;
  const int aux_tp = gated_per_rank && !shape.routes_replicated ? shape.tp : 1;
  const int aux_cp = gated_per_rank ? shape.cp : 1;
  bool norm_taken = false;
  for (int r = 0; r < ranks; ++r) {
    const double* t = terms.data() + static_cast<std::size_t>(r) * width;
    if (t[0] == 0) continue;
    out.routed_picks += static_cast<std::int64_t>(t[2]);
    out.dropped_picks += static_cast<std::int64_t>(t[3]);
    out.routing_digest +=
        (static_cast<std::uint64_t>(t[4 + 2 * M]) << 32) + static_cast<std::uint64_t>(t[5 + 2 * M]);
    // The summed squared norm is the same on every rank after the world all-reduce.
    if (!norm_taken) {
      out.grad_norm = std::sqrt(t[1]);
      norm_taken = true;
    }
    const MeshCoordinates at = mesh.coordinates(r);
    for (int mb = 0; mb < M; ++mb) {
      // Tensor-parallel ranks hold the same losses; context-parallel ranks different tokens'.
      if (at.tp == 0) out.loss += t[4 + mb];
      if (at.tp < aux_tp && at.cp < aux_cp)
        out.aux_loss += t[4 + M + mb] / (M * shape.plan.data_parallel);
    }
  }
  return out;
}

TrainingStep::TrainingStep(const ModelConfig& model, const ParallelPlan& plan,
                           const OptimizerConfig& optimizer, devices::DeviceSet& devices,
                           devices::Communicator& comm, const StepBuildOptions& options)
    : impl_(std::make_unique<Impl>(model, plan, optimizer, devices, comm, options)) {}
TrainingStep::~TrainingStep() = default;
const std::vector<MemoryEvent>& TrainingStep::memory_events() const {
  return impl_->memory_events;
}
const rt::Graph& TrainingStep::graph() const {
  return impl_->graph;
}
const Mesh& TrainingStep::mesh() const {
  return impl_->mesh;
}
MicroBatch& TrainingStep::micro_batch(int dp, int m) {
  return impl_->inputs.batches.at(static_cast<std::size_t>(dp)).at(static_cast<std::size_t>(m));
}
void TrainingStep::prepare(std::int64_t iteration, double learning_rate) {
  if (iteration < 1) throw std::invalid_argument("iterations count from 1");
  impl_->inputs.iteration = iteration;
  impl_->inputs.learning_rate = learning_rate;
}
void TrainingStep::set_loss_scale(float scale) {
  if (!(scale > 0))
    throw std::invalid_argument(fmt::format("a loss scale must be positive, not {}", scale));
  impl_->inputs.loss_scale = scale;
}
void TrainingStep::set_optimizer_step(std::int64_t step) {
  if (step < 1) throw std::invalid_argument("AdamW's steps count from 1");
  impl_->inputs.optimizer_step = step;
}
StepResult TrainingStep::result() const {
  return impl_->result();
}
devices::ProcessSet& TrainingStep::processes() const {
  return impl_->processes;
}
bool TrainingStep::materialized() const {
  return impl_->materialize;
}
bool TrainingStep::holds(int rank) const {
  return rank >= 0 && rank < impl_->mesh.size() &&
         impl_->programs[static_cast<std::size_t>(rank)] != nullptr;
}
ModelShard& TrainingStep::shard(int rank) {
  return impl_->program(rank).shard();
}
int TrainingStep::activation_sets(int rank) const {
  return static_cast<int>(impl_->program(rank).state.sets.size());
}
TrainingStep::ResidualStream TrainingStep::residual_stream(int rank, int layer, int set) {
  RankProgram& p = impl_->program(rank);
  if (layer < 0 || layer >= p.shape.model.num_layers ||
      p.layout.rank_of(p.set_plan.chunk_of_layer[static_cast<std::size_t>(layer)]) != p.at.pp ||
      set < 0 || set >= static_cast<int>(p.state.sets.size()))
    throw std::out_of_range(
        fmt::format("rank {} holds no layer {} in an activation set {}", rank, layer, set));
  const LayerActivations& A = p.acts(set, layer);
  return {A.x_mid, A.x_out};
}
void TrainingStep::set_update_parameters(bool update) {
  impl_->inputs.update = update;
}
const rt::Graph& TrainingStep::parameter_gather_graph() const {
  return impl_->gather_graph;
}

}  // namespace weave::graphs
