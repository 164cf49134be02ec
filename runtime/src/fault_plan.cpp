#include "weave/runtime/fault_plan.hpp"

#include <fmt/format.h>

namespace weave::rt {

// fnmatch(3) would read the "[2]" that ends a collective member's name as a bracket expression,
// so names are matched with '*' and '?' only.
bool matches_task_pattern(std::string_view pattern, std::string_view name) {
  std::size_t p = 0, n = 0;
  // Where the last '*' was and the name position it was tried at, to backtrack to.
  std::size_t star = std::string_view::npos, star_n = 0;
  while (n < name.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == name[n])) {
      ++p;
      ++n;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      star_n = n;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      n = ++star_n;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*')
    ++p;
  return p == pattern.size();
}

bool FaultPoint::matches(const TaskTable& tasks, TaskId id, std::uint64_t run_index) const {
  const TaskInfo& info = tasks[id];
  return (!run || *run == run_index) && (!device || *device == info.device) &&
         (!phase || *phase == info.tags.phase) &&
         (!micro_batch || *micro_batch == info.tags.micro_batch) &&
         matches_task_pattern(task, tasks.name(id));
}

std::optional<FaultKind> FaultPlan::fault_for(const TaskTable& tasks, TaskId task,
                                              std::uint64_t run_index) const {
  for (const FaultPoint& p : points) {
    if (p.matches(tasks, task, run_index)) return p.kind;
  }
  return std::nullopt;
}

std::string injected_fault_message(const TaskTable& tasks, TaskId task, std::uint64_t run_index) {
  return fmt::format("fault injected by the fault plan into task '{}' on device {} in run {}",
                     tasks.name(task), tasks[task].device, run_index);
}

}  // namespace weave::rt
