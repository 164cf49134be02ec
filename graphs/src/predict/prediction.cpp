#include "weave/graphs/prediction.hpp"

#include <algorithm>
#include <string_view>
#include <utility>

#include "step/comm_streams.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/folded_communicator.hpp"
#include "weave/graphs/mesh.hpp"
#include "weave/graphs/pipeline_layout.hpp"
#include "weave/graphs/training_step.hpp"
#include "weave/graphs/virtual_replay.hpp"
#include "weave/runtime/trace_metrics.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::graphs {

namespace {

// Forward FLOPs of layer l per token, as Megatron-LM counts them.
double layer_forward_flops(const ModelConfig& m, int l) {
  const double h = m.hidden_size, s = m.seq_length, d = m.head_dim();
  const double heads = m.num_attention_heads, groups = m.query_groups();
  const double f = m.ffn_hidden_size, matrices = m.activation == Activation::swiglu ? 3 : 2;
  const double mlp = 2 * h * f * matrices;
  const double attention = 2 * h * (heads + 2 * groups) * d + 4 * s * heads * d + 2 * heads * d * h;
  const double ffn = m.is_moe_layer(l) ? 2 * h * m.num_experts + m.moe_router_topk * mlp : mlp;
  return attention + ffn;
}

}  // namespace

double model_flops_per_step(const ModelConfig& m, const ParallelPlan& plan, bool recompute) {
  const double h = m.hidden_size, s = m.seq_length;
  double layers = 0;  // forward FLOPs of every layer, per token
  for (int l = 0; l < m.num_layers; ++l)
    layers += layer_forward_flops(m, l);
  const double output = 2 * h * m.padded_vocab_size(plan.tensor_parallel);
  const double tokens = static_cast<double>(plan.global_batch_size) * s;
  return tokens * ((recompute ? 4 : 3) * layers + 3 * output);
}

double recomputed_flops_per_step(const ModelConfig& m, const ParallelPlan& plan) {
  const PipelineLayout layout = make_pipeline_layout(m, plan);
  double layers = 0;
  for (int l = 0; l < m.num_layers; ++l)
    if (!recompute_group(m.recompute, layout, l).empty()) layers += layer_forward_flops(m, l);
  return static_cast<double>(plan.global_batch_size) * m.seq_length * layers;
}

Prediction predict_step(TrainerConfig config, const PredictionOptions& options) {
  validate(config);
  const ModelConfig& m = config.model;
  const ParallelPlan& plan = config.plan;
  const Mesh mesh(plan);
  // The ranks built, and the one each device's figures are read from.
  std::vector<int> built, source(static_cast<std::size_t>(plan.devices()));
  std::vector<bool> held(static_cast<std::size_t>(plan.devices()), false);
  for (int r = 0; r < plan.devices(); ++r) {
    const MeshCoordinates at = mesh.coordinates(r);
    const bool fold = options.fold_data_parallel && plan.data_parallel > 1;
    source[static_cast<std::size_t>(r)] = fold ? mesh.rank_of(at.tp, at.cp, 0, at.pp) : r;
    if (source[static_cast<std::size_t>(r)] == r) {
      built.push_back(r);
      held[static_cast<std::size_t>(r)] = true;
    }
  }
  std::vector<rt::DeviceId> ids(built.begin(), built.end());
  devices::DeviceSet set(plan.devices(), {.pin = false, .held = ids});
  devices::FoldedCommunicator comm(held);
  TrainingStep step(m, plan, config.optimizer, set, comm, {.ranks = built, .materialize = false});
  step.prepare(1, config.learning_rate.at(1));
  const devices::MachineModel machine = machine_model(set, config.machine);
  rt::VirtualClock clock(machine, {.execute = false, .record_trace = true});
  rt::VirtualRunResult run = clock.run(step.graph());

  Prediction p;
  const double seconds = static_cast<double>(run.makespan) * 1e-9;
  p.step_ms = seconds * 1e3;
  p.tokens_per_second = static_cast<double>(plan.global_batch_size) * m.seq_length / seconds;
  p.model_flops = model_flops_per_step(m, plan, false);
  p.model_flops_recompute = model_flops_per_step(m, plan, true);
  p.flops_recomputed = recomputed_flops_per_step(m, plan);
  p.flops_per_device = p.model_flops / seconds / plan.devices();
  p.replayed_devices = static_cast<int>(built.size());
  const double peak =
      config.machine.peak_flops > 0 ? config.machine.peak_flops : config.machine.device_flops;
  p.mfu = p.flops_per_device / peak;
  const rt::TraceMetrics metrics = rt::measure(run.trace);
  p.bubble = metrics.compute_bubble();  // over the devices replayed
  p.exposed_ms_per_device =
      static_cast<double>(metrics.total_exposed_comm()) * 1e-6 / static_cast<int>(built.size());
  // Each process group's streams, by the group each was made for (its CommGroup): tp with its
  // gradient stream, ep with its dispatch and combine streams, both directions of every pipeline
  // stage; an unclassified stream stands alone under its own name.
  std::vector<std::pair<std::string, std::vector<std::string_view>>> groups;
  const rt::TaskTable& tasks = run.trace.tasks();
  for (rt::StreamId s = 0; s < tasks.stream_count(); ++s) {
    const std::string_view name = tasks.stream_name(s);
    if (name == "compute") continue;
    const CommGroup kind = comm_group_of(tasks.stream_kind(s));
    const std::string group(kind != CommGroup::unclassified ? to_string(kind) : name);
    auto at =
        std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == group; });
    if (at == groups.end()) at = groups.insert(groups.end(), {group, {}});
    at->second.push_back(name);
  }
  for (const auto& [group, names] : groups) {
    const rt::Nanos exposed = rt::exposed_comm_on_named_streams(run.trace, names);
    if (exposed > 0)
      p.exposed.push_back({group, static_cast<double>(exposed) * 1e-6 / p.replayed_devices});
  }
  for (std::size_t d = 0; d < set.size(); ++d) {
    const auto id = static_cast<rt::DeviceId>(source[d]);
    std::array<std::int64_t, rt::kMemoryCategoryCount> bytes{};
    for (std::size_t c = 0; c < rt::kMemoryCategoryCount; ++c)
      bytes[c] = set.memory().peak(id, static_cast<rt::MemoryCategory>(c));
    p.memory.push_back(bytes);
    p.memory_total.push_back(set.memory().peak_total(id));
  }
  p.trace = std::move(run.trace);
  return p;
}

}  // namespace weave::graphs
