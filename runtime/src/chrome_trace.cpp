#include "weave/runtime/chrome_trace.hpp"

#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <set>
#include <stdexcept>

#include "escape.hpp"
#include "weave/runtime/trace_metrics.hpp"

namespace weave::rt {

namespace {

// Microseconds with nanosecond precision, as the format wants.
void append_us(std::string& out, Nanos ns) {
  const char* sign = ns < 0 ? "-" : "";
  const Nanos a = ns < 0 ? -ns : ns;
  fmt::format_to(std::back_inserter(out), "{}{}.{:03}", sign, a / 1000, a % 1000);
}

void append_tag(std::string& out, const char* key, std::int32_t value) {
  if (value >= 0) fmt::format_to(std::back_inserter(out), ",\"{}\":{}", key, value);
}

}  // namespace

void write_chrome_trace(const Trace& trace, std::ostream& out) {
  std::string buf;
  buf.reserve(1 << 20);
  auto flush = [&](bool force) {
    if (force || buf.size() > (1 << 20)) {
      out.write(buf.data(), static_cast<std::streamsize>(buf.size()));
      buf.clear();
    }
  };
  const TraceMetrics metrics = measure(trace);
  fmt::format_to(std::back_inserter(buf),
                 "{{\"displayTimeUnit\":\"ns\",\"otherData\":{{\"clock\":\"{}\","
                 "\"makespan_ns\":{},\"exposed_comm_ns\":{},\"tasks\":{}}},\"traceEvents\":[",
                 trace.clock() == ClockKind::wall ? "wall" : "virtual", metrics.makespan,
                 metrics.total_exposed_comm(), trace.spans().size());
  bool first = true;
  auto sep = [&] {
    if (!first) buf += ",\n";
    first = false;
  };
  if (trace.empty()) {
    buf += "]}\n";
    flush(true);
    return;
  }
  const TaskTable& tasks = trace.tasks();

  // Metadata: a process per device, a thread per stream that ran something.
  std::set<std::pair<DeviceId, StreamId>> used;
  for (const Span& s : trace.spans())
    used.emplace(tasks[s.task].device, tasks[s.task].stream);
  DeviceId last_device = kNoTask;
  for (const auto& [device, stream] : used) {
    if (device != last_device) {
      sep();
      fmt::format_to(
          std::back_inserter(buf),
          "{{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":{},\"args\":{{\"name\":"
          "\"device {}\"}}}},\n{{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":{},"
          "\"args\":{{\"sort_index\":{}}}}}",
          device, device, device, device);
      last_device = device;
    }
    sep();
    fmt::format_to(std::back_inserter(buf),
                   "{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{},\"tid\":{},\"args\":{{"
                   "\"name\":\"",
                   device, stream);
    detail::append_json_escaped(buf, tasks.stream_name(stream));
    fmt::format_to(std::back_inserter(buf),
                   "\"}}}},\n{{\"ph\":\"M\",\"name\":\"thread_sort_index\",\"pid\":{},\"tid\":{},"
                   "\"args\":{{\"sort_index\":{}}}}}",
                   device, stream, stream);
  }

  for (const Span& s : trace.spans()) {
    const TaskInfo& info = tasks[s.task];
    sep();
    buf += "{\"name\":\"";
    detail::append_json_escaped(buf, tasks.name(s.task));
    fmt::format_to(std::back_inserter(buf),
                   "\",\"cat\":\"{}\",\"ph\":\"X\",\"pid\":{},\"tid\":{},\"ts\":",
                   to_string(info.kind), info.device, info.stream);
    append_us(buf, s.start);
    buf += ",\"dur\":";
    append_us(buf, s.end - s.start);
    fmt::format_to(std::back_inserter(buf), ",\"args\":{{\"task\":{}", s.task);
    append_tag(buf, "layer", info.tags.layer);
    append_tag(buf, "micro_batch", info.tags.micro_batch);
    append_tag(buf, "virtual_stage", info.tags.virtual_stage);
    append_tag(buf, "chunk", info.tags.chunk);
    if (info.tags.phase != Phase::none) {
      fmt::format_to(std::back_inserter(buf), ",\"phase\":\"{}\"", to_string(info.tags.phase));
    }
    if (info.cost.flops > 0)
      fmt::format_to(std::back_inserter(buf), ",\"flops\":{}", info.cost.flops);
    if (info.cost.bytes > 0)
      fmt::format_to(std::back_inserter(buf), ",\"bytes\":{}", info.cost.bytes);
    if (info.group != kNoGroup) {
      buf += ",\"rendezvous\":\"";
      detail::append_json_escaped(buf, tasks.group_name(info.group));
      buf += '"';
    }
    buf += "}}";
    flush(false);
  }
  buf += "]}\n";
  flush(true);
}

void write_chrome_trace(const Trace& trace, const std::string& path) {
  const std::string temporary = path + ".partial";
  {
    std::ofstream file(temporary, std::ios::binary | std::ios::trunc);
    if (!file) {
      throw std::runtime_error(
          fmt::format("cannot write trace '{}': cannot create '{}'", path, temporary));
    }
    write_chrome_trace(trace, file);
    file.flush();
    if (!file) {
      std::remove(temporary.c_str());
      throw std::runtime_error(
          fmt::format("cannot write trace '{}': write failed (disk full?)", path));
    }
  }
  std::error_code ec;
  std::filesystem::rename(temporary, path, ec);
  if (ec) {
    std::remove(temporary.c_str());
    throw std::runtime_error(fmt::format("cannot write trace '{}': {}", path, ec.message()));
  }
}

}  // namespace weave::rt
