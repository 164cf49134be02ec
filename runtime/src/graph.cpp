#include "weave/runtime/graph.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "graph_data.hpp"
#include "weave/runtime/error.hpp"

namespace weave::rt {

// ---------------------------------------------------------------------------------- Graph

namespace {
std::shared_ptr<const detail::GraphData> empty_graph() {
  static const auto data = [] {
    auto d = std::make_shared<detail::GraphData>();
    d->table = std::make_shared<TaskTable>();
    d->succ_begin.push_back(0);
    return d;
  }();
  return data;
}
}  // namespace

Graph::Graph() : data_(empty_graph()) {}
Graph::Graph(std::shared_ptr<const detail::GraphData> data) : data_(std::move(data)) {}

std::size_t Graph::size() const {
  return data_->table->size();
}
const TaskTable& Graph::tasks() const {
  return *data_->table;
}
std::shared_ptr<const TaskTable> Graph::shared_tasks() const {
  return data_->table;
}
std::span<const TaskId> Graph::successors(TaskId t) const {
  const auto b = data_->succ_begin[t], e = data_->succ_begin[t + 1];
  return {data_->succ.data() + b, e - b};
}
std::span<const EdgeKind> Graph::successor_kinds(TaskId t) const {
  const auto b = data_->succ_begin[t], e = data_->succ_begin[t + 1];
  return {data_->succ_kind.data() + b, e - b};
}
std::uint32_t Graph::in_degree(TaskId t) const {
  return data_->in_degree[t];
}
std::span<const TaskId> Graph::sources() const {
  return data_->sources;
}
std::uint32_t Graph::sink_count() const {
  return data_->sinks;
}
const TaskFn& Graph::work(TaskId t) const {
  return data_->work[t];
}

// --------------------------------------------------------------------------- GraphBuilder

namespace {

struct Edge {
  TaskId from;
  TaskId to;
  EdgeKind kind;
};

struct EventUse {
  EventId event;
  std::uint64_t value;
  TaskId task;
};

}  // namespace

struct GraphBuilder::Impl {
  std::shared_ptr<TaskTable> table = std::make_shared<TaskTable>();
  detail::SegmentedArray<TaskFn> work;
  detail::SegmentedArray<Edge> edges;
  // Last task added on each (device, stream), to chain stream order as tasks arrive.
  std::vector<std::vector<TaskId>> last_on_stream;
  std::vector<std::string> event_names;
  std::vector<EventUse> signals;
  std::vector<EventUse> waits;
  // Whether an edge runs from a task to one added before it. Without such edges (and without
  // rendezvous, which merge tasks into one node) the order tasks were added in is a
  // topological order, so the graph is acyclic and build() skips the search for a cycle.
  // Stream order always runs forward.
  bool backward_edges = false;

  void check_task(TaskId t, const char* what) const {
    if (t >= table->size()) {
      throw std::invalid_argument(
          fmt::format("{}: task id {} does not exist ({} tasks added)", what, t, table->size()));
    }
  }
  void check_event(EventId e, const char* what) const {
    if (e >= event_names.size()) {
      throw std::invalid_argument(
          fmt::format("{}: event id {} does not exist ({} events made with event())", what, e,
                      event_names.size()));
    }
  }

  void resolve_events();
  std::shared_ptr<detail::GraphData> compile();
  void check_acyclic(const detail::GraphData& g) const;
  std::string describe_node(std::size_t node) const;
};

GraphBuilder::GraphBuilder() : impl_(std::make_unique<Impl>()) {}
GraphBuilder::~GraphBuilder() = default;
GraphBuilder::GraphBuilder(GraphBuilder&&) noexcept = default;
GraphBuilder& GraphBuilder::operator=(GraphBuilder&&) noexcept = default;

void GraphBuilder::reserve(std::size_t tasks, std::size_t edges) {
  impl_->work.reserve(tasks);
  impl_->edges.reserve(edges + tasks);
}

StreamId GraphBuilder::stream(std::string_view name, StreamKind kind) {
  return impl_->table->stream(name, kind);
}

StreamId GraphBuilder::streams(std::string_view prefix, std::size_t count, StreamKind kind) {
  return impl_->table->streams(prefix, count, kind);
}

StreamId GraphBuilder::anonymous_streams(std::size_t count, StreamKind kind) {
  return impl_->table->anonymous_streams(count, kind);
}

namespace {
// Asks for the cache line 1 KiB past `row` for writing. add() and precede() append rows (88 bytes
// of TaskInfo, 32 of work, 12 per edge) to arrays of megabytes whose lines are not in the cache,
// and with only the hardware prefetcher each row's stores waited for their lines to arrive:
// asking early took the 100,000-task chain of bench_runtime's BM_WeaveBuild from 19.5 to 15 ns
// per task. The address may lie past the array's end; a prefetch never faults.
template <class T>
void prefetch_ahead(const T* row) {
  constexpr std::uintptr_t kAhead = 1024;
  const auto at = reinterpret_cast<std::uintptr_t>(row) + kAhead;
  __builtin_prefetch(reinterpret_cast<const void*>(at), 1);
  // A row longer than a line moves the address by more than a line per call: without the next
  // line too, some lines of the 88-byte task rows would never be asked for.
  if constexpr (sizeof(T) > 64) __builtin_prefetch(reinterpret_cast<const void*>(at + 64), 1);
}
}  // namespace

TaskId GraphBuilder::add(const TaskSpec& spec, TaskFn work) {
  Impl& b = *impl_;
  const auto id = static_cast<TaskId>(b.table->size());
  TaskInfo& info = b.table->append(spec.device, spec.stream, spec.name);
  info.kind = spec.kind;
  info.tags = spec.tags;
  info.cost = spec.cost;
  b.work.push_back(std::move(work));
  prefetch_ahead(&info);
  prefetch_ahead(&b.work.back());
  if (b.last_on_stream.size() <= spec.device) b.last_on_stream.resize(spec.device + 1);
  auto& lasts = b.last_on_stream[spec.device];
  if (lasts.size() <= spec.stream) lasts.resize(b.table->stream_count(), kNoTask);
  if (lasts[spec.stream] != kNoTask) {
    b.edges.push_back({lasts[spec.stream], id, EdgeKind::stream_order});
    prefetch_ahead(&b.edges.back());
  }
  lasts[spec.stream] = id;
  return id;
}

void GraphBuilder::precede(TaskId before, TaskId after) {
  impl_->check_task(before, "precede");
  impl_->check_task(after, "precede");
  if (before == after) {
    throw std::invalid_argument(
        fmt::format("precede: task '{}' cannot depend on itself", impl_->table->name(before)));
  }
  impl_->edges.push_back({before, after, EdgeKind::explicit_dependency});
  prefetch_ahead(&impl_->edges.back());
  if (before > after) impl_->backward_edges = true;
}

EventId GraphBuilder::event(std::string_view name) {
  impl_->event_names.emplace_back(name.empty() ? fmt::format("event{}", impl_->event_names.size())
                                               : std::string(name));
  return static_cast<EventId>(impl_->event_names.size() - 1);
}

void GraphBuilder::signal(TaskId task, EventId event, std::uint64_t value) {
  impl_->check_task(task, "signal");
  impl_->check_event(event, "signal");
  impl_->signals.push_back({event, value, task});
}

void GraphBuilder::wait(TaskId task, EventId event, std::uint64_t value) {
  impl_->check_task(task, "wait");
  impl_->check_event(event, "wait");
  impl_->waits.push_back({event, value, task});
}

GroupId GraphBuilder::rendezvous(std::string_view name, std::span<const TaskId> members) {
  return impl_->table->add_group(
      name.empty() ? fmt::format("rendezvous{}", impl_->table->group_count()) : std::string(name),
      members);
}

std::size_t GraphBuilder::size() const {
  return impl_->table->size();
}

// A wait for value v is satisfied by the signal with the smallest value >= v: the first time
// the timeline reaches v.
void GraphBuilder::Impl::resolve_events() {
  auto by_event_value = [](const EventUse& a, const EventUse& b) {
    return a.event != b.event ? a.event < b.event : a.value < b.value;
  };
  std::sort(signals.begin(), signals.end(), by_event_value);
  for (std::size_t i = 1; i < signals.size(); ++i) {
    if (signals[i].event == signals[i - 1].event && signals[i].value == signals[i - 1].value) {
      throw GraphError(fmt::format(
          "event '{}' is signalled to {} twice (by '{}' and '{}'); a timeline value is reached "
          "once, give each signal its own value",
          event_names[signals[i].event], signals[i].value, table->name(signals[i - 1].task),
          table->name(signals[i].task)));
    }
  }
  for (const EventUse& w : waits) {
    auto it = std::lower_bound(signals.begin(), signals.end(), EventUse{w.event, w.value, 0},
                               by_event_value);
    if (it == signals.end() || it->event != w.event) {
      std::string highest = "it is never signalled";
      auto last = std::upper_bound(signals.begin(), signals.end(), EventUse{w.event, UINT64_MAX, 0},
                                   by_event_value);
      if (last != signals.begin() && std::prev(last)->event == w.event) {
        highest = fmt::format("the highest signal is {} by '{}'", std::prev(last)->value,
                              table->name(std::prev(last)->task));
      }
      throw GraphError(fmt::format(
          "task '{}' waits for event '{}' to reach {}, but {}; it would wait forever. Signal the "
          "event to at least {} or lower the wait",
          table->name(w.task), event_names[w.event], w.value, highest, w.value));
    }
    if (it->task == w.task) {
      throw GraphError(fmt::format("task '{}' waits for event '{}' >= {}, which it signals itself",
                                   table->name(w.task), event_names[w.event], w.value));
    }
    edges.push_back({it->task, w.task, EdgeKind::event});
    if (it->task > w.task) backward_edges = true;
  }
}

std::shared_ptr<detail::GraphData> GraphBuilder::Impl::compile() {
  const std::size_t n = table->size();
  auto g = std::make_shared<detail::GraphData>();
  g->table = table;
  g->succ_begin.assign(n + 1, 0);
  g->in_degree.assign(n, 0);
  // Edges come in runs from one task (a fan-out) or into one (a fan-in). Counting each in
  // memory makes every increment of a run wait for the previous one's store; a run's count is
  // kept in a register instead and written once the run ends.
  std::uint32_t* const out = g->succ_begin.data();
  std::uint32_t* const in = g->in_degree.data();
  TaskId run_from = edges.empty() ? 0 : edges[0].from, run_to = edges.empty() ? 0 : edges[0].to;
  std::uint32_t from_count = 0, to_count = 0;
  for (unsigned k = 0; k < edges.segment_count(); ++k) {
    for (const Edge& e : edges.segment(k)) {
      if (e.from != run_from) {
        out[run_from] += from_count;
        run_from = e.from;
        from_count = 0;
      }
      if (e.to != run_to) {
        in[run_to] += to_count;
        run_to = e.to;
        to_count = 0;
      }
      ++from_count;
      ++to_count;
    }
  }
  if (!edges.empty()) {
    out[run_from] += from_count;
    in[run_to] += to_count;
  }
  // Inclusive prefix sums make succ_begin[t] the end of row t; filling each row backwards
  // (walking the edges from last to first) moves it to the row's start and keeps the edges of
  // a row in the order they were added. The row being filled keeps its cursor in a register
  // for the same reason as above.
  for (std::size_t t = 1; t < n; ++t)
    out[t] += out[t - 1];
  out[n] = static_cast<std::uint32_t>(edges.size());
  g->succ.resize(edges.size());
  g->succ_kind.resize(edges.size());
  TaskId* const succ = g->succ.data();
  EdgeKind* const succ_kind = g->succ_kind.data();
  TaskId row = edges.empty() ? 0 : edges.back().from;
  std::uint32_t cursor = out[row];
  for (unsigned k = edges.segment_count(); k-- > 0;) {
    const auto segment = edges.segment(k);
    for (auto e = segment.rbegin(); e != segment.rend(); ++e) {
      if (e->from != row) {
        out[row] = cursor;
        row = e->from;
        cursor = out[row];
      }
      const auto at = --cursor;
      succ[at] = e->to;
      succ_kind[at] = e->kind;
    }
  }
  if (!edges.empty()) out[row] = cursor;
  for (TaskId t = 0; t < n; ++t) {
    if (g->in_degree[t] == 0) g->sources.push_back(t);
    if (g->succ_begin[t + 1] == g->succ_begin[t]) ++g->sinks;
  }
  return g;
}

std::string GraphBuilder::Impl::describe_node(std::size_t node) const {
  if (node < table->size()) return fmt::format("'{}'", table->name(static_cast<TaskId>(node)));
  const auto g = static_cast<GroupId>(node - table->size());
  std::string s = fmt::format("rendezvous '{}' (", table->group_name(g));
  const auto members = table->members(g);
  for (std::size_t i = 0; i < members.size(); ++i) {
    if (i) s += ", ";
    if (i == 3 && members.size() > 4) {
      s += fmt::format("... {} more", members.size() - 3);
      break;
    }
    s += fmt::format("'{}'", table->name(members[i]));
  }
  return s + ")";
}

// Kahn's algorithm over tasks with each rendezvous merged into one node: the members of a
// rendezvous start together, so an edge into any member gates all of them.
void GraphBuilder::Impl::check_acyclic(const detail::GraphData& g) const {
  const std::size_t n = table->size();
  if (table->group_count() == 0 && !backward_edges) return;
  if (table->group_count() == 0) {
    // Common case, and the one that must be fast: plain Kahn over the compiled rows.
    std::vector<std::uint32_t> indeg(g.in_degree.begin(), g.in_degree.end());
    std::vector<TaskId> ready(g.sources);
    ready.reserve(n);
    for (std::size_t head = 0; head < ready.size(); ++head) {
      const TaskId t = ready[head];
      for (auto i = g.succ_begin[t]; i < g.succ_begin[t + 1]; ++i) {
        if (--indeg[g.succ[i]] == 0) ready.push_back(g.succ[i]);
      }
    }
    if (ready.size() == n) return;
  }
  const std::size_t nodes = n + table->group_count();
  auto node_of = [&](TaskId t) -> std::size_t {
    const GroupId grp = (*table)[t].group;
    return grp == kNoGroup ? t : n + grp;
  };
  std::vector<std::uint32_t> indeg(nodes, 0);
  for (TaskId t = 0; t < n; ++t) {
    const auto from = node_of(t);
    for (auto i = g.succ_begin[t]; i < g.succ_begin[t + 1]; ++i) {
      const auto to = node_of(g.succ[i]);
      if (from == to && from >= n) {
        throw GraphError(fmt::format(
            "task '{}' depends on '{}', but both are members of rendezvous '{}': members start "
            "together, so neither can wait for the other; drop the dependency or split the "
            "rendezvous",
            table->name(g.succ[i]), table->name(t), table->group_name((*table)[t].group)));
      }
      ++indeg[to];
    }
  }
  // Members are represented by their rendezvous node only.
  std::size_t real_nodes = nodes;
  std::vector<std::size_t> ready;
  ready.reserve(nodes);
  for (std::size_t v = 0; v < nodes; ++v) {
    if (v < n && (*table)[static_cast<TaskId>(v)].group != kNoGroup) {
      --real_nodes;
    } else if (indeg[v] == 0) {
      ready.push_back(v);
    }
  }
  auto release = [&](TaskId t) {
    for (auto i = g.succ_begin[t]; i < g.succ_begin[t + 1]; ++i) {
      if (--indeg[node_of(g.succ[i])] == 0) ready.push_back(node_of(g.succ[i]));
    }
  };
  std::size_t done = 0;
  for (std::size_t head = 0; head < ready.size(); ++head, ++done) {
    const std::size_t v = ready[head];
    if (v < n) {
      release(static_cast<TaskId>(v));
    } else {
      for (TaskId m : table->members(static_cast<GroupId>(v - n)))
        release(m);
    }
  }
  if (done == real_nodes) return;

  // Every node left over has a predecessor left over: walk predecessors until one repeats.
  std::vector<std::size_t> pred(nodes, SIZE_MAX);
  std::vector<EdgeKind> pred_kind(nodes, EdgeKind::explicit_dependency);
  for (TaskId t = 0; t < n; ++t) {
    if (indeg[node_of(t)] == 0) continue;  // processed: not on any cycle
    for (auto i = g.succ_begin[t]; i < g.succ_begin[t + 1]; ++i) {
      const auto to = node_of(g.succ[i]);
      if (indeg[to] != 0 && pred[to] == SIZE_MAX) {
        pred[to] = node_of(t);
        pred_kind[to] = g.succ_kind[i];
      }
    }
  }
  std::size_t v = 0;
  while (indeg[v] == 0)
    ++v;
  std::vector<std::size_t> order_seen(nodes, SIZE_MAX);
  std::vector<std::size_t> walk;
  while (order_seen[v] == SIZE_MAX) {
    order_seen[v] = walk.size();
    walk.push_back(v);
    v = pred[v];
  }
  std::vector<std::size_t> cycle(walk.begin() + static_cast<std::ptrdiff_t>(order_seen[v]),
                                 walk.end());
  std::reverse(cycle.begin(), cycle.end());  // predecessor walk runs backwards
  std::string path;
  for (std::size_t i = 0; i < cycle.size(); ++i) {
    const std::size_t next = cycle[(i + 1) % cycle.size()];
    const char* arrow = pred_kind[next] == EdgeKind::stream_order ? " -(stream order)-> "
                        : pred_kind[next] == EdgeKind::event      ? " -(event)-> "
                                                                  : " -> ";
    path += describe_node(cycle[i]) + arrow;
  }
  path += describe_node(cycle.front());
  throw GraphError(fmt::format(
      "the graph has a cycle of {} nodes and cannot run: {}. Break one of these dependencies "
      "(stream order: tasks on one device and stream run in the order they were added; a "
      "rendezvous cycle usually means collectives issued in different orders on different "
      "devices)",
      cycle.size(), path));
}

Graph GraphBuilder::build() {
  // A graph that fails to build leaves the builder as it was, so the caller can mend it.
  const std::size_t edges_before = impl_->edges.size();
  try {
    impl_->resolve_events();
    auto data = impl_->compile();
    impl_->check_acyclic(*data);
    data->work = std::move(impl_->work);
    impl_ = std::make_unique<Impl>();
    return Graph(std::move(data));
  } catch (...) {
    impl_->edges.truncate(edges_before);
    throw;
  }
}

}  // namespace weave::rt
