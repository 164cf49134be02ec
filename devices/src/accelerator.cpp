#include "weave/devices/accelerator.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "accelerator_presets.hpp"

namespace weave::devices {

namespace {

using json = nlohmann::ordered_json;  // keeps a file's order (figure_sources)

double positive(const json& j, const char* key, const std::string& source) {
  if (!j.contains(key) || !j.at(key).is_number())
    throw std::invalid_argument(
        fmt::format("accelerator {}: '{}' is missing or not a number", source, key));
  const double v = j.at(key).get<double>();
  if (!(v > 0) || !std::isfinite(v))
    throw std::invalid_argument(
        fmt::format("accelerator {}: '{}' must be a finite number > 0, got {}", source, key, v));
  return v;
}

double share(const json& j, const char* key, const std::string& source) {
  const double v = positive(j, key, source);
  if (v > 1)
    throw std::invalid_argument(fmt::format(
        "accelerator {}: '{}' is a share of the peak, in (0, 1], got {}", source, key, v));
  return v;
}

// A text field, or `fallback` when it is absent or not a string.
std::string text_or(const json& j, const char* key, const std::string& fallback) {
  return j.contains(key) && j.at(key).is_string() ? j.at(key).get<std::string>() : fallback;
}

NetworkLink link(const json& j, const char* key, const std::string& source) {
  if (!j.contains(key) || !j.at(key).is_object())
    throw std::invalid_argument(fmt::format(
        "accelerator {}: '{}' must be an object with name, bytes_per_second and latency_us", source,
        key));
  const json& l = j.at(key);
  const std::string where = fmt::format("{} ({})", source, key);
  bool full_mesh = false;
  if (l.contains("full_mesh")) {
    if (!l.at("full_mesh").is_boolean() ||
        (l.at("full_mesh").get<bool>() && std::string_view(key) != "node_link"))
      throw std::invalid_argument(fmt::format(
          "accelerator {}: 'full_mesh' is true or false, and true only for the node_link (each "
          "device joined to every other of its node by a link of its own), got {}",
          where, l.at("full_mesh").dump()));
    full_mesh = l.at("full_mesh").get<bool>();
  }
  return {.name = text_or(l, "name", key),
          .bytes_per_second = positive(l, "bytes_per_second", where),
          .latency_us = positive(l, "latency_us", where),
          .bus_efficiency = l.contains("bus_efficiency") ? share(l, "bus_efficiency", where) : 1.0,
          .full_mesh = full_mesh};
}

// One direction of a kernel's table: {"head dim": {"sequence": TFLOP/s, ...}, ...}.
std::vector<AttentionRateTable::Row> rate_rows(const json& j, const std::string& where) {
  std::vector<AttentionRateTable::Row> rows;
  if (!j.is_object())
    throw std::invalid_argument(fmt::format(
        "accelerator {} must map head dimensions to {{sequence length: TFLOP/s}} objects", where));
  auto number = [&](const std::string& key, const char* what) {
    std::size_t used = 0;
    double v = -1;
    try {
      v = std::stod(key, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != key.size() || !(v > 0) || !std::isfinite(v))
      throw std::invalid_argument(fmt::format(
          "accelerator {}: '{}' is not a {} (a number > 0 as a key)", where, key, what));
    return v;
  };
  for (const auto& [dim, points] : j.items()) {
    AttentionRateTable::Row row{.head_dim = number(dim, "head dimension"), .points = {}};
    if (!points.is_object() || points.empty())
      throw std::invalid_argument(fmt::format(
          "accelerator {}: head dimension {} must map sequence lengths to TFLOP/s", where, dim));
    for (const auto& [sequence, tflops] : points.items()) {
      const double rate = tflops.is_number() ? tflops.get<double>() : -1;
      if (!(rate > 0) || !std::isfinite(rate))
        throw std::invalid_argument(
            fmt::format("accelerator {}: head dimension {} at sequence {} must be TFLOP/s > 0, "
                        "got {}",
                        where, dim, sequence, tflops.dump()));
      row.points.emplace_back(number(sequence, "sequence length"), rate * 1e12);
    }
    std::sort(row.points.begin(), row.points.end());
    rows.push_back(std::move(row));
  }
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.head_dim < b.head_dim; });
  return rows;
}

json rate_rows_json(const std::vector<AttentionRateTable::Row>& rows) {
  json j = json::object();
  for (const AttentionRateTable::Row& row : rows) {
    json points = json::object();
    for (const auto& [sequence, rate] : row.points)
      points[fmt::format("{}", sequence)] = rate / 1e12;
    j[fmt::format("{}", row.head_dim)] = points;
  }
  return j;
}

}  // namespace

double Accelerator::sustained_attention_flops(const std::string& backend, double head_dim,
                                              double sequence, bool backward) const {
  const std::string& kernel = backend == "auto" ? attention_auto : backend;
  for (const auto& [name, table] : attention_kernels)
    if (name == kernel) {
      const double rate = table.rate(head_dim, sequence, backward);
      if (rate > 0) return rate * power_limited_clock_share;
    }
  return backward ? sustained_attention_backward_flops() : sustained_attention_flops();
}

std::vector<std::string> Accelerator::preset_names() {
  std::vector<std::string> names;
  for (const auto& [name, text] : detail::accelerator_presets())
    names.emplace_back(name);
  return names;
}

Accelerator Accelerator::parse(std::string_view text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw std::invalid_argument(
        fmt::format("accelerator {} is not valid JSON: {}", source, e.what()));
  }
  if (!j.is_object())
    throw std::invalid_argument(fmt::format("accelerator {} must hold a JSON object", source));
  Accelerator a;
  a.name = text_or(j, "name", source);
  a.peak_flops = positive(j, "peak_flops", source);
  a.matmul_efficiency = share(j, "matmul_efficiency", source);
  a.attention_efficiency = j.contains("attention_efficiency")
                               ? share(j, "attention_efficiency", source)
                               : a.matmul_efficiency;
  a.attention_backward_efficiency = j.contains("attention_backward_efficiency")
                                        ? share(j, "attention_backward_efficiency", source)
                                        : a.attention_efficiency;
  if (j.contains("attention_kernels")) {
    const json& kernels = j.at("attention_kernels");
    if (!kernels.is_object())
      throw std::invalid_argument(fmt::format(
          "accelerator {}: 'attention_kernels' must map backend names (flash, fused) to tables",
          source));
    for (const auto& [backend, k] : kernels.items()) {
      const std::string where = fmt::format("{} (attention_kernels.{})", source, backend);
      if (!k.is_object() || !k.contains("forward"))
        throw std::invalid_argument(fmt::format(
            "accelerator {} must be an object with kernel, forward and backward", where));
      AttentionRateTable table{.kernel = text_or(k, "kernel", backend),
                               .forward = rate_rows(k.at("forward"), where + " forward"),
                               .backward = {}};
      if (k.contains("backward")) table.backward = rate_rows(k.at("backward"), where + " backward");
      a.attention_kernels.emplace_back(backend, std::move(table));
    }
  }
  a.attention_auto = text_or(j, "attention_auto", "");
  if (!a.attention_auto.empty() &&
      std::none_of(a.attention_kernels.begin(), a.attention_kernels.end(),
                   [&](const auto& k) { return k.first == a.attention_auto; }))
    throw std::invalid_argument(fmt::format(
        "accelerator {}: 'attention_auto' names '{}', which 'attention_kernels' does not hold",
        source, a.attention_auto));
  if (j.contains("power_limited_clock_share"))
    a.power_limited_clock_share = share(j, "power_limited_clock_share", source);
  if (j.contains("matmul_overhead_dimension")) {
    const json& d = j.at("matmul_overhead_dimension");
    const double rows = d.is_number() ? d.get<double>() : -1;
    if (!(rows >= 0) || rows > 1e6)
      throw std::invalid_argument(fmt::format(
          "accelerator {}: 'matmul_overhead_dimension' must be a number of rows in [0, 10^6], "
          "got {}",
          source, d.dump()));
    a.matmul_overhead_dimension = rows;
  }
  const double memory = positive(j, "memory_bytes", source);
  if (memory > 0x1p62)
    throw std::invalid_argument(fmt::format(
        "accelerator {}: 'memory_bytes' ({}) is more than a device can hold: give bytes", source,
        memory));
  a.memory_bytes = static_cast<std::int64_t>(memory);
  a.memory_bandwidth = positive(j, "memory_bandwidth", source);
  a.memory_efficiency = share(j, "memory_efficiency", source);
  if (j.contains("kernel_launch_us")) {
    const json& k = j.at("kernel_launch_us");
    const double us = k.is_number() ? k.get<double>() : -1;
    if (!(us >= 0) || us > 1e3)
      throw std::invalid_argument(fmt::format(
          "accelerator {}: 'kernel_launch_us' must be microseconds in [0, 1000], got {}", source,
          k.dump()));
    a.kernel_launch_us = us;
  }
  const double per_node = positive(j, "devices_per_node", source);
  if (per_node > 1e6 || per_node != std::floor(per_node))
    throw std::invalid_argument(
        fmt::format("accelerator {}: 'devices_per_node' must be a whole number up to 10^6, got {}",
                    source, per_node));
  a.devices_per_node = static_cast<int>(per_node);
  a.node_link = link(j, "node_link", source);
  a.network = link(j, "network", source);
  if (j.contains("sources") && j.at("sources").is_array())
    for (const json& s : j.at("sources"))
      if (s.is_string()) a.sources.push_back(s.get<std::string>());
  if (j.contains("figure_sources") && j.at("figure_sources").is_object())
    for (const auto& [field, text] : j.at("figure_sources").items())
      if (text.is_string()) a.figure_sources.emplace_back(field, text.get<std::string>());
  a.assumed = text_or(j, "assumed", "");
  return a;
}

std::string Accelerator::to_json() const {
  auto link_json = [](const NetworkLink& l) {
    return nlohmann::ordered_json{{"name", l.name},
                                  {"bytes_per_second", l.bytes_per_second},
                                  {"latency_us", l.latency_us},
                                  {"bus_efficiency", l.bus_efficiency},
                                  {"full_mesh", l.full_mesh}};
  };
  // In the order the shipped presets are written, for a file a person reads and edits.
  nlohmann::ordered_json figures = nlohmann::ordered_json::object();
  for (const auto& [field, text] : figure_sources)
    figures[field] = text;
  nlohmann::ordered_json kernels = nlohmann::ordered_json::object();
  for (const auto& [backend, table] : attention_kernels)
    kernels[backend] = {{"kernel", table.kernel},
                        {"forward", rate_rows_json(table.forward)},
                        {"backward", rate_rows_json(table.backward)}};
  const nlohmann::ordered_json j = {
      {"name", name},
      {"peak_flops", peak_flops},
      {"matmul_efficiency", matmul_efficiency},
      {"matmul_overhead_dimension", matmul_overhead_dimension},
      {"attention_efficiency", attention_efficiency},
      {"attention_backward_efficiency", attention_backward_efficiency},
      {"attention_kernels", kernels},
      {"attention_auto", attention_auto},
      {"power_limited_clock_share", power_limited_clock_share},
      {"memory_bytes", memory_bytes},
      {"memory_bandwidth", memory_bandwidth},
      {"memory_efficiency", memory_efficiency},
      {"kernel_launch_us", kernel_launch_us},
      {"devices_per_node", devices_per_node},
      {"node_link", link_json(node_link)},
      {"network", link_json(network)},
      {"sources", sources},
      {"figure_sources", figures},
      {"assumed", assumed}};
  return j.dump(2) + "\n";
}

Accelerator Accelerator::load(const std::string& name_or_path) {
  for (const auto& [name, text] : detail::accelerator_presets())
    if (name == name_or_path) return parse(text, fmt::format("preset '{}'", name));
  const bool path = name_or_path.find('/') != std::string::npos || name_or_path.ends_with(".json");
  if (!path)
    throw std::invalid_argument(fmt::format(
        "unknown accelerator '{}': the presets are {} (or give a JSON file's path, a copy of "
        "one of them with your figures)",
        name_or_path, fmt::join(preset_names(), ", ")));
  // A regular file of a reasonable size: a description, not a device or a stream.
  std::error_code error;
  if (!std::filesystem::is_regular_file(name_or_path, error) ||
      std::filesystem::file_size(name_or_path, error) > (1u << 20) || error)
    throw std::invalid_argument(fmt::format(
        "the accelerator file '{}' is not a readable JSON file of at most 1 MiB", name_or_path));
  std::ifstream in(name_or_path, std::ios::binary);
  if (!in)
    throw std::invalid_argument(fmt::format("cannot read the accelerator file '{}'", name_or_path));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return parse(text, fmt::format("file '{}'", name_or_path));
}

}  // namespace weave::devices
