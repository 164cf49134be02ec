#include "weave/graphs/pipeline_schedule_csv.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <optional>

namespace weave::graphs {

namespace {

constexpr std::string_view kCellForm =
    "STAGE TYPE MICRO_BATCH such as 2F0 (TYPE one of F, B, I, W; the stage may be left out), or "
    "an empty cell for an idle slot";

struct Cell {
  int line = 0;
  int column = 0;  // 1-based cell number in the row
  std::string text;
  std::optional<int> stage;  // none: the rank's first stage
  Action action;
};

std::string strip(std::string_view s) {
  std::string out;
  for (char c : s)
    if (!std::isspace(static_cast<unsigned char>(c))) out += c;
  return out;
}

[[noreturn]] void refuse_cell(const Cell& cell, std::string_view why) {
  throw ScheduleError(fmt::format("schedule CSV line {}, cell {} ('{}'): {}; expected {}",
                                  cell.line, cell.column, cell.text, why, kCellForm));
}

// Reads digits at `pos`; none if there are none or the number does not fit an int.
std::optional<int> read_number(const std::string& s, std::size_t& pos) {
  const std::size_t begin = pos;
  long long value = 0;
  while (pos < s.size() && std::isdigit(static_cast<unsigned char>(s[pos]))) {
    value = value * 10 + (s[pos] - '0');
    if (value > 1'000'000'000) return std::nullopt;
    ++pos;
  }
  if (pos == begin) return std::nullopt;
  return static_cast<int>(value);
}

// Parses a non-empty cell; false for a communication cell, which carries nothing to keep.
bool parse_cell(Cell& cell) {
  const std::string& s = cell.text;
  std::size_t pos = 0;
  if (pos < s.size() && std::isdigit(static_cast<unsigned char>(s[pos]))) {
    cell.stage = read_number(s, pos);
    if (!cell.stage) refuse_cell(cell, "the stage number is too large");
  }
  const std::size_t type_begin = pos;
  while (pos < s.size() && (std::isalpha(static_cast<unsigned char>(s[pos])) || s[pos] == '_'))
    ++pos;
  const std::string type = s.substr(type_begin, pos - type_begin);
  const std::optional<int> mb = read_number(s, pos);
  if (type.empty()) refuse_cell(cell, "no action type");
  if (!mb) refuse_cell(cell, fmt::format("no micro-batch number after '{}'", type));
  if (pos != s.size())
    refuse_cell(cell, fmt::format("unexpected '{}' after the micro-batch", s.substr(pos)));
  cell.action.micro_batch = *mb;
  if (type == "F")
    cell.action.type = ActionType::Forward;
  else if (type == "B")
    cell.action.type = ActionType::Backward;
  else if (type == "I")
    cell.action.type = ActionType::BackwardInput;
  else if (type == "W")
    cell.action.type = ActionType::BackwardWeight;
  else if (type == "SEND_F" || type == "RECV_F" || type == "SEND_B" || type == "RECV_B")
    return false;
  else
    refuse_cell(cell, fmt::format("unknown action type '{}'", type));
  return true;
}

std::string stage_list(const PipelineSchedule& s, int rank) {
  std::vector<int> stages;
  for (int c = 0; c < s.chunks; ++c)
    stages.push_back(s.stage(rank, c));
  return fmt::format("{}", fmt::join(stages, ", "));
}

// The first cell whose stage `layout` cannot place on its row's rank, if any.
const Cell* misplaced(PipelineSchedule& s, StageLayout layout,
                      const std::vector<std::vector<Cell>>& rows) {
  s.layout = layout;
  for (int r = 0; r < s.ranks; ++r)
    for (const Cell& cell : rows[r])
      if (cell.stage && (s.rank_of(*cell.stage) != r || *cell.stage >= s.stages())) return &cell;
  return nullptr;
}

}  // namespace

std::string write_schedule_csv(const PipelineSchedule& schedule) {
  std::string out = fmt::format(
      "# weave pipeline schedule '{}': {} ranks, {} micro-batches, {} chunks per rank, {} "
      "layout\n# one row per rank; cells are STAGE TYPE MICRO_BATCH (F forward, B backward, I "
      "input gradient, W weight gradient); an empty cell is an idle slot\n",
      schedule.name, schedule.ranks, schedule.micro_batches, schedule.chunks,
      schedule.layout == StageLayout::V ? "V" : "interleaved");
  for (int r = 0; r < schedule.ranks; ++r) {
    std::vector<std::string> cells;
    for (const Action& a : schedule.actions.at(static_cast<std::size_t>(r)))
      cells.push_back(to_stage_string(schedule, r, a));
    // A lone comma keeps a rank with nothing to do from reading as a blank line.
    out += cells.empty() ? std::string(",\n") : fmt::format("{}\n", fmt::join(cells, ","));
  }
  return out;
}

PipelineSchedule read_schedule_csv(std::string_view text, std::string name, int micro_batches) {
  std::vector<std::vector<Cell>> rows;
  int line_number = 0;
  for (std::size_t begin = 0; begin < text.size();) {
    std::size_t end = text.find('\n', begin);
    if (end == std::string_view::npos) end = text.size();
    const std::string line = strip(text.substr(begin, end - begin));
    begin = end + 1;
    ++line_number;
    if (line.empty() || line.front() == '#') continue;
    std::vector<Cell> row;
    int column = 0;
    for (std::size_t at = 0; at <= line.size();) {
      std::size_t comma = line.find(',', at);
      if (comma == std::string::npos) comma = line.size();
      Cell cell{line_number, ++column, line.substr(at, comma - at), std::nullopt, {}};
      at = comma + 1;
      if (cell.text.empty())
        cell.action.type = ActionType::Idle;
      else if (!parse_cell(cell))
        continue;
      row.push_back(cell);
    }
    while (!row.empty() && row.back().action.type == ActionType::Idle)
      row.pop_back();
    rows.push_back(std::move(row));
  }
  if (rows.empty())
    throw ScheduleError("the schedule CSV has no rows; expected one row of actions per rank");

  PipelineSchedule s;
  s.name = std::move(name);
  s.ranks = static_cast<int>(rows.size());
  int highest_stage = s.ranks - 1, highest_mb = -1, actions = 0;
  const Cell* highest_stage_cell = nullptr;
  const Cell* highest_mb_cell = nullptr;
  for (const auto& row : rows)
    for (const Cell& cell : row) {
      if (cell.action.type == ActionType::Idle) continue;
      ++actions;
      if (cell.stage && *cell.stage > highest_stage) {
        highest_stage = *cell.stage;
        highest_stage_cell = &cell;
      }
      if (cell.action.micro_batch > highest_mb) {
        highest_mb = cell.action.micro_batch;
        highest_mb_cell = &cell;
      }
    }
  // Every stage and every micro-batch needs actions of its own, so numbers beyond the count of
  // actions are typos; refusing them also keeps a typo from sizing the checker's tables.
  if (highest_stage_cell && highest_stage >= actions)
    refuse_cell(*highest_stage_cell,
                fmt::format("stage {} cannot exist in a schedule of {} actions: number the "
                            "stages from 0 without gaps",
                            highest_stage, actions));
  if (micro_batches <= 0 && highest_mb_cell && highest_mb >= actions)
    refuse_cell(*highest_mb_cell,
                fmt::format("micro-batch {} cannot exist in a schedule of {} actions: number "
                            "the micro-batches from 0 without gaps",
                            highest_mb, actions));
  s.chunks = highest_stage / s.ranks + 1;
  s.micro_batches = micro_batches > 0 ? micro_batches : std::max(highest_mb + 1, 1);
  const Cell* not_interleaved = misplaced(s, StageLayout::Interleaved, rows);
  const Cell* not_v = s.chunks == 2 ? misplaced(s, StageLayout::V, rows) : nullptr;
  if (not_interleaved && (s.chunks != 2 || not_v)) {
    const Cell& bad = *not_interleaved;
    int rank = 0;
    while (rows[rank].empty() || rows[rank].front().line != bad.line)
      ++rank;
    s.layout = StageLayout::Interleaved;
    std::string why = fmt::format(
        "a stage lives on one rank, and with p = {} and v = {} the interleaved layout puts "
        "stages {} on rank {}",
        s.ranks, s.chunks, stage_list(s, rank), rank);
    if (s.chunks == 2) {
      s.layout = StageLayout::V;
      why += fmt::format(" (the V layout: {}; line {}, cell {} ('{}') rules it out)",
                         stage_list(s, rank), not_v->line, not_v->column, not_v->text);
    }
    refuse_cell(bad, why);
  }
  s.layout = not_interleaved ? StageLayout::V : StageLayout::Interleaved;
  s.actions.resize(rows.size());
  for (int r = 0; r < s.ranks; ++r)
    for (const Cell& cell : rows[r]) {
      Action a = cell.action;
      if (cell.stage) a.chunk = s.chunk_of(*cell.stage);
      s.actions[r].push_back(a);
    }
  return s;
}

}  // namespace weave::graphs
