// Chrome traces of several processes merged onto one timeline.
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "weave/runtime/chrome_trace.hpp"

namespace weave::rt {

void merge_chrome_traces(std::span<const std::string> traces, std::span<const Nanos> shifts,
                         const std::string& path) {
  if (traces.size() != shifts.size())
    throw std::invalid_argument(fmt::format("merging {} traces with {} shifts: give one per trace",
                                            traces.size(), shifts.size()));
  nlohmann::json merged{{"displayTimeUnit", "ns"},
                        {"otherData", {{"clock", "wall"}, {"processes", traces.size()}}},
                        {"traceEvents", nlohmann::json::array()}};
  nlohmann::json& events = merged["traceEvents"];
  for (std::size_t i = 0; i < traces.size(); ++i) {
    nlohmann::json one;
    try {
      one = nlohmann::json::parse(traces[i]);
    } catch (const nlohmann::json::exception& e) {
      throw std::runtime_error(fmt::format("trace of process {} is not JSON: {}", i, e.what()));
    }
    if (!one.contains("traceEvents") || !one["traceEvents"].is_array())
      throw std::runtime_error(fmt::format("trace of process {} has no traceEvents array", i));
    if (i == 0 && one.contains("otherData") && one["otherData"].contains("clock"))
      merged["otherData"]["clock"] = one["otherData"]["clock"];
    const double shift_us = static_cast<double>(shifts[i]) * 1e-3;
    for (nlohmann::json& e : one["traceEvents"]) {
      if (e.contains("ts") && e["ts"].is_number()) e["ts"] = e["ts"].get<double>() + shift_us;
      events.push_back(std::move(e));
    }
  }
  const std::string temporary = path + ".partial";
  {
    std::ofstream file(temporary, std::ios::binary | std::ios::trunc);
    if (!file)
      throw std::runtime_error(
          fmt::format("cannot write trace '{}': cannot create '{}'", path, temporary));
    file << merged.dump() << "\n";
    file.flush();
    if (!file) {
      std::remove(temporary.c_str());
      throw std::runtime_error(
          fmt::format("cannot write trace '{}': write failed (disk full?)", path));
    }
  }
  std::filesystem::rename(temporary, path);
}

}  // namespace weave::rt
