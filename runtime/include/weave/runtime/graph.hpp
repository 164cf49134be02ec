// A task graph: described once with a GraphBuilder, validated, then run many times.
//
// Tasks sit on a (device, stream). Besides the explicit edges, tasks on the same
// (device, stream) run in the order they were added, as on a CUDA stream; different streams
// of a device may run at the same time. Events are timeline semaphores: signal(t, e, v) says
// that e reaches v when t completes; wait(t, e, v) says t starts once e >= v. A rendezvous
// makes a set of tasks (one per member of a collective, say) start their work together once
// all are ready and complete together once all have finished.
#pragma once

#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "weave/runtime/task_context.hpp"
#include "weave/runtime/task_table.hpp"

namespace weave::rt {

struct TaskSpec {
  DeviceId device = 0;
  StreamId stream = kComputeStream;
  TaskKind kind = TaskKind::compute;
  std::string_view name;  // empty: "task<id>"
  TaskTags tags;
  CostHint cost;
};

// Why an edge exists; the DOT writer draws each kind differently.
enum class EdgeKind : std::uint8_t { explicit_dependency, stream_order, event };

namespace detail {
struct GraphData;
struct GraphAccess;
}  // namespace detail

// An immutable, validated graph. Copies share the same data.
class Graph {
 public:
  Graph();

  std::size_t size() const;
  bool empty() const { return size() == 0; }
  const TaskTable& tasks() const;
  std::shared_ptr<const TaskTable> shared_tasks() const;

  std::span<const TaskId> successors(TaskId task) const;
  std::span<const EdgeKind> successor_kinds(TaskId task) const;
  // Number of incoming edges, counting repeated ones.
  std::uint32_t in_degree(TaskId task) const;
  std::span<const TaskId> sources() const;
  std::uint32_t sink_count() const;
  const TaskFn& work(TaskId task) const;

 private:
  friend class GraphBuilder;
  friend struct detail::GraphAccess;
  explicit Graph(std::shared_ptr<const detail::GraphData> data);
  std::shared_ptr<const detail::GraphData> data_;
};

class GraphBuilder {
 public:
  GraphBuilder();
  ~GraphBuilder();
  GraphBuilder(GraphBuilder&&) noexcept;
  GraphBuilder& operator=(GraphBuilder&&) noexcept;

  // Optional: reserve room for this many tasks and edges.
  void reserve(std::size_t tasks, std::size_t edges);

  // The id of a named stream, the same on every device; "compute" and "comm" always exist.
  // `kind` classifies the stream for reports (see StreamKind and TaskTable::stream).
  StreamId stream(std::string_view name, StreamKind kind = kUnclassifiedStream);
  // Many streams at once, for graphs over thousands of them: `count` streams named prefix0 ..
  // prefix<count-1> with consecutive ids (the first is returned), or anonymous ones, called
  // "stream#<id>" in traces and dumps. Neither formats, allocates or hashes a name per stream
  // (see TaskTable::streams).
  StreamId streams(std::string_view prefix, std::size_t count,
                   StreamKind kind = kUnclassifiedStream);
  StreamId anonymous_streams(std::size_t count = 1, StreamKind kind = kUnclassifiedStream);

  TaskId add(const TaskSpec& spec, TaskFn work = {});
  // `after` starts only once `before` has completed.
  void precede(TaskId before, TaskId after);

  EventId event(std::string_view name);
  void signal(TaskId task, EventId event, std::uint64_t value);
  void wait(TaskId task, EventId event, std::uint64_t value);

  // The members' work starts once every member is ready and every member completes once all
  // members' work is done. Each task is in at most one rendezvous.
  GroupId rendezvous(std::string_view name, std::span<const TaskId> members);

  std::size_t size() const;

  // Resolves events into edges, adds stream order and checks the graph. Throws GraphError
  // naming the tasks of a cycle (a rendezvous counts as one node, so collectives issued in
  // different orders on different devices show up as a cycle) or the unresolvable wait.
  // The builder is empty afterwards.
  Graph build();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace weave::rt
