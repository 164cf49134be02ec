// The description of a graph's tasks, shared by a graph, its runs and their traces.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "weave/runtime/segmented_array.hpp"
#include "weave/runtime/types.hpp"

namespace weave::rt {

// Ordered to pack into 88 bytes (64 before cost hints placed a collective's group and counted
// kernels): graphs of millions of tasks are built and replayed.
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
static_assert(sizeof(TaskInfo) == 88);

// Tasks, stream names and rendezvous groups. Task and stream names live in pools (one string
// each), so that adding a task or a stream allocates nothing of its own: graphs of millions of
// tasks over tens of thousands of streams are built in arrays that grow geometrically.
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

  std::size_t stream_count() const { return stream_kinds_.size(); }
  std::string_view stream_name(StreamId id) const {
    return std::string_view(stream_text_)
        .substr(stream_begin_[id], stream_begin_[id + 1] - stream_begin_[id]);
  }
  StreamKind stream_kind(StreamId id) const { return stream_kinds_[id]; }
  // The stream's id, adding the name if it is new. A stream has one kind: asking for it with
  // another kind than it was given throws std::invalid_argument (kUnclassifiedStream asks for
  // the stream whatever its kind, and an unclassified stream takes the first kind asked for).
  // Finds streams named by streams() and anonymous_streams() too ("s17", "stream#4").
  StreamId stream(std::string_view name, StreamKind kind = kUnclassifiedStream);
  // `count` new streams named prefix0 .. prefix<count-1>, with consecutive ids; returns the
  // first. The names are written into the pool at once (no map entry or string of their own),
  // and stream(prefix + "7") finds the eighth. The prefix must not end in a digit ("s1" + "0"
  // would read as "s" + "10"), and no stream of that form may exist yet.
  StreamId streams(std::string_view prefix, std::size_t count,
                   StreamKind kind = kUnclassifiedStream);
  // `count` new streams the caller never looks up by name; each is called "stream#<id>" in
  // traces and dumps, which stays the same as long as the streams are made in the same order.
  StreamId anonymous_streams(std::size_t count = 1, StreamKind kind = kUnclassifiedStream);

  std::size_t group_count() const { return group_names_.size(); }
  std::string_view group_name(GroupId g) const { return group_names_[g]; }
  std::span<const TaskId> members(GroupId g) const {
    return {group_members_.data() + group_begin_[g], group_begin_[g + 1] - group_begin_[g]};
  }

  TaskId add(const TaskInfo& info, std::string_view name);
  // Appends a task on (device, stream) with the other fields at their defaults, for the caller
  // to fill in place: a graph builder writes each field once instead of building a TaskInfo
  // and copying it. The reference is valid until the next task is added.
  // Inline: a graph builder calls it once per task.
  TaskInfo& append(DeviceId device, StreamId stream, std::string_view name) {
    if (tasks_.size() >= kNoTask || stream >= stream_count()) [[unlikely]]
      refuse_task(stream, name);
    const auto id = static_cast<TaskId>(tasks_.size());
    TaskInfo& t = tasks_.emplace_back();
    t.device = device;
    t.stream = stream;
    if (!name.empty() && name.size() == last_name_size_ &&
        std::string_view(names_).substr(last_name_offset_, last_name_size_) == name) {
      t.name_offset = last_name_offset_;
      t.name_size = last_name_size_;
    } else {
      name_task(t, id, name);
    }
    if (device >= device_count_) device_count_ = device + 1;
    return t;
  }
  GroupId add_group(std::string_view name, std::span<const TaskId> members);

 private:
  [[noreturn]] void refuse_task(StreamId stream, std::string_view name) const;
  // Keeps a task's name in the pool; a later task of the same name shares it (see append).
  void name_task(TaskInfo& t, TaskId id, std::string_view name);
  void check_stream_room(std::size_t count) const;
  StreamId find_numbered(std::string_view name) const;
  void append_numbered_names(std::string_view prefix, std::size_t first, std::size_t count);

  // Rows never move once added (SegmentedArray): the table grows without copying them.
  detail::SegmentedArray<TaskInfo> tasks_;
  std::string names_;
  // The last name added, which a run of tasks with the same name shares (a name is kept once
  // per run, not once per task).
  // (Size 0: none, as after an unnamed task.)
  std::uint32_t last_name_offset_ = 0;
  std::uint32_t last_name_size_ = 0;

  // Stream s is called stream_text_[stream_begin_[s] .. stream_begin_[s + 1]).
  std::string stream_text_;
  std::vector<std::uint32_t> stream_begin_{0};
  std::vector<StreamKind> stream_kinds_;
  struct NameHash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  // Streams named one at a time; streams() ranges are found through their prefix instead.
  std::unordered_map<std::string, StreamId, NameHash, std::equal_to<>> stream_ids_;
  struct NumberedStreams {
    std::string prefix;
    StreamId first;
    std::size_t count;
  };
  std::vector<NumberedStreams> numbered_;

  std::vector<std::string> group_names_;
  std::vector<std::uint32_t> group_begin_{0};
  std::vector<TaskId> group_members_;
  DeviceId device_count_ = 0;
};

}  // namespace weave::rt
