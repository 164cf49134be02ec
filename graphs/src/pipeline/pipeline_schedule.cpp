#include "weave/graphs/pipeline_schedule.hpp"

#include <fmt/format.h>

namespace weave::graphs {

char action_letter(ActionType type) {
  switch (type) {
    case ActionType::Forward:
      return 'F';
    case ActionType::Backward:
      return 'B';
    case ActionType::BackwardInput:
      return 'I';
    case ActionType::BackwardWeight:
      return 'W';
    case ActionType::Idle:
      return '.';
  }
  return '?';
}

int PipelineSchedule::stage(int rank, int chunk) const {
  if (layout == StageLayout::V) return chunk == 0 ? rank : 2 * ranks - 1 - rank;
  return rank + chunk * ranks;
}

int PipelineSchedule::rank_of(int stage) const {
  if (layout == StageLayout::V) return stage < ranks ? stage : 2 * ranks - 1 - stage;
  return stage % ranks;
}

int PipelineSchedule::chunk_of(int stage) const {
  if (layout == StageLayout::V) return stage < ranks ? 0 : 1;
  return stage / ranks;
}

int PipelineSchedule::compute_actions() const {
  int count = 0;
  for (const auto& rank : actions)
    for (const Action& a : rank)
      count += a.type != ActionType::Idle;
  return count;
}

std::string to_string(const Action& action) {
  if (action.type == ActionType::Idle) return ".";
  return fmt::format("{}{}{}", action_letter(action.type), action.micro_batch,
                     std::string(static_cast<std::size_t>(action.chunk), '\''));
}

std::string to_stage_string(const PipelineSchedule& schedule, int rank, const Action& action) {
  if (action.type == ActionType::Idle) return "";
  return fmt::format("{}{}{}", schedule.stage(rank, action.chunk), action_letter(action.type),
                     action.micro_batch);
}

std::string format_rank(const PipelineSchedule& schedule, int rank) {
  std::string out;
  for (const Action& a : schedule.actions.at(static_cast<std::size_t>(rank))) {
    if (!out.empty()) out += ' ';
    out += to_string(a);
  }
  return out;
}

std::string format_schedule(const PipelineSchedule& schedule) {
  std::string out;
  for (int r = 0; r < schedule.ranks; ++r)
    out += fmt::format("r{}: {}\n", r, format_rank(schedule, r));
  return out;
}

}  // namespace weave::graphs
