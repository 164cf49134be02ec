// An accelerator and the node it sits in, as data: the figures the virtual clock needs to say
// what a step would take on it. Presets (`Accelerator::preset_names()`) are JSON files under
// devices/accelerators/ (installed under share/weave/accelerators): copy one, set your own
// figures and pass its path instead of a name.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "weave/devices/attention_rates.hpp"

namespace weave::devices {

struct NetworkLink {
  std::string name;
  double bytes_per_second = 0;  // one direction, per device: the line rate
  double latency_us = 0;
  // The share of the line rate NCCL-class collectives reach as bus bandwidth on large messages
  // (nccl-tests' busBw over the link's rate); optional in a file, 1 when absent. The cluster
  // prices collectives at bytes_per_second x bus_efficiency.
  double bus_efficiency = 1;
  // A node link only: every device of the node has a link of its own to each other one (HCCS in
  // an Atlas 800T A2), bytes_per_second being one link's. Optional in a file, false when absent:
  // one switched link a device (NVLink through NVSwitch). See Cluster.
  bool full_mesh = false;
};

struct Accelerator {
  std::string name;
  double peak_flops = 0;         // dense BF16/FP16 tensor FLOP/s
  double matmul_efficiency = 0;  // share of the peak large matrix products sustain
  // Rows at which a product runs at half its large-shape rate (devices::KernelRates); optional in
  // a file, 0 when absent.
  double matmul_overhead_dimension = 0;
  // Share of the peak blockwise (flash) attention sustains; optional, matmul_efficiency when
  // absent.
  double attention_efficiency = 0;
  // The same for the attention's backward; optional, attention_efficiency when absent.
  double attention_backward_efficiency = 0;
  // Fused attention kernels' measured rates by the backend name that runs them ("flash", "fused":
  // Megatron-Core's --attention-backend), by head dimension and sequence length
  // ("attention_kernels" in a file, TFLOP/s); optional. A backend without one is priced at
  // attention_efficiency.
  std::vector<std::pair<std::string, AttentionRateTable>> attention_kernels;
  // The kernel backend "auto" runs on this device (Transformer Engine's choice); optional, empty:
  // auto is priced at attention_efficiency.
  std::string attention_auto;
  // The share of a kernel benchmark's clock a device keeps through a training step, every kernel
  // back to back at its power limit: a benchmark of one kernel times it at the boost clock, a step
  // runs where the power cap holds it. Scales the products' and the attention's rates (not the
  // memory bandwidth); optional, 1 when absent (the efficiencies are then a step's own).
  double power_limited_clock_share = 1;
  std::int64_t memory_bytes = 0;  // device memory
  double memory_bandwidth = 0;    // bytes/s, the datasheet's
  double memory_efficiency = 0;   // share of it streaming kernels sustain
  // The time a kernel costs beyond its work, in microseconds: the gap between back-to-back
  // kernels of a stream (launch, ramp-up and drain), paid once per kernel a compute task stands
  // for (devices::KernelRates). Optional in a file, 0 when absent.
  double kernel_launch_us = 0;
  int devices_per_node = 1;
  NetworkLink node_link;  // between the devices of a node
  NetworkLink network;    // between nodes, each device's share
  std::vector<std::string> sources;
  // Each figure's source beside its name ("figure_sources" in a file: an object of field name to
  // text), in the file's order; optional.
  std::vector<std::pair<std::string, std::string>> figure_sources;
  std::string assumed;  // which figures are assumptions, not published

  double sustained_flops() const {
    return peak_flops * matmul_efficiency * power_limited_clock_share;
  }
  double sustained_attention_flops() const {
    return peak_flops * attention_efficiency * power_limited_clock_share;
  }
  double sustained_attention_backward_flops() const {
    return peak_flops * attention_backward_efficiency * power_limited_clock_share;
  }
  // The attention's sustained FLOP/s under a backend ("flash", "fused", "auto", ...) at a head
  // dimension and the sequence length a kernel call sees: the backend's measured kernel
  // (attention_kernels; auto's is attention_auto) at the power-limited clock, or without one the
  // flat efficiencies above.
  double sustained_attention_flops(const std::string& backend, double head_dim, double sequence,
                                   bool backward) const;
  double sustained_memory_bandwidth() const { return memory_bandwidth * memory_efficiency; }

  static std::vector<std::string> preset_names();
  // A preset by name, or the JSON file at a path (a name with '/' or ending in ".json").
  // Throws std::invalid_argument naming the presets for an unknown name, and the field for a
  // file that lacks one or holds a value out of range.
  static Accelerator load(const std::string& name_or_path);
  static Accelerator parse(std::string_view json_text, const std::string& source);
  // The JSON text parse reads back to an equal accelerator (a preset file of its own).
  std::string to_json() const;
};

}  // namespace weave::devices
