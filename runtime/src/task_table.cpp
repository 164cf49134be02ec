#include "weave/runtime/task_table.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

namespace weave::rt {

namespace {

constexpr std::string_view kAnonymousPrefix = "stream#";

bool is_digit(char c) {
  return c >= '0' && c <= '9';
}

// Splits "name<n>" into the name and n, if it ends in a number written without leading zeros
// (the form streams() and anonymous_streams() write).
bool split_number(std::string_view name, std::string_view& prefix, std::size_t& n) {
  std::size_t digits = 0;
  while (digits < name.size() && is_digit(name[name.size() - 1 - digits]))
    ++digits;
  if (digits == 0 || digits > 9) return false;
  const std::string_view number = name.substr(name.size() - digits);
  if (number.size() > 1 && number[0] == '0') return false;
  n = 0;
  for (char c : number)
    n = n * 10 + static_cast<std::size_t>(c - '0');
  prefix = name.substr(0, name.size() - digits);
  return true;
}

void append_number(std::string& text, std::size_t n) {
  char digits[20];
  const auto end = std::to_chars(digits, digits + sizeof digits, n).ptr;
  text.append(digits, end);
}

}  // namespace

TaskTable::TaskTable() {
  stream("compute");
  stream("comm");
}

void TaskTable::check_stream_room(std::size_t count) const {
  if (count > std::numeric_limits<StreamId>::max() - stream_count()) {
    throw std::length_error(fmt::format(
        "too many streams: {} exist and {} more were asked for, but a graph has at most {}",
        stream_count(), count, std::numeric_limits<StreamId>::max()));
  }
}

// A stream named by streams() or anonymous_streams(), found from its name without a map entry.
StreamId TaskTable::find_numbered(std::string_view name) const {
  std::string_view prefix;
  std::size_t n = 0;
  if (!split_number(name, prefix, n)) return std::numeric_limits<StreamId>::max();
  if (prefix == kAnonymousPrefix) {
    if (n < stream_count() && stream_name(static_cast<StreamId>(n)) == name)
      return static_cast<StreamId>(n);
    return std::numeric_limits<StreamId>::max();
  }
  for (const NumberedStreams& r : numbered_) {
    if (r.prefix == prefix && n < r.count) return static_cast<StreamId>(r.first + n);
  }
  return std::numeric_limits<StreamId>::max();
}

StreamId TaskTable::stream(std::string_view name, StreamKind kind) {
  if (name.empty()) throw std::invalid_argument("a stream needs a name");
  StreamId id = std::numeric_limits<StreamId>::max();
  if (auto it = stream_ids_.find(name); it != stream_ids_.end()) {
    id = it->second;
  } else if (!numbered_.empty() || name.starts_with(kAnonymousPrefix)) {
    id = find_numbered(name);
  }
  if (id != std::numeric_limits<StreamId>::max()) {
    StreamKind& given = stream_kinds_[id];
    if (kind != kUnclassifiedStream && given != kUnclassifiedStream && kind != given)
      throw std::invalid_argument(fmt::format(
          "stream '{}' is of kind {} and was asked for as kind {}: a stream has one kind; give "
          "streams of different kinds different names",
          name, given, kind));
    if (given == kUnclassifiedStream) given = kind;
    return id;
  }
  check_stream_room(1);
  id = static_cast<StreamId>(stream_count());
  stream_text_.append(name);
  stream_begin_.push_back(static_cast<std::uint32_t>(stream_text_.size()));
  stream_kinds_.push_back(kind);
  stream_ids_.emplace(name, id);
  return id;
}

// Writes the names prefix<first> .. prefix<first + count - 1> into the stream pool. Called for
// tens of thousands of streams at once, so the pool is sized once, the prefix is copied as one
// fixed-size block and the number written after it in place: appending prefix and number to
// the string one by one took a fifth of the 50,000-stream fan-out build in calls to memcpy for
// a byte or two. (Counting the number up as text in a buffer and copying that was no faster:
// the block's load waited for the byte stores just made to the buffer.)
void TaskTable::append_numbered_names(std::string_view prefix, std::size_t first,
                                      std::size_t count) {
  constexpr std::size_t kBlock = 32;
  char block[kBlock] = {};
  const bool short_prefix = prefix.size() <= kBlock;
  if (short_prefix) std::copy(prefix.begin(), prefix.end(), block);
  const std::size_t longest = prefix.size() + std::to_string(first + count - 1).size();
  std::size_t at = stream_text_.size();
  // Room for a whole block past the last name; trimmed below.
  stream_text_.resize(at + count * longest + kBlock);
  stream_begin_.reserve(stream_begin_.size() + count);
  char* const text = stream_text_.data();
  char* const text_end = text + stream_text_.size();
  for (std::size_t i = 0; i < count; ++i) {
    if (short_prefix) {
      std::memcpy(text + at, block, kBlock);
    } else {
      std::memcpy(text + at, prefix.data(), prefix.size());
    }
    at = static_cast<std::size_t>(
        std::to_chars(text + at + prefix.size(), text_end, first + i).ptr - text);
    stream_begin_.push_back(static_cast<std::uint32_t>(at));
  }
  stream_text_.resize(at);
}

StreamId TaskTable::streams(std::string_view prefix, std::size_t count, StreamKind kind) {
  if (count == 0) {
    throw std::invalid_argument(
        fmt::format("streams('{}', 0): asked for no streams; ask for at least one", prefix));
  }
  if (!prefix.empty() && is_digit(prefix.back())) {
    throw std::invalid_argument(fmt::format(
        "streams('{}', {}): the prefix ends in a digit, so '{}10' would also read as another "
        "prefix's stream; end the prefix with a non-digit (e.g. '{}_')",
        prefix, count, prefix, prefix));
  }
  if (prefix == kAnonymousPrefix) {
    throw std::invalid_argument(
        fmt::format("streams('{}', {}): '{}' names anonymous streams; use anonymous_streams() or "
                    "another prefix",
                    prefix, count, prefix));
  }
  for (const NumberedStreams& r : numbered_) {
    if (r.prefix == prefix) {
      throw std::invalid_argument(fmt::format(
          "streams('{}', {}): streams with this prefix exist already ({} of them, from id {}); "
          "ask for all of a prefix's streams in one call, or use another prefix",
          prefix, count, r.count, r.first));
    }
  }
  for (const auto& [name, id] : stream_ids_) {
    std::string_view p;
    std::size_t n = 0;
    if (split_number(name, p, n) && p == prefix && n < count) {
      throw std::invalid_argument(fmt::format(
          "streams('{}', {}): stream '{}' exists already; name it another way or use another "
          "prefix",
          prefix, count, name));
    }
  }
  check_stream_room(count);
  const auto first = static_cast<StreamId>(stream_count());
  numbered_.push_back({std::string(prefix), first, count});
  append_numbered_names(prefix, 0, count);
  stream_kinds_.resize(stream_kinds_.size() + count, kind);
  return first;
}

StreamId TaskTable::anonymous_streams(std::size_t count, StreamKind kind) {
  if (count == 0) {
    throw std::invalid_argument("anonymous_streams(0): asked for no streams; ask for at least one");
  }
  check_stream_room(count);
  const auto first = static_cast<StreamId>(stream_count());
  append_numbered_names(kAnonymousPrefix, first, count);
  stream_kinds_.resize(stream_kinds_.size() + count, kind);
  return first;
}

TaskId TaskTable::add(const TaskInfo& info, std::string_view name) {
  const auto id = static_cast<TaskId>(tasks_.size());
  TaskInfo& t = append(info.device, info.stream, name);
  t.cost = info.cost;
  t.tags = info.tags;
  t.kind = info.kind;
  return id;
}

void TaskTable::refuse_task(StreamId stream, std::string_view name) const {
  if (tasks_.size() >= kNoTask) {
    throw std::length_error(fmt::format("too many tasks: at most {} per graph", kNoTask - 1));
  }
  throw std::invalid_argument(fmt::format(
      "task '{}' is on stream {}, but only {} streams are named; get stream ids from stream()",
      name, stream, stream_count()));
}

void TaskTable::name_task(TaskInfo& t, TaskId id, std::string_view name) {
  if (name.empty()) {
    t.name_offset = static_cast<std::uint32_t>(names_.size());
    names_ += "task";
    append_number(names_, id);
    t.name_size = static_cast<std::uint32_t>(names_.size() - t.name_offset);
    last_name_size_ = 0;
  } else {
    t.name_offset = last_name_offset_ = static_cast<std::uint32_t>(names_.size());
    t.name_size = last_name_size_ = static_cast<std::uint32_t>(name.size());
    names_.append(name);
  }
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
