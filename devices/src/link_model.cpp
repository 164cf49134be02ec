#include "weave/devices/link_model.hpp"

#include "weave/runtime/closest_match.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>

namespace weave::devices {

namespace {

// Shared memory on this kind of host: a large memcpy runs at about 10 GB/s within a NUMA node
// (reference/host.md); across nodes half of that is a common figure.
constexpr LinkParams kHostSameNuma{1'000, 10e9};
constexpr LinkParams kHostCrossNuma{2'000, 5e9};

struct PresetEntry {
  const char* name;
  const char* description;
  bool host;
  LinkParams link;
};

const PresetEntry kPresets[] = {
    {"none", "no modelled link: transfers take what the shared-memory copy takes", true,
     kHostSameNuma},
    {"host", "host shared memory held to ~10 GB/s in a NUMA node and ~5 GB/s across nodes", true,
     kHostSameNuma},
    {"ampipe-20gbps",
     "20 GB/s, 10 us: the throttled interconnect of the Ampipe paper's experiments",
     false,
     {10'000, 20e9}},
    {"pcie4",
     "PCIe 4.0 x16: ~25 GB/s effective per direction (31.5 GB/s raw), ~5 us",
     false,
     {5'000, 25e9}},
    {"pcie5",
     "PCIe 5.0 x16: ~50 GB/s effective per direction (63 GB/s raw), ~5 us",
     false,
     {5'000, 50e9}},
    {"nvlink3", "NVLink 3 (A100): 300 GB/s per direction, ~3 us", false, {3'000, 300e9}},
    {"nvlink4", "NVLink 4 (H100): 450 GB/s per direction, ~3 us", false, {3'000, 450e9}},
};

void check(const LinkParams& p, const char* which) {
  if (!(p.bytes_per_second > 0) || !std::isfinite(p.bytes_per_second) || p.latency < 0) {
    throw std::invalid_argument(fmt::format(
        "{} link: bandwidth must be a positive number of bytes per second and latency >= 0 ns "
        "(got {} B/s, {} ns)",
        which, p.bytes_per_second, p.latency));
  }
}

}  // namespace

std::string_view to_string(LinkClass link) {
  switch (link) {
    case LinkClass::same_numa:
      return "same NUMA node";
    case LinkClass::cross_numa:
      return "across NUMA nodes";
    case LinkClass::accelerator:
      return "accelerator link";
  }
  return "?";
}

LinkModel::LinkModel()
    : same_numa_(kHostSameNuma), cross_numa_(kHostCrossNuma), accelerator_link_(kHostSameNuma) {}

LinkModel LinkModel::accelerator(LinkParams accelerator) {
  check(accelerator, "accelerator");
  LinkModel m;
  m.enabled_ = true;
  m.accelerator_ = true;
  m.name_ = "accelerator";
  m.accelerator_link_ = accelerator;
  return m;
}

LinkModel LinkModel::host(LinkParams same_numa, LinkParams cross_numa) {
  check(same_numa, "same-NUMA");
  check(cross_numa, "cross-NUMA");
  LinkModel m;
  m.enabled_ = true;
  m.name_ = "host";
  m.same_numa_ = same_numa;
  m.cross_numa_ = cross_numa;
  return m;
}

namespace {

// "GBPS:MICROSECONDS" -> link parameters, or nothing when `spec` is not of that form.
std::optional<LinkParams> parse_custom_link(std::string_view spec) {
  const std::size_t colon = spec.find(':');
  if (colon == std::string_view::npos) return std::nullopt;
  const std::string gbps(spec.substr(0, colon)), micros(spec.substr(colon + 1));
  char* end = nullptr;
  const double bandwidth = std::strtod(gbps.c_str(), &end);
  const bool bandwidth_ok =
      !gbps.empty() && *end == '\0' && std::isfinite(bandwidth) && bandwidth > 0;
  const double latency = std::strtod(micros.c_str(), &end);
  const bool latency_ok = !micros.empty() && *end == '\0' && std::isfinite(latency) && latency >= 0;
  if (!bandwidth_ok || !latency_ok)
    throw std::invalid_argument(fmt::format(
        "link '{}': a custom link is GBPS:MICROSECONDS, a bandwidth in GB/s greater than 0 and "
        "a per-message latency in microseconds of at least 0 (say 20:10)",
        spec));
  return LinkParams{.latency = static_cast<rt::Nanos>(std::llround(latency * 1e3)),
                    .bytes_per_second = bandwidth * 1e9};
}

}  // namespace

LinkModel LinkModel::preset(std::string_view name) {
  if (const std::optional<LinkParams> custom = parse_custom_link(name)) {
    LinkModel m = accelerator(*custom);
    m.name_ = std::string(name);
    return m;
  }
  for (const PresetEntry& p : kPresets) {
    if (name != p.name) continue;
    LinkModel m = p.host ? host(kHostSameNuma, kHostCrossNuma) : accelerator(p.link);
    m.name_ = p.name;
    m.enabled_ = name != "none";
    return m;
  }
  std::vector<std::string> names;
  for (const PresetEntry& p : kPresets)
    names.emplace_back(p.name);
  const std::string closest = rt::closest_match(name, names);
  throw std::invalid_argument(
      fmt::format("unknown link preset '{}'{}; the presets are: {}", name,
                  closest.empty() ? "" : fmt::format(" (did you mean '{}'?)", closest),
                  fmt::join(names, ", ")));
}

std::vector<LinkPreset> LinkModel::presets() {
  std::vector<LinkPreset> out;
  for (const PresetEntry& p : kPresets)
    out.push_back({p.name, p.description});
  return out;
}

LinkClass LinkModel::link_between(int numa_a, int numa_b) const {
  if (accelerator_) return LinkClass::accelerator;
  return numa_a == numa_b ? LinkClass::same_numa : LinkClass::cross_numa;
}

const LinkParams& LinkModel::params(LinkClass link) const {
  switch (link) {
    case LinkClass::same_numa:
      return same_numa_;
    case LinkClass::cross_numa:
      return cross_numa_;
    case LinkClass::accelerator:
      return accelerator_link_;
  }
  return same_numa_;
}

rt::Nanos LinkModel::duration(double bytes, std::uint32_t messages, LinkClass link) const {
  const LinkParams& p = params(link);
  const std::uint32_t m = messages > 0 ? messages : (bytes > 0 ? 1u : 0u);
  return static_cast<rt::Nanos>(m) * p.latency +
         static_cast<rt::Nanos>(std::llround(bytes / p.bytes_per_second * 1e9));
}

std::string LinkModel::describe() const {
  auto one = [](const LinkParams& p) {
    return fmt::format("{:g} GB/s, {:g} us", p.bytes_per_second * 1e-9, p.latency * 1e-3);
  };
  if (accelerator_) return fmt::format("{} ({})", name_, one(accelerator_link_));
  return fmt::format(
      "{} ({}{}; same NUMA {}, across NUMA {})", name_, enabled_ ? "held" : "not held",
      enabled_ ? "" : ", figures for the virtual clock", one(same_numa_), one(cross_numa_));
}

}  // namespace weave::devices
