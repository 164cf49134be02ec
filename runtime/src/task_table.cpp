#include "weave/runtime/task_table.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <stdexcept>

namespace weave::rt {

TaskTable::TaskTable()
    : stream_names_{"compute", "comm"},
      stream_kinds_{kUnclassifiedStream, kUnclassifiedStream},
      stream_ids_{{"compute", kComputeStream}, {"comm", kCommStream}} {}

StreamId TaskTable::stream(std::string_view name, StreamKind kind) {
  if (name.empty()) throw std::invalid_argument("a stream needs a name");
  if (auto it = stream_ids_.find(name); it != stream_ids_.end()) {
    StreamKind& given = stream_kinds_[it->second];
    if (kind != kUnclassifiedStream && given != kUnclassifiedStream && kind != given)
      throw std::invalid_argument(fmt::format(
          "stream '{}' is of kind {} and was asked for as kind {}: a stream has one kind; give "
          "streams of different kinds different names",
          name, given, kind));
    if (given == kUnclassifiedStream) given = kind;
    return it->second;
  }
  if (stream_names_.size() >= std::numeric_limits<StreamId>::max()) {
    throw std::length_error(fmt::format("too many streams: at most {} names per graph",
                                        std::numeric_limits<StreamId>::max()));
  }
  const auto id = static_cast<StreamId>(stream_names_.size());
  stream_names_.emplace_back(name);
  stream_kinds_.push_back(kind);
  stream_ids_.emplace(stream_names_.back(), id);
  return id;
}

TaskId TaskTable::add(const TaskInfo& info, std::string_view name) {
  if (tasks_.size() >= kNoTask) {
    throw std::length_error(fmt::format("too many tasks: at most {} per graph", kNoTask - 1));
  }
  if (info.stream >= stream_names_.size()) {
    throw std::invalid_argument(fmt::format(
        "task '{}' is on stream {}, but only {} streams are named; get stream ids from stream()",
        name, info.stream, stream_names_.size()));
  }
  TaskInfo& t = tasks_.emplace_back(info);
  t.group = kNoGroup;
  t.name_offset = static_cast<std::uint32_t>(names_.size());
  if (name.empty()) {
    fmt::format_to(std::back_inserter(names_), "task{}", tasks_.size() - 1);
  } else {
    names_.append(name);
  }
  t.name_size = static_cast<std::uint32_t>(names_.size() - t.name_offset);
  device_count_ = std::max(device_count_, info.device + 1);
  return static_cast<TaskId>(tasks_.size() - 1);
}

GroupId TaskTable::add_group(std::string_view name, std::span<const TaskId> members) {
  if (members.empty()) {
    throw std::invalid_argument(fmt::format("rendezvous '{}' has no members", name));
  }
  const auto g = static_cast<GroupId>(group_names_.size());
  for (TaskId m : members) {
    if (m >= tasks_.size()) {
      throw std::invalid_argument(
          fmt::format("rendezvous '{}' names task {}, but only {} tasks exist", name, m, size()));
    }
    if (tasks_[m].group != kNoGroup) {
      throw std::invalid_argument(fmt::format(
          "task '{}' is already a member of rendezvous '{}'; a task joins at most one rendezvous "
          "(it cannot also join '{}')",
          this->name(m), group_names_[tasks_[m].group], name));
    }
  }
  std::vector<TaskId> sorted(members.begin(), members.end());
  std::sort(sorted.begin(), sorted.end());
  if (auto twice = std::adjacent_find(sorted.begin(), sorted.end()); twice != sorted.end()) {
    throw std::invalid_argument(
        fmt::format("rendezvous '{}' lists task '{}' twice", name, this->name(*twice)));
  }
  for (TaskId m : members)
    tasks_[m].group = g;
  group_names_.emplace_back(name);
  group_members_.insert(group_members_.end(), members.begin(), members.end());
  group_begin_.push_back(static_cast<std::uint32_t>(group_members_.size()));
  return g;
}

}  // namespace weave::rt
