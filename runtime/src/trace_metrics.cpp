#include "weave/runtime/trace_metrics.hpp"

#include <algorithm>
#include <utility>

namespace weave::rt {

namespace {

using Intervals = std::vector<std::pair<Nanos, Nanos>>;

// Sorts and merges overlapping intervals in place.
void merge(Intervals& v) {
  std::sort(v.begin(), v.end());
  std::size_t out = 0;
  for (const auto& iv : v) {
    if (out > 0 && iv.first <= v[out - 1].second) {
      v[out - 1].second = std::max(v[out - 1].second, iv.second);
    } else {
      v[out++] = iv;
    }
  }
  v.resize(out);
}

Nanos length(const Intervals& merged) {
  Nanos n = 0;
  for (const auto& [a, b] : merged)
    n += b - a;
  return n;
}

// Length of the intersection of two merged interval lists.
Nanos overlap(const Intervals& x, const Intervals& y) {
  Nanos n = 0;
  for (std::size_t i = 0, j = 0; i < x.size() && j < y.size();) {
    const Nanos lo = std::max(x[i].first, y[j].first);
    const Nanos hi = std::min(x[i].second, y[j].second);
    if (hi > lo) n += hi - lo;
    (x[i].second < y[j].second) ? ++i : ++j;
  }
  return n;
}

}  // namespace

namespace {

// The exposed time of the comm and copy tasks `chosen` picks, summed over devices.
template <typename Choose>
Nanos exposed_comm_of(const Trace& trace, Choose chosen) {
  const TaskTable& tasks = trace.tasks();
  std::vector<Intervals> compute(tasks.device_count()), named(tasks.device_count());
  for (const Span& s : trace.spans()) {
    const TaskInfo& info = tasks[s.task];
    if (info.kind == TaskKind::compute) {
      compute[info.device].emplace_back(s.start, s.end);
    } else if ((info.kind == TaskKind::comm || info.kind == TaskKind::copy) && chosen(s.task)) {
      named[info.device].emplace_back(s.start, s.end);
    }
  }
  Nanos exposed = 0;
  for (std::size_t d = 0; d < named.size(); ++d) {
    merge(compute[d]);
    merge(named[d]);
    exposed += length(named[d]) - overlap(named[d], compute[d]);
  }
  return exposed;
}

}  // namespace

Nanos exposed_comm_named(const Trace& trace, std::span<const std::string_view> name_parts) {
  return exposed_comm_of(trace, [&](TaskId t) {
    const std::string_view name = trace.tasks().name(t);
    return std::any_of(name_parts.begin(), name_parts.end(), [&](std::string_view part) {
      return name.find(part) != std::string_view::npos;
    });
  });
}

Nanos exposed_comm_on_stream_kinds(const Trace& trace, std::span<const StreamKind> kinds) {
  return exposed_comm_of(trace, [&](TaskId t) {
    const StreamKind kind = trace.tasks().stream_kind(trace.tasks()[t].stream);
    return std::find(kinds.begin(), kinds.end(), kind) != kinds.end();
  });
}

Nanos exposed_comm_on_stream_ids(const Trace& trace, std::span<const StreamId> streams) {
  return exposed_comm_of(trace, [&](TaskId t) {
    return std::find(streams.begin(), streams.end(), trace.tasks()[t].stream) != streams.end();
  });
}

std::vector<Nanos> exposed_comm_on_stream_sets(const Trace& trace,
                                               std::span<const std::vector<StreamId>> sets) {
  const TaskTable& tasks = trace.tasks();
  std::vector<std::vector<std::size_t>> sets_of(tasks.stream_count());
  for (std::size_t k = 0; k < sets.size(); ++k)
    for (StreamId s : sets[k])
      if (s < sets_of.size()) sets_of[s].push_back(k);
  const std::size_t devices = tasks.device_count();
  std::vector<Intervals> compute(devices), named(devices * sets.size());
  for (const Span& s : trace.spans()) {
    const TaskInfo& info = tasks[s.task];
    if (info.kind == TaskKind::compute) {
      compute[info.device].emplace_back(s.start, s.end);
    } else if (info.kind == TaskKind::comm || info.kind == TaskKind::copy) {
      for (std::size_t k : sets_of[info.stream])
        named[k * devices + info.device].emplace_back(s.start, s.end);
    }
  }
  for (Intervals& c : compute)
    merge(c);
  std::vector<Nanos> exposed(sets.size(), 0);
  for (std::size_t k = 0; k < sets.size(); ++k)
    for (std::size_t d = 0; d < devices; ++d) {
      Intervals& n = named[k * devices + d];
      merge(n);
      exposed[k] += length(n) - overlap(n, compute[d]);
    }
  return exposed;
}

Nanos exposed_comm_on_streams(const Trace& trace, std::span<const std::string_view> prefixes) {
  return exposed_comm_of(trace, [&](TaskId t) {
    const std::string_view stream = trace.tasks().stream_name(trace.tasks()[t].stream);
    return std::any_of(prefixes.begin(), prefixes.end(),
                       [&](std::string_view prefix) { return stream.starts_with(prefix); });
  });
}

Nanos exposed_comm_on_named_streams(const Trace& trace, std::span<const std::string_view> names) {
  return exposed_comm_of(trace, [&](TaskId t) {
    const std::string_view stream = trace.tasks().stream_name(trace.tasks()[t].stream);
    return std::find(names.begin(), names.end(), stream) != names.end();
  });
}

TraceMetrics measure(const Trace& trace) {
  TraceMetrics m;
  if (trace.empty()) return m;
  const TaskTable& tasks = trace.tasks();
  Nanos first = trace.spans().front().start, last = trace.spans().front().end;
  for (const Span& s : trace.spans()) {
    first = std::min(first, s.start);
    last = std::max(last, s.end);
  }
  m.start = first;
  m.makespan = last - first;

  const std::size_t devices = tasks.device_count();
  std::vector<Intervals> compute(devices), comm(devices), all(devices);
  std::vector<std::vector<Intervals>> streams(devices,
                                              std::vector<Intervals>(tasks.stream_count()));
  for (const Span& s : trace.spans()) {
    const TaskInfo& info = tasks[s.task];
    const std::pair<Nanos, Nanos> iv{s.start, s.end};
    all[info.device].push_back(iv);
    streams[info.device][info.stream].push_back(iv);
    if (info.kind == TaskKind::compute) compute[info.device].push_back(iv);
    if (info.kind == TaskKind::comm || info.kind == TaskKind::copy) comm[info.device].push_back(iv);
  }
  m.devices.resize(devices);
  for (std::size_t d = 0; d < devices; ++d) {
    DeviceMetrics& dm = m.devices[d];
    merge(compute[d]);
    merge(comm[d]);
    merge(all[d]);
    dm.compute_busy = length(compute[d]);
    dm.comm_busy = length(comm[d]);
    dm.exposed_comm = dm.comm_busy - overlap(comm[d], compute[d]);
    dm.busy = length(all[d]);
    dm.idle_fraction =
        m.makespan > 0 ? 1.0 - static_cast<double>(dm.busy) / static_cast<double>(m.makespan) : 0;
    dm.stream_busy.resize(tasks.stream_count());
    for (std::size_t s = 0; s < tasks.stream_count(); ++s) {
      merge(streams[d][s]);
      dm.stream_busy[s] = length(streams[d][s]);
    }
  }
  return m;
}

Nanos TraceMetrics::total_compute() const {
  Nanos n = 0;
  for (const auto& d : devices)
    n += d.compute_busy;
  return n;
}
Nanos TraceMetrics::total_comm() const {
  Nanos n = 0;
  for (const auto& d : devices)
    n += d.comm_busy;
  return n;
}
Nanos TraceMetrics::total_exposed_comm() const {
  Nanos n = 0;
  for (const auto& d : devices)
    n += d.exposed_comm;
  return n;
}
double TraceMetrics::exposed_comm_share() const {
  Nanos busy = 0;
  for (const auto& d : devices)
    busy += d.busy;
  return busy > 0 ? static_cast<double>(total_exposed_comm()) / static_cast<double>(busy) : 0;
}

Nanos TraceMetrics::total_compute_idle() const {
  Nanos idle = 0;
  for (const auto& d : devices)
    if (d.busy > 0) idle += makespan - d.compute_busy;
  return idle;
}

double TraceMetrics::compute_bubble() const {
  const Nanos busy = total_compute();
  return busy > 0 ? static_cast<double>(total_compute_idle()) / static_cast<double>(busy) : 0;
}

}  // namespace weave::rt
