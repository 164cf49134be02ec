// step_fingerprint: what a refactor of the training step must not change, as one table. For a
// set of configurations covering every strategy it prints the loss, aux loss and gradient norm
// of five training steps as exact hexadecimal floats, the step graph's task count and its
// virtual-clock step time with the kernels skipped. Run it before and after a change and diff
// the two outputs: the losses must match bit for bit; task counts and step times change only
// where the change means them to.
//
//   step_fingerprint [--steps N]
#include <fmt/format.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "weave/devices/device_set.hpp"
#include "weave/devices/link_model.hpp"
#include "weave/devices/machine_model.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/prediction.hpp"
#include "weave/graphs/training_step.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace {

using weave::graphs::ModelConfig;
using weave::graphs::ParallelPlan;

struct Configuration {
  const char* name;
  ModelConfig model;
  ParallelPlan plan;
};

ModelConfig small_model(int experts) {
  return {.num_layers = 4,
          .hidden_size = 64,
          .num_attention_heads = 4,
          .ffn_hidden_size = 128,
          .seq_length = 32,
          .vocab_size = 60,
          .make_vocab_size_divisible_by = 16,
          .hidden_dropout = 0.1,
          .num_experts = experts,
          .moe_layer_freq = 2,
          .moe_router_topk = 2,
          .moe_aux_loss_coeff = 0.01,
          .moe_z_loss_coeff = 0.001};
}

std::vector<Configuration> configurations() {
  std::vector<Configuration> out;
  out.push_back({"dense tp2 sp dp2",
                 small_model(0),
                 {.tensor_parallel = 2,
                  .sequence_parallel = true,
                  .data_parallel = 2,
                  .micro_batch_size = 2,
                  .global_batch_size = 8}});
  out.push_back({"moe tp2 sp ep2 ampipe2",
                 small_model(4),
                 {.tensor_parallel = 2,
                  .sequence_parallel = true,
                  .expert_parallel = 2,
                  .micro_batch_size = 2,
                  .global_batch_size = 4,
                  .ampipe_degree = 2}});
  out.push_back({"moe cp2 ep2 dp2",
                 small_model(4),
                 {.context_parallel = 2,
                  .expert_parallel = 2,
                  .data_parallel = 2,
                  .micro_batch_size = 1,
                  .global_batch_size = 4}});
  out.push_back({"moe cp2 ampipe2 ep2",
                 small_model(4),
                 {.context_parallel = 2,
                  .expert_parallel = 2,
                  .micro_batch_size = 2,
                  .global_batch_size = 4,
                  .ampipe_degree = 2}});
  out.push_back({"moe ep2 dp2 ampipe2 pipe-experts",
                 small_model(4),
                 {.expert_parallel = 2,
                  .data_parallel = 2,
                  .micro_batch_size = 2,
                  .global_batch_size = 8,
                  .ampipe_degree = 2,
                  .pipe_experts = true,
                  .pipe_experts_separate_streams = true,
                  .pipe_experts_multi_data = 4}});
  out.push_back({"dense pp2 1f1b tp2 sp",
                 small_model(0),
                 {.tensor_parallel = 2,
                  .sequence_parallel = true,
                  .pipeline_parallel = 2,
                  .micro_batch_size = 1,
                  .global_batch_size = 4}});
  out.push_back({"moe pp2 interleaved ep2 dp2",
                 small_model(4),
                 {.expert_parallel = 2,
                  .data_parallel = 2,
                  .pipeline_parallel = 2,
                  .virtual_pipeline = 2,
                  .micro_batch_size = 1,
                  .global_batch_size = 8}});
  out.push_back({"moe pp2 zb-h1 tp2 sp ep2",
                 small_model(4),
                 {.tensor_parallel = 2,
                  .sequence_parallel = true,
                  .expert_parallel = 2,
                  .pipeline_parallel = 2,
                  .pipeline_scheduler = "zb-h1",
                  .micro_batch_size = 1,
                  .global_batch_size = 4}});
  out.push_back({"dense pp2 zb-v cp2",
                 small_model(0),
                 {.context_parallel = 2,
                  .pipeline_parallel = 2,
                  .virtual_pipeline = 2,
                  .pipeline_scheduler = "zb-v",
                  .micro_batch_size = 1,
                  .global_batch_size = 4}});
  out.push_back({"moe dp4 ep2 distributed optimizer",
                 small_model(4),
                 {.expert_parallel = 2,
                  .data_parallel = 4,
                  .micro_batch_size = 1,
                  .global_batch_size = 8,
                  .distributed_optimizer = true}});
  ModelConfig capacity = small_model(4);
  capacity.moe_expert_capacity_factor = 1.0;
  capacity.activation = weave::graphs::Activation::swiglu;
  out.push_back({"moe swiglu tp2 ep2 capacity 1 ampipe2",
                 capacity,
                 {.tensor_parallel = 2,
                  .sequence_parallel = true,
                  .expert_parallel = 2,
                  .micro_batch_size = 2,
                  .global_batch_size = 4,
                  .ampipe_degree = 2}});
  out.push_back({"dense tp2 no-sp cp2 swiglu",
                 [] {
                   ModelConfig m = small_model(0);
                   m.activation = weave::graphs::Activation::swiglu;
                   return m;
                 }(),
                 {.tensor_parallel = 2,
                  .context_parallel = 2,
                  .micro_batch_size = 2,
                  .global_batch_size = 4}});
  // The modern decoder: rotary positions, RMSNorm, grouped-query attention, SwiGLU, no biases,
  // an output layer of its own.
  ModelConfig modern = small_model(0);
  modern.position_embedding = weave::graphs::PositionEmbedding::rope;
  modern.normalization = weave::graphs::Normalization::rms_norm;
  modern.num_query_groups = 2;
  modern.activation = weave::graphs::Activation::swiglu;
  modern.add_bias_linear = false;
  modern.untie_embeddings_and_output_weights = true;
  out.push_back({"modern decoder tp2 sp dp2",
                 modern,
                 {.tensor_parallel = 2,
                  .sequence_parallel = true,
                  .data_parallel = 2,
                  .micro_batch_size = 1,
                  .global_batch_size = 4}});
  // MindSpeed's deepspeed_moe layout: experts split over tp, their collectives pipelined per
  // (chunk, local expert) item.
  out.push_back({"moe split experts tp2 sp ep2 dp2 ampipe2 tp-sp overlap",
                 small_model(4),
                 {.tensor_parallel = 2,
                  .sequence_parallel = true,
                  .expert_parallel = 2,
                  .expert_tensor_parallel = 2,
                  .data_parallel = 2,
                  .micro_batch_size = 1,
                  .global_batch_size = 4,
                  .ampipe_degree = 2,
                  .ampipe_tp_sp_comm_overlap = true}});
  // MindSpeed's gate and layout with pipe experts under Ampipe, multi-stream: every chunk's items
  // expert-major, their all-to-alls and tp gathers and scatters in one order.
  ModelConfig gated = small_model(4);
  gated.moe_gate = weave::graphs::MoeGate::deepspeed;
  gated.moe_z_loss_coeff = 0;  // MindSpeed's deepspeed_moe layer has none
  out.push_back({"moe deepspeed_moe tp2 sp ep2 dp2 ampipe2 pipe-experts multi-stream",
                 gated,
                 {.tensor_parallel = 2,
                  .sequence_parallel = true,
                  .expert_parallel = 2,
                  .moe_model_type = "deepspeed_moe",
                  .data_parallel = 2,
                  .micro_batch_size = 1,
                  .global_batch_size = 4,
                  .ampipe_degree = 2,
                  .pipe_experts = true,
                  .pipe_experts_multi_stream = true,
                  .pipe_experts_multi_data = 4}});
  return out;
}

// A prediction (built without tensors, replayed on a two-node cluster): what predict prints.
void print_prediction() {
  weave::graphs::TrainerConfig c;
  c.model = small_model(4);
  c.model.precision = weave::graphs::Precision::bf16;
  c.model.recompute = {.granularity = weave::graphs::RecomputeGranularity::full,
                       .method = weave::graphs::RecomputeMethod::uniform,
                       .num_layers = 1};
  c.plan = {.tensor_parallel = 2,
            .sequence_parallel = true,
            .expert_parallel = 2,
            .data_parallel = 2,
            .pipeline_parallel = 2,
            .micro_batch_size = 1,
            .global_batch_size = 8,
            .distributed_optimizer = true};
  c.machine = {.device_flops = 1e12,
               .device_memory_bandwidth = 1e11,
               .link = "nvlink4",
               .cluster = weave::devices::Cluster(
                   4, {"node", {.latency = 3000, .bytes_per_second = 1e11}},
                   {"network", {.latency = 5000, .bytes_per_second = 2.5e10}})};
  const weave::graphs::Prediction p = weave::graphs::predict_step(c);
  fmt::print("prediction moe tp2 sp ep2 dp2 pp2 bf16 full recompute, 2 nodes of 4\n");
  fmt::print("  step {:a} ms | bubble {:a} | exposed {:a} ms | replayed devices {}\n", p.step_ms,
             p.bubble, p.exposed_ms_per_device, p.replayed_devices);
  for (std::size_t d = 0; d < p.memory_total.size(); ++d)
    fmt::print("  device {} memory {} bytes\n", d, p.memory_total[d]);
}

// A fixed pseudo-random text: token of global sample j at position s.
std::int32_t token(std::int64_t sample, std::int64_t position, int vocab) {
  std::uint64_t x = static_cast<std::uint64_t>(sample * 1009 + position * 7919 + 17);
  x ^= x >> 13;
  x *= 0x9E3779B97F4A7C15ull;
  return static_cast<std::int32_t>((x >> 33) % static_cast<std::uint64_t>(vocab));
}

void fill(weave::graphs::TrainingStep& step, const ModelConfig& m, const ParallelPlan& plan,
          int iteration) {
  const int M = plan.micro_batches(), B = plan.micro_batch_size, S = m.seq_length;
  for (int dp = 0; dp < plan.data_parallel; ++dp)
    for (int mb = 0; mb < M; ++mb) {
      weave::graphs::MicroBatch& batch = step.micro_batch(dp, mb);
      for (int bi = 0; bi < B; ++bi) {
        const std::int64_t sample =
            std::int64_t{iteration} * plan.global_batch_size + (dp * M + mb) * B + bi;
        for (int s = 0; s < S; ++s) {
          batch.tokens[s * B + bi] = token(sample, s, m.vocab_size);
          batch.targets[s * B + bi] = token(sample, s + 1, m.vocab_size);
        }
      }
    }
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 5;
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--steps") == 0 && i + 1 < argc) steps = std::atoi(argv[++i]);
  for (Configuration c : configurations()) {
    weave::graphs::validate(c.model, c.plan);
    weave::devices::DeviceSet set(c.plan.devices(), {.pin = false});
    weave::devices::SharedMemoryCommunicator comm;
    weave::graphs::TrainingStep step(
        c.model, c.plan,
        {.adamw = {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1}, .clip_grad = 1},
        set, comm);
    fmt::print("{}\n", c.name);
    for (int it = 1; it <= steps; ++it) {
      fill(step, c.model, c.plan, it);
      step.prepare(it, 1e-2);
      set.executor().run(step.graph());
      const auto r = step.result();
      fmt::print("  step {}: loss {:a} aux {:a} grad norm {:a} routed {} dropped {}\n", it, r.loss,
                 r.aux_loss, r.grad_norm, r.routed_picks, r.dropped_picks);
    }
    const weave::devices::MachineModel machine(std::vector<int>(set.size(), 0), 1e12,
                                               weave::devices::LinkModel::preset("ampipe-20gbps"));
    weave::rt::VirtualClock clock(machine, {.execute = false, .record_trace = false});
    fmt::print("  tasks {} | virtual-clock step {} ns (kernels skipped)\n", step.graph().size(),
               clock.run(step.graph()).makespan);
  }
  print_prediction();
  return 0;
}
