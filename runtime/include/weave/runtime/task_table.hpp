// The description of a graph's tasks, shared by a graph, its runs and their traces.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "weave/runtime/types.hpp"

namespace weave::rt {

// Ordered to pack into 80 bytes (64 before cost hints placed a collective's group): graphs of
// millions of tasks are built and replayed.
struct TaskInfo {
  CostHint cost;
  DeviceId device = 0;
  GroupId group = kNoGroup;  // the rendezvous this task is a member of, if any
  std::uint32_t name_offset = 0;
  std::uint32_t name_size = 0;
  TaskTags tags;
  StreamId stream = kComputeStream;
  TaskKind kind = TaskKind::compute;
};
static_assert(sizeof(TaskInfo) <= 88);

// Tasks, stream names and rendezvous groups. Names live in one pool so that adding a task
// allocates nothing per task.
class TaskTable {
 public:
  TaskTable();

  std::size_t size() const { return tasks_.size(); }
  const TaskInfo& operator[](TaskId id) const { return tasks_[id]; }
  std::string_view name(TaskId id) const {
    const TaskInfo& t = tasks_[id];
    return std::string_view(names_).substr(t.name_offset, t.name_size);
  }
  // One past the highest device any task is placed on.
  DeviceId device_count() const { return device_count_; }

  std::size_t stream_count() const { return stream_names_.size(); }
  std::string_view stream_name(StreamId id) const { return stream_names_[id]; }
  StreamKind stream_kind(StreamId id) const { return stream_kinds_[id]; }
  // The stream's id, adding the name if it is new. A stream has one kind: asking for it with
  // another kind than it was given throws std::invalid_argument (kUnclassifiedStream asks for
  // the stream whatever its kind, and an unclassified stream takes the first kind asked for).
  StreamId stream(std::string_view name, StreamKind kind = kUnclassifiedStream);

  std::size_t group_count() const { return group_names_.size(); }
  std::string_view group_name(GroupId g) const { return group_names_[g]; }
  std::span<const TaskId> members(GroupId g) const {
    return {group_members_.data() + group_begin_[g], group_begin_[g + 1] - group_begin_[g]};
  }

  TaskId add(const TaskInfo& info, std::string_view name);
  GroupId add_group(std::string_view name, std::span<const TaskId> members);

 private:
  std::vector<TaskInfo> tasks_;
  std::string names_;
  std::vector<std::string> stream_names_;
  std::vector<StreamKind> stream_kinds_;
  struct NameHash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, StreamId, NameHash, std::equal_to<>> stream_ids_;
  std::vector<std::string> group_names_;
  std::vector<std::uint32_t> group_begin_{0};
  std::vector<TaskId> group_members_;
  DeviceId device_count_ = 0;
};

}  // namespace weave::rt
