// The modelled interconnect between devices: time = messages * latency + bytes / bandwidth
// per link class. Off by default: transfers then cost what the shared-memory copy costs.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "weave/runtime/types.hpp"

namespace weave::devices {

enum class LinkClass : std::uint8_t { same_numa, cross_numa, accelerator };
std::string_view to_string(LinkClass link);

struct LinkParams {
  rt::Nanos latency = 0;        // alpha, per message
  double bytes_per_second = 0;  // beta
};

struct LinkPreset {
  std::string name;
  std::string description;  // what it models and where the figures come from
};

class LinkModel {
 public:
  // Off: the executor holds nothing; the virtual clock costs transfers at host memory speed.
  LinkModel();
  // Every transfer between devices goes over `accelerator` (same or cross NUMA alike).
  static LinkModel accelerator(LinkParams accelerator);
  // Host shared memory, with separate figures for one NUMA node and across nodes.
  static LinkModel host(LinkParams same_numa, LinkParams cross_numa);
  // A named preset, or "GBPS:MICROSECONDS" for an accelerator link of that bandwidth and
  // per-message latency (say "0.2:500", to slow a link as far as host compute is from an
  // accelerator's); throws std::invalid_argument listing the names for an unknown one.
  static LinkModel preset(std::string_view name);
  static std::vector<LinkPreset> presets();

  // True when the executor should hold transfers to the modelled time.
  bool enabled() const { return enabled_; }
  const std::string& name() const { return name_; }
  // Which link a transfer between NUMA nodes a and b uses.
  LinkClass link_between(int numa_a, int numa_b) const;
  const LinkParams& params(LinkClass link) const;
  // messages * latency + bytes / bandwidth, rounded to whole ns; at least one message when
  // bytes > 0.
  rt::Nanos duration(double bytes, std::uint32_t messages, LinkClass link) const;
  std::string describe() const;

 private:
  bool enabled_ = false;
  bool accelerator_ = false;
  std::string name_ = "none";
  LinkParams same_numa_;
  LinkParams cross_numa_;
  LinkParams accelerator_link_;
};

}  // namespace weave::devices
