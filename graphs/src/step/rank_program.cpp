// The rank program's frame: its groups, its tasks, the sequence layout its rows follow, and the
// outline of its step (zero the gradients, the schedule's actions, the optimizer).
#include "step/rank_program.hpp"

#include "model/half_precision.hpp"
#include "moe/moe_expert_bias.hpp"
#include "pipeline/pipeline_program.hpp"
#include "step/gradient_buckets.hpp"
#include "step/optimizer_program.hpp"
#include "step/step_costs.hpp"
#include "weave/devices/packed_halves.hpp"
#include "weave/ops/dropout.hpp"
#include "weave/ops/elementwise.hpp"

namespace weave::graphs {

GroupHandle::GroupHandle(devices::CollectiveMatcher& matcher, rt::GraphBuilder& graph,
                         const devices::ProcessGroup& group, int member, std::string stream,
                         CommGroup stream_group, std::map<std::string, TaskId>* tails,
                         std::size_t element_bytes)
    : matcher_(&matcher),
      graph_(&graph),
      group_(&group),
      member_(member),
      stream_(std::move(stream)),
      stream_group_(stream_group),
      tails_(tails),
      element_bytes_(element_bytes) {}

TaskId GroupHandle::issue(TaskId ready, const devices::CollectiveCall& call,
                          const devices::CollectiveMember& buffers, const std::string& name,
                          rt::TaskTags tags, const std::string& stream) const {
  if (size() == 1) return rt::kNoTask;  // a group of one has nothing to do
  const devices::CollectiveOptions options{.name = name,
                                           .tags = tags,
                                           .stream = stream.empty() ? stream_ : stream,
                                           .stream_kind = stream_kind(stream_group_),
                                           .element_bytes = element_bytes_};
  const TaskId t = matcher_->issue(call, *group_, member_, buffers, options);
  (*tails_)[std::string(options.stream)] = t;
  if (ready != rt::kNoTask) graph_->precede(ready, t);
  return t;
}

namespace {

std::span<std::uint16_t> halves_of(const ops::Bf16Tensor& t) {
  return {reinterpret_cast<std::uint16_t*>(t.data()), static_cast<std::size_t>(t.numel())};
}

}  // namespace

TaskId GroupHandle::all_gather_halves(TaskId ready, const ops::Bf16Tensor& input,
                                      const ops::Bf16Tensor& output, const std::string& name,
                                      rt::TaskTags tags) const {
  GroupHandle packed = with_element_bytes(sizeof(float));
  return packed.issue(
      ready, {.op = devices::CollectiveOp::all_gather},
      {.input = devices::gathered_elements(devices::packed_halves(
           std::span<const std::uint16_t>(halves_of(input)), (name + " input").c_str())),
       .output = devices::gathered_elements(
           devices::packed_halves(halves_of(output), (name + " output").c_str()))},
      name, tags);
}

namespace {

GroupHandle handle(RankProgram& P, GroupKind kind, const char* stream, CommGroup stream_group,
                   std::map<std::string, TaskId>* tails) {
  const devices::ProcessGroup& g = P.mesh.group(kind, P.rank);
  return GroupHandle(P.matcher, P.graph, g, g.rank_of(static_cast<rt::DeviceId>(P.rank)), stream,
                     stream_group, tails,
                     static_cast<std::size_t>(P.shape.model.activation_bytes()));
}

}  // namespace

RankProgram::RankProgram(const StepShape& shape_, const Mesh& mesh_, const PipelineLayout& layout_,
                         const ActivationSetPlan& sets, const StepInputs& inputs_,
                         const OptimizerConfig& opt_, int rank_, devices::Device& device_,
                         rt::GraphBuilder& graph_, devices::CollectiveMatcher& matcher_,
                         bool materialize_)
    : shape(shape_),
      mesh(mesh_),
      layout(layout_),
      set_plan(sets),
      inputs(inputs_),
      opt(opt_),
      rank(rank_),
      at(mesh_.coordinates(rank_)),
      device(device_),
      materialize(materialize_),
      matcher(matcher_),
      graph(graph_) {
  // Each group's stream is named by its kind, as the mesh names the groups.
  tensor = handle(*this, GroupKind::tensor, "tp", CommGroup::tensor, &comm_tails_);
  context = handle(*this, GroupKind::context, "cp", CommGroup::context, &comm_tails_);
  expert = handle(*this, GroupKind::expert, "ep", CommGroup::expert, &comm_tails_);
  expert_data = handle(*this, GroupKind::expert_data, "edp", CommGroup::expert_data, &comm_tails_);
  data = handle(*this, GroupKind::data_context, "dp_cp", CommGroup::data_context, &comm_tails_);
  tensor_context =
      handle(*this, GroupKind::tensor_context, "tp_cp", CommGroup::tensor_context, &comm_tails_);
  tensor_gradients = handle(*this, GroupKind::tensor, "tp_grad", CommGroup::tensor, &comm_tails_);
  allocate();
}

TaskId RankProgram::compute(const std::string& name, rt::TaskTags tags, rt::CostHint cost,
                            std::function<void()> fn) {
  rt::TaskFn work = [fn = std::move(fn)](rt::TaskContext&) { fn(); };
  if (!materialize)
    work = [](rt::TaskContext&) {
      throw std::logic_error(
          "this step was built without tensors (StepBuildOptions::materialize = false): replay "
          "it on the virtual clock without running the work (VirtualClockOptions::execute = "
          "false), or build it with tensors to run it");
    };
  const TaskId t = graph.add({.device = static_cast<rt::DeviceId>(rank),
                              .stream = rt::kComputeStream,
                              .kind = rt::TaskKind::compute,
                              .name = name,
                              .tags = tags,
                              .cost = cost},
                             std::move(work));
  for (const TaskId gather : awaited_gathers_)
    graph.precede(gather, t);
  awaited_gathers_.clear();
  return t;
}

TaskId RankProgram::compute_on(const std::string& stream, CommGroup group, const std::string& name,
                               rt::TaskTags tags, rt::CostHint cost, std::function<void()> fn) {
  rt::TaskFn work = [fn = std::move(fn)](rt::TaskContext&) { fn(); };
  if (!materialize)
    work = [](rt::TaskContext&) {
      throw std::logic_error("this step was built without tensors: replay it without the work");
    };
  const TaskId t = graph.add({.device = static_cast<rt::DeviceId>(rank),
                              .stream = graph.stream(stream, stream_kind(group)),
                              .kind = rt::TaskKind::compute,
                              .name = name,
                              .tags = tags,
                              .cost = cost},
                             std::move(work));
  track_comm(stream, t);
  return t;
}

void RankProgram::wait_for_parameters(const std::string& point) {
  const auto found = parameter_gathers.find(point);
  if (found == parameter_gathers.end()) return;
  awaited_gathers_.insert(awaited_gathers_.end(), found->second.begin(), found->second.end());
}

void RankProgram::load_tokens(int mb, std::vector<std::int32_t>& into, bool targets) const {
  const MicroBatch& data =
      inputs.batches[static_cast<std::size_t>(at.dp)][static_cast<std::size_t>(mb)];
  const std::vector<std::int32_t>& from = targets ? data.targets : data.tokens;
  const std::int64_t Sc = shape.Sc, B = shape.B;
  into.resize(static_cast<std::size_t>(Sc * B));
  for (std::int64_t s = 0; s < Sc; ++s) {
    const std::int64_t g = shape.context_position(at.cp, s);
    for (std::int64_t bi = 0; bi < B; ++bi)
      into[s * B + bi] = from[g * B + bi];
  }
}

ops::RandomKey RankProgram::dropout_key(int layer, int site) const {
  return {.seed = shape.model.seed ^
                  (0x9E3779B97F4A7C15ull * static_cast<std::uint64_t>(inputs.iteration)),
          .layer = static_cast<std::uint32_t>(layer),
          .site = static_cast<std::uint32_t>(site)};
}

void RankProgram::apply_dropout(bool backward, int mb, int layer, int site, const Tensor& in,
                                const Tensor& out, std::int64_t first_row) const {
  const ModelConfig& m = shape.model;
  if (m.hidden_dropout <= 0) {
    if (out.data() != in.data()) out.copy_from(in);
    return;
  }
  ops::DropoutSpec spec{.probability = m.hidden_dropout,
                        .key = dropout_key(layer, site),
                        .sequence_length = shape.S,
                        .batch_offset = batch_offset(mb)};
  // in and out hold rows [first_row, first_row + rows) of the rank's [Sl, B, h] layout.
  const std::int64_t rows = in.dim(0);
  for (std::int64_t s0 = 0; s0 < rows;) {
    std::int64_t s1 = s0 + 1;
    while (s1 < rows && position(first_row + s1) == position(first_row + s0) + (s1 - s0))
      ++s1;
    spec.sequence_offset = position(first_row + s0);
    const Tensor x = in.slice(0, s0, s1 - s0).transpose(0, 1);
    const Tensor y = out.slice(0, s0, s1 - s0).transpose(0, 1);
    if (backward)
      ops::dropout_backward(spec, x, y);
    else
      ops::dropout_forward(spec, x, y);
    s0 = s1;
  }
}

void RankProgram::bias_dropout_add(int mb, int layer, int site, const Tensor& y, const Tensor& bias,
                                   const Tensor& x_in, const Tensor& x_out,
                                   std::int64_t first_row) const {
  const std::int64_t rows = y.rows(), h = shape.h;
  if (bias.defined())  // absent with --disable-bias-linear
    for (std::int64_t i = 0; i < rows; ++i) {
      float* row = y.row(i);
      for (std::int64_t c = 0; c < h; ++c)
        row[c] += bias.data()[c];
    }
  apply_dropout(false, mb, layer, site, y, y, first_row);
  ops::add(x_in, y, x_out);
  if (rounds_residual_stream()) round_in_place(precision(), x_out);
}

void RankProgram::bias_dropout_add_backward(int mb, int layer, int site, const Tensor& d_out,
                                            const Tensor& d_y, const Tensor& d_bias,
                                            std::int64_t first_row) const {
  apply_dropout(true, mb, layer, site, d_out, d_y, first_row);
  const std::int64_t h = shape.h;
  if (!d_bias.defined()) return;
  for (std::int64_t i = 0; i < d_y.rows(); ++i) {
    const float* row = d_y.row(i);
    for (std::int64_t c = 0; c < h; ++c)
      d_bias.data()[c] += row[c];
  }
}

void RankProgram::build() {
  double gradients = 0;
  for (const GradientBucket& b : shard().buckets())
    gradients += static_cast<double>(b.grads.numel());
  // With --overlap-param-gather the step opens with the gathers of the last update's shards.
  // (They move a 16-bit run's 16-bit copies, which the refresh below leaves to them: nothing
  // waits for them but the parts of the forward that read their values.)
  start_parameter_gathers(*this);
  compute("zero_grads", {},
          cost::streamed_bytes(gradients, parameter_bytes(shape.model.precision).gradient), [this] {
            state.shard->zero_grads();
            // A bf16 run's products read the main parameters as the last update (or a loaded
            // checkpoint) left them, rounded to bf16; sharded ones as the optimizer rounded them.
            if (half()) state.shard->refresh_bf16_copies();
            std::fill(state.loss.begin(), state.loss.end(), 0.0);
            std::fill(state.aux.begin(), state.aux.end(), 0.0);
            state.routed_picks = state.dropped_picks = 0;
            state.routing_digest = 0;
            for (auto& loads : state.expert_loads)
              loads.second.fill(0.f);
          });
  build_pipeline(*this);
  reduce_deferred_buckets(*this);
  build_optimizer(*this);
  build_expert_bias_update(*this);
}

}  // namespace weave::graphs
