// ampipe_tp_bench: Ampipe with experts split over the tensor-parallel group (MindSpeed's
// deepspeed_moe layout, tp 2 + SP, ep 2): degree 1, degree 2, degree 2 with
// --ampipe-tp-sp-comm-overlap and with pipe experts (multi-data 2 and 4, multi-stream on and
// off, and weave's separate dispatch/combine streams); then tp 2 without SP at degree 1, 2 and
// 2 with the overlap, under Megatron-Core's router (each tp rank routing its slice of a chunk)
// and under MindSpeed's gate (every tp rank routing the whole chunk, the experts' partial sums
// all-reduced). For each: the step time and the exposed
// tensor- and expert-parallel communication per device on the virtual clock (8 devices), and
// tokens/s on the wall clock (4 devices on this host, the link slowed as far as the host's
// compute is from the modelled accelerator's). Then the same under context parallelism 2 on the
// virtual clock, with the key/value blocks kept or sent again in backward, and the activation
// memory of a device.
//
// The default rate, 1.2e13 FLOP/s, is where a device's communication and compute are about
// equally busy at degree 1 (the table prints both).
//
//   ampipe_tp_bench [--quick] [--device-flops F]   (--quick: the virtual clock only)
#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "weave/devices/device_set.hpp"
#include "weave/devices/link_model.hpp"
#include "weave/devices/machine_model.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/prediction.hpp"
#include "weave/graphs/training_step.hpp"
#include "weave/runtime/trace_metrics.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace {

using weave::graphs::ModelConfig;
using weave::graphs::ParallelPlan;

struct Variant {
  const char* name;
  ParallelPlan plan;
  weave::graphs::MoeGate gate = weave::graphs::MoeGate::megatron;
};

std::vector<Variant> variants(int data_parallel, int global_batch) {
  const ParallelPlan base{.tensor_parallel = 2,
                          .sequence_parallel = true,
                          .expert_parallel = 2,
                          .moe_model_type = "deepspeed_moe",
                          .data_parallel = data_parallel,
                          .micro_batch_size = 1,
                          .global_batch_size = global_batch};
  std::vector<Variant> out;
  out.push_back({"degree 1", base});
  ParallelPlan p = base;
  p.ampipe_degree = 2;
  out.push_back({"degree 2", p});
  p.ampipe_tp_sp_comm_overlap = true;
  out.push_back({"degree 2 + tp-sp overlap", p});
  for (int slices : {2, 4})
    for (bool multi_stream : {false, true}) {
      ParallelPlan q = base;
      q.ampipe_degree = 2;
      q.pipe_experts = true;
      q.pipe_experts_multi_data = slices;
      q.pipe_experts_multi_stream = multi_stream;
      static std::vector<std::string> names;
      names.push_back(fmt::format("degree 2 + pipe experts md{}{}", slices,
                                  multi_stream ? " multi-stream" : ""));
      out.push_back({names.back().c_str(), q});
    }
  ParallelPlan s = base;
  s.ampipe_degree = 2;
  s.pipe_experts = true;
  s.pipe_experts_multi_data = 4;
  s.pipe_experts_separate_streams = true;
  out.push_back({"degree 2 + pipe experts md4 separate streams", s});
  // Without SP (Megatron-Core's router with the experts split over tp): each chunk's
  // projection all-reduced, each tp rank routing its slice of the chunk.
  ParallelPlan r = base;
  r.sequence_parallel = false;
  out.push_back({"no SP: degree 1", r});
  r.ampipe_degree = 2;
  out.push_back({"no SP: degree 2", r});
  r.ampipe_tp_sp_comm_overlap = true;
  out.push_back({"no SP: degree 2 + tp-sp overlap", r});
  // Without SP under MindSpeed's gate: every tp rank routes the whole chunk, the split experts'
  // partial sums all-reduced over tp (per item under the overlap).
  constexpr auto gate = weave::graphs::MoeGate::deepspeed;
  ParallelPlan g = base;
  g.sequence_parallel = false;
  out.push_back({"no SP, MindSpeed's gate: degree 1", g, gate});
  g.ampipe_degree = 2;
  out.push_back({"no SP, MindSpeed's gate: degree 2", g, gate});
  g.ampipe_tp_sp_comm_overlap = true;
  out.push_back({"no SP, MindSpeed's gate: degree 2 + tp-sp overlap", g, gate});
  return out;
}

ModelConfig with_gate(ModelConfig m, weave::graphs::MoeGate gate) {
  m.moe_gate = gate;
  return m;
}

ModelConfig model(int seq_length) {
  return {.num_layers = 4,
          .hidden_size = 512,
          .num_attention_heads = 8,
          .ffn_hidden_size = 1024,
          .seq_length = seq_length,
          .vocab_size = 256,
          .num_experts = 8,
          .moe_layer_freq = 1,
          .moe_router_topk = 2};
}

void fill(weave::graphs::TrainingStep& step, const ModelConfig& m, const ParallelPlan& plan) {
  for (int dp = 0; dp < plan.data_parallel; ++dp)
    for (int mb = 0; mb < plan.micro_batches(); ++mb) {
      weave::graphs::MicroBatch& b = step.micro_batch(dp, mb);
      for (std::size_t i = 0; i < b.tokens.size(); ++i) {
        b.tokens[i] = static_cast<std::int32_t>((i * 7919 + dp * 131 + mb) % m.vocab_size);
        b.targets[i] = static_cast<std::int32_t>((i * 7919 + dp * 131 + mb + 1) % m.vocab_size);
      }
    }
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  double flops = 1.2e13;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    if (std::strcmp(argv[i], "--device-flops") == 0 && i + 1 < argc) flops = std::atof(argv[++i]);
  }
  // The tensor-parallel collectives are the tp group's and the tp x cp group's (the same ranks
  // when cp is 1, carrying the attention's under Ampipe).
  constexpr std::string_view kTensor[] = {"tp", "tp_cp"}, kExpert[] = {"ep"};
  {
    const ModelConfig m = model(2048);
    const auto links = weave::devices::LinkModel::preset("ampipe-20gbps");
    fmt::print(
        "virtual clock, 8 devices (tp 2 + SP unless named, ep 2, dp 4, experts split over tp), 4 "
        "MoE layers, "
        "hidden 512, 8 experts top-2, 2048 positions, {:.3g} FLOP/s, {}; kernels skipped, "
        "all-to-alls and expert gathers timed for balanced routing\n",
        flops, links.describe());
    fmt::print("{:<52} {:>10} {:>16} {:>16} {:>9}\n", "", "step (ms)", "exposed tp (ms)",
               "exposed ep (ms)", "speed-up");
    double baseline = 0;
    for (Variant v : variants(4, 4)) {
      const ModelConfig gm = with_gate(m, v.gate);
      const auto warnings = weave::graphs::validate(gm, v.plan);
      weave::devices::DeviceSet set(v.plan.devices(), {.pin = false});
      weave::devices::SharedMemoryCommunicator comm;
      const weave::graphs::TrainingStep step(gm, v.plan, {}, set, comm, {.materialize = false});
      const weave::devices::MachineModel machine(std::vector<int>(set.size(), 0), flops, links);
      weave::rt::VirtualClock clock(machine, {.execute = false});
      const weave::rt::VirtualRunResult r = clock.run(step.graph());
      const double ms = static_cast<double>(r.makespan) * 1e-6;
      if (v.plan.ampipe_degree == 1) baseline = ms;  // each layout against its degree 1
      const double per_device = 1e-6 / static_cast<double>(set.size());
      fmt::print(
          "{:<52} {:>10.3f} {:>16.3f} {:>16.3f} {:>8.2f}x\n", v.name, ms,
          static_cast<double>(weave::graphs::exposed_comm_of_groups(r.trace, kTensor)) * per_device,
          static_cast<double>(weave::graphs::exposed_comm_of_groups(r.trace, kExpert)) * per_device,
          baseline / ms);
      for (const std::string& w : warnings)
        fmt::print("    ({})\n", w);
      if (v.plan.ampipe_degree == 1) {
        // Busy time of a device's compute and of its communication (each a union of spans):
        // the table's target holds where they are about equal.
        const weave::rt::TraceMetrics busy = weave::rt::measure(r.trace);
        fmt::print("    (busy per device: compute {:.3f} ms, communication {:.3f} ms)\n",
                   static_cast<double>(busy.total_compute()) * per_device,
                   static_cast<double>(busy.total_comm()) * per_device);
      }
    }
  }
  {
    // Under context parallelism: each rank's halves as the chunks, the attention split evenly,
    // the key/value blocks kept from forward or sent round the ring again in backward.
    const ModelConfig m = model(4096);  // 4 layers: resending the blocks pays from 3
    const auto links = weave::devices::LinkModel::preset("ampipe-20gbps");
    fmt::print(
        "\nvirtual clock, 8 devices (tp 2 + SP, cp 2, ep 2, dp 2, experts split over tp), "
        "4 MoE layers, 4096 positions, otherwise as above\n");
    fmt::print("{:<52} {:>10} {:>16} {:>16} {:>9} {:>18}\n", "", "step (ms)", "exposed cp (ms)",
               "exposed ep (ms)", "speed-up", "activations (MiB)");
    const ParallelPlan base{.tensor_parallel = 2,
                            .sequence_parallel = true,
                            .context_parallel = 2,
                            .expert_parallel = 2,
                            .moe_model_type = "deepspeed_moe",
                            .data_parallel = 2,
                            .micro_batch_size = 1,
                            .global_batch_size = 2};
    constexpr std::string_view kContext[] = {"cp"};
    std::vector<Variant> cp_variants{{"degree 1", base}};
    ParallelPlan p = base;
    p.ampipe_degree = 2;
    cp_variants.push_back({"degree 2", p});
    p.ampipe_tp_sp_comm_overlap = true;
    cp_variants.push_back({"degree 2 + tp-sp overlap", p});
    p.ampipe_cp_resend_kv = true;
    cp_variants.push_back({"degree 2 + tp-sp overlap + resend kv", p});
    double baseline = 0;
    for (Variant v : cp_variants) {
      weave::graphs::validate(m, v.plan);
      weave::devices::DeviceSet set(v.plan.devices(), {.pin = false});
      weave::devices::SharedMemoryCommunicator comm;
      const weave::graphs::TrainingStep step(m, v.plan, {}, set, comm, {.materialize = false});
      const weave::devices::MachineModel machine(std::vector<int>(set.size(), 0), flops, links);
      weave::rt::VirtualClock clock(machine, {.execute = false});
      const weave::rt::VirtualRunResult r = clock.run(step.graph());
      const double ms = static_cast<double>(r.makespan) * 1e-6;
      if (baseline == 0) baseline = ms;
      const double per_device = 1e-6 / static_cast<double>(set.size());
      fmt::print(
          "{:<52} {:>10.3f} {:>16.3f} {:>16.3f} {:>8.2f}x {:>18.1f}\n", v.name, ms,
          static_cast<double>(weave::graphs::exposed_comm_of_groups(r.trace, kContext)) *
              per_device,
          static_cast<double>(weave::graphs::exposed_comm_of_groups(r.trace, kExpert)) * per_device,
          baseline / ms,
          static_cast<double>(set.memory().current(0, weave::rt::MemoryCategory::activations)) /
              (1 << 20));
    }
  }
  if (quick) return 0;
  {
    // 4 devices on this host's cores: the link slowed by what separates the host's compute
    // (about 4e10 FLOP/s a device) from the modelled rate (20 GB/s and 10 us, times 300 at
    // 1.2e13).
    const ModelConfig m = model(1024);
    const double slower = flops / 4e10;
    const auto links = weave::devices::LinkModel::preset(
        fmt::format("{:.4g}:{:.4g}", 20.0 / slower, 10.0 * slower));
    fmt::print(
        "\nwall clock, 4 devices (tp 2 + SP unless named, ep 2, dp 2), 1024 positions, link {}, "
        "3 steps\n",
        links.describe());
    fmt::print("{:<52} {:>12} {:>9}\n", "", "tokens/s", "speed-up");
    double baseline = 0;
    for (Variant v : variants(2, 2)) {
      if (std::string(v.name).find("pipe experts") != std::string::npos &&
          std::string(v.name) != "degree 2 + pipe experts md4")
        continue;
      const ModelConfig gm = with_gate(m, v.gate);
      weave::graphs::validate(gm, v.plan);
      weave::devices::DeviceSet set(v.plan.devices());
      weave::devices::SharedMemoryCommunicator comm;
      weave::graphs::TrainingStep step(gm, v.plan, {}, set, comm);
      const weave::devices::MachineModel machine(std::vector<int>(set.size(), 0), 1e11, links);
      double seconds = 0;
      for (int it = 1; it <= 3; ++it) {
        fill(step, m, v.plan);
        step.prepare(it, 1e-4);
        const auto t0 = std::chrono::steady_clock::now();
        set.executor().run(step.graph(), {.link_model = &machine});
        seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
      const double tokens =
          3.0 * static_cast<double>(m.seq_length) * v.plan.global_batch_size / seconds;
      if (v.plan.ampipe_degree == 1) baseline = tokens;
      fmt::print("{:<52} {:>12.0f} {:>8.2f}x\n", v.name, tokens, tokens / baseline);
    }
  }
  return 0;
}
