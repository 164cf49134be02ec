// Reading Chrome trace-event JSON back into a Trace.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "weave/runtime/chrome_trace.hpp"

namespace weave::rt {

namespace {

using nlohmann::json;

TaskKind kind_of(const json& category) {
  if (!category.is_string()) return TaskKind::compute;
  const std::string c = category.get<std::string>();
  if (c == "comm") return TaskKind::comm;
  if (c == "copy") return TaskKind::copy;
  if (c == "host") return TaskKind::host;
  return TaskKind::compute;
}

Phase phase_of(const json& args) {
  if (!args.contains("phase") || !args["phase"].is_string()) return Phase::none;
  const std::string p = args["phase"].get<std::string>();
  if (p == "F") return Phase::forward;
  if (p == "B") return Phase::backward;
  if (p == "W") return Phase::weight;
  return Phase::none;
}

std::int32_t tag_of(const json& args, const char* key) {
  if (!args.contains(key) || !args[key].is_number_integer()) return -1;
  return args[key].get<std::int32_t>();
}

double number_of(const json& args, const char* key) {
  if (!args.contains(key) || !args[key].is_number()) return 0;
  return args[key].get<double>();
}

// Microseconds (the format's unit) to whole nanoseconds.
Nanos nanos_of(double us) {
  return static_cast<Nanos>(std::llround(us * 1000.0));
}

}  // namespace

Trace read_chrome_trace(std::istream& in, const std::string& source) {
  json doc;
  try {
    doc = json::parse(in);
  } catch (const json::parse_error& e) {
    throw std::runtime_error(fmt::format("{} is not JSON: {}", source, e.what()));
  }
  const json* events = nullptr;
  if (doc.is_array()) {
    events = &doc;
  } else if (doc.is_object() && doc.contains("traceEvents") && doc["traceEvents"].is_array()) {
    events = &doc["traceEvents"];
  } else {
    throw std::runtime_error(fmt::format(
        "{} holds no trace events: expected an array or an object with a \"traceEvents\" array",
        source));
  }
  ClockKind clock = ClockKind::wall;
  if (doc.is_object() && doc.contains("otherData") && doc["otherData"].is_object() &&
      doc["otherData"].value("clock", std::string()) == "virtual")
    clock = ClockKind::virtual_time;

  // The streams' names, from the thread_name metadata.
  std::map<std::pair<std::int64_t, std::int64_t>, std::string> thread_names;
  for (const json& e : *events)
    if (e.is_object() && e.value("ph", std::string()) == "M" &&
        e.value("name", std::string()) == "thread_name" && e.contains("pid") &&
        e["pid"].is_number_integer() && e.contains("tid") && e["tid"].is_number_integer() &&
        e.contains("args") && e["args"].is_object() && e["args"].contains("name") &&
        e["args"]["name"].is_string())
      thread_names[{e["pid"].get<std::int64_t>(), e["tid"].get<std::int64_t>()}] =
          e["args"]["name"].get<std::string>();

  struct Event {
    std::int64_t order;  // the task id it was written with, or its place in the file
    TaskInfo info;
    std::string name, stream;
    Nanos start, end;
  };
  std::vector<Event> read;
  std::int64_t index = -1;
  for (const json& e : *events) {
    ++index;
    if (!e.is_object() || e.value("ph", std::string()) != "X") continue;
    auto require = [&](const char* key, bool integer) -> const json& {
      if (!e.contains(key) || !(integer ? e[key].is_number_integer() : e[key].is_number()))
        throw std::runtime_error(fmt::format(
            "{}: event {} (\"X\") has no numeric \"{}\"; a complete event needs pid, tid, ts "
            "and dur",
            source, index, key));
      return e[key];
    };
    const std::int64_t pid = require("pid", true).get<std::int64_t>();
    const std::int64_t tid = require("tid", true).get<std::int64_t>();
    const double ts = require("ts", false).get<double>();
    const double dur = require("dur", false).get<double>();
    if (pid < 0 || pid > std::numeric_limits<std::int32_t>::max() || dur < 0)
      throw std::runtime_error(fmt::format(
          "{}: event {} has pid {} and dur {}: a device is a non-negative pid and a span does "
          "not end before it starts",
          source, index, pid, dur));
    const json args = e.contains("args") && e["args"].is_object() ? e["args"] : json::object();
    Event ev;
    ev.order = args.contains("task") && args["task"].is_number_integer()
                   ? args["task"].get<std::int64_t>()
                   : index;
    ev.info.device = static_cast<DeviceId>(pid);
    ev.info.kind = kind_of(e.contains("cat") ? e["cat"] : json());
    ev.info.tags = {.layer = tag_of(args, "layer"),
                    .micro_batch = tag_of(args, "micro_batch"),
                    .virtual_stage = tag_of(args, "virtual_stage"),
                    .chunk = tag_of(args, "chunk"),
                    .phase = phase_of(args)};
    ev.info.cost = {.flops = number_of(args, "flops"), .bytes = number_of(args, "bytes")};
    ev.name = e.contains("name") && e["name"].is_string() ? e["name"].get<std::string>() : "";
    const auto named = thread_names.find({pid, tid});
    ev.stream = named != thread_names.end() ? named->second : fmt::format("tid{}", tid);
    ev.start = nanos_of(ts);
    ev.end = ev.start + nanos_of(dur);
    read.push_back(std::move(ev));
  }
  std::stable_sort(read.begin(), read.end(),
                   [](const Event& a, const Event& b) { return a.order < b.order; });
  auto table = std::make_shared<TaskTable>();
  std::vector<Span> spans;
  spans.reserve(read.size());
  for (Event& ev : read) {
    ev.info.stream = table->stream(ev.stream.empty() ? "unnamed" : ev.stream);
    const TaskId id = table->add(ev.info, ev.name);
    spans.push_back({.task = id, .start = ev.start, .end = ev.end});
  }
  return Trace(std::move(table), std::move(spans), clock);
}

Trace read_chrome_trace(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw std::runtime_error(fmt::format("cannot open trace '{}'", path));
  return read_chrome_trace(file, path);
}

}  // namespace weave::rt
