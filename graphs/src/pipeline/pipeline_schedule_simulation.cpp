#include "weave/graphs/pipeline_schedule_simulation.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <optional>

namespace weave::graphs {

double TimeModel::duration(ActionType type) const {
  switch (type) {
    case ActionType::Forward:
    case ActionType::Idle:
      return forward;
    case ActionType::Backward:
      return backward;
    case ActionType::BackwardInput:
      return backward_input;
    case ActionType::BackwardWeight:
      return backward_weight;
  }
  return 0;
}

namespace {

constexpr std::size_t kMaxProblems = 20;

struct Position {
  int rank = 0;
  int step = 0;
};

// Where each compute action (type, stage, micro-batch) appears in the schedule.
class ActionIndex {
 public:
  static constexpr int kComputeTypes = 4;  // F, B, I, W

  ActionIndex(int stages, int micro_batches)
      : stages_(stages),
        micro_batches_(micro_batches),
        at_(static_cast<std::size_t>(kComputeTypes * stages * micro_batches)) {}

  std::vector<Position>& at(ActionType type, int stage, int mb) {
    return at_[static_cast<std::size_t>(
        (static_cast<int>(type) * stages_ + stage) * micro_batches_ + mb)];
  }

 private:
  int stages_;
  int micro_batches_;
  std::vector<std::vector<Position>> at_;
};

// "step 3 (B0', stage 5)"
std::string describe_step(const PipelineSchedule& s, int rank, int step) {
  const Action& a = s.actions[rank][step];
  return fmt::format("step {} ({}, stage {})", step, to_string(a), s.stage(rank, a.chunk));
}

std::string describe(const PipelineSchedule& s, int rank, int step) {
  return fmt::format("rank {} {}", rank, describe_step(s, rank, step));
}

// The stage-level name of an action that may not exist: "B3 of stage 2".
std::string describe(ActionType type, int stage, int mb) {
  return fmt::format("{}{} of stage {}", action_letter(type), mb, stage);
}

class Problems {
 public:
  explicit Problems(std::vector<std::string>& out) : out_(out) {}
  template <typename... Args>
  void add(fmt::format_string<Args...> format, Args&&... args) {
    ++count_;
    if (out_.size() < kMaxProblems)
      out_.push_back(fmt::format(format, std::forward<Args>(args)...));
  }
  ~Problems() {
    if (count_ > out_.size()) out_.push_back(fmt::format("... and {} more", count_ - out_.size()));
  }

 private:
  std::vector<std::string>& out_;
  std::size_t count_ = 0;
};

bool check_shape(const PipelineSchedule& s, Problems& problems) {
  bool ok = true;
  const auto fail = [&](std::string message) {
    problems.add("{}", message);
    ok = false;
  };
  if (s.ranks < 1) fail(fmt::format("the schedule needs at least 1 rank (got {})", s.ranks));
  if (s.micro_batches < 1)
    fail(fmt::format("the schedule needs at least 1 micro-batch (got {})", s.micro_batches));
  if (s.chunks < 1) fail(fmt::format("each rank holds at least 1 chunk (got {})", s.chunks));
  if (s.layout == StageLayout::V && s.chunks != 2)
    fail(fmt::format("the V layout holds exactly 2 chunks per rank (got {})", s.chunks));
  if (static_cast<int>(s.actions.size()) != s.ranks)
    fail(fmt::format("the schedule has {} ranks but lists actions for {}", s.ranks,
                     s.actions.size()));
  return ok;
}

// Each (stage, micro-batch) runs one forward and one full or split backward, in order.
void check_actions(const PipelineSchedule& s, ActionIndex& index, Problems& problems) {
  for (int r = 0; r < s.ranks; ++r) {
    for (int i = 0; i < static_cast<int>(s.actions[r].size()); ++i) {
      const Action& a = s.actions[r][i];
      if (a.type == ActionType::Idle) continue;
      if (a.chunk < 0 || a.chunk >= s.chunks) {
        problems.add("rank {} step {} ({}) names chunk {}, but ranks hold chunks 0..{} (v = {})", r,
                     i, to_string(a), a.chunk, s.chunks - 1, s.chunks);
        continue;
      }
      if (a.micro_batch < 0 || a.micro_batch >= s.micro_batches) {
        problems.add("{} names micro-batch {}, but the step has micro-batches 0..{} (m = {})",
                     describe(s, r, i), a.micro_batch, s.micro_batches - 1, s.micro_batches);
        continue;
      }
      index.at(a.type, s.stage(r, a.chunk), a.micro_batch).push_back({r, i});
    }
  }
  const auto duplicates = [&](ActionType type, int stage, int mb) {
    const auto& at = index.at(type, stage, mb);
    if (at.size() < 2) return;
    std::vector<int> steps;
    for (const Position& p : at)
      steps.push_back(p.step);
    problems.add("duplicate: {} runs {} times, on rank {} at steps {}; keep one",
                 describe(type, stage, mb), at.size(), at[0].rank, fmt::join(steps, ", "));
  };
  for (int stage = 0; stage < s.stages(); ++stage) {
    const int rank = s.rank_of(stage);
    for (int mb = 0; mb < s.micro_batches; ++mb) {
      const auto& f = index.at(ActionType::Forward, stage, mb);
      const auto& b = index.at(ActionType::Backward, stage, mb);
      const auto& in = index.at(ActionType::BackwardInput, stage, mb);
      const auto& w = index.at(ActionType::BackwardWeight, stage, mb);
      for (ActionType t : {ActionType::Forward, ActionType::Backward, ActionType::BackwardInput,
                           ActionType::BackwardWeight})
        duplicates(t, stage, mb);
      if (f.empty())
        problems.add("missing forward: rank {} never runs {}", rank,
                     describe(ActionType::Forward, stage, mb));
      if (b.empty() && in.empty() && w.empty())
        problems.add("missing backward: rank {} never runs B{} of stage {} (or I{} and W{})", rank,
                     mb, stage, mb, mb);
      if (!b.empty() && (!in.empty() || !w.empty()))
        problems.add(
            "{} runs both a full backward (B) and a split one (I, W); use B or I and W, not both",
            fmt::format("micro-batch {} of stage {}", mb, stage));
      if (b.empty() && in.empty() && !w.empty())
        problems.add("missing input gradient: rank {} runs W{} of stage {} but never I{}", rank, mb,
                     stage, mb);
      if (b.empty() && !in.empty() && w.empty())
        problems.add("missing weight gradient: rank {} runs I{} of stage {} but never W{}", rank,
                     mb, stage, mb);
      const auto first = [](const std::vector<Position>& at) {
        return at.empty() ? std::optional<int>() : std::optional<int>(at.front().step);
      };
      const auto f_step = first(f);
      for (const auto* backward : {&b, &in}) {
        const auto step = first(*backward);
        if (f_step && step && *step < *f_step)
          problems.add("out of order: {} comes before its forward at step {}",
                       describe(s, rank, *step), *f_step);
      }
      if (first(in) && first(w) && *first(w) < *first(in))
        problems.add("out of order: {} comes before its input gradient at step {}",
                     describe(s, rank, *first(w)), *first(in));
    }
  }
}

// Each rank's peak of live chunk activations, walking its list in order.
void count_activations(const PipelineSchedule& s, std::vector<RankReport>& ranks) {
  for (int r = 0; r < s.ranks; ++r) {
    int live = 0, peak = 0, peak_step = -1;
    for (int i = 0; i < static_cast<int>(s.actions[r].size()); ++i) {
      switch (s.actions[r][i].type) {
        case ActionType::Forward:
          ++live;
          break;
        case ActionType::Backward:
        case ActionType::BackwardWeight:
          --live;
          break;
        default:
          break;
      }
      if (live > peak) {
        peak = live;
        peak_step = i;
      }
    }
    ranks[r].peak_activations = static_cast<double>(peak) / s.chunks;
    ranks[r].peak_step = peak_step;
  }
}

// The action whose completion `a` on `rank` waits for, if any.
std::optional<std::pair<ActionType, int>> dependency(const PipelineSchedule& s, int rank,
                                                     const Action& a) {
  const int stage = s.stage(rank, a.chunk);
  switch (a.type) {
    case ActionType::Forward:
      if (stage > 0) return std::pair{ActionType::Forward, stage - 1};
      return std::nullopt;
    case ActionType::Backward:
    case ActionType::BackwardInput:
      // The last stage starts the backward from its own forward (the loss). Elsewhere the
      // gradient from the next stage implies this stage's forward ran, and the check has made
      // sure it ran earlier on this rank.
      if (stage + 1 < s.stages()) return std::pair{ActionType::BackwardInput, stage + 1};
      return std::pair{ActionType::Forward, stage};
    case ActionType::BackwardWeight:
      return std::pair{ActionType::BackwardInput, stage};
    case ActionType::Idle:
      return std::nullopt;
  }
  return std::nullopt;
}

void run(const PipelineSchedule& s, const TimeModel& time, ActionIndex& index,
         ScheduleReport& report, Problems& problems) {
  // Completion time per (stage, micro-batch) of the forward and of the input gradient (a full
  // backward produces it too); the weight gradient feeds nothing.
  const std::size_t cells = static_cast<std::size_t>(s.stages() * s.micro_batches);
  std::vector<std::optional<double>> forward_done(cells), input_done(cells);
  const auto done = [&](ActionType type, int stage, int mb) -> std::optional<double>& {
    const std::size_t i = static_cast<std::size_t>(stage * s.micro_batches + mb);
    return type == ActionType::Forward ? forward_done[i] : input_done[i];
  };
  std::vector<int> next(static_cast<std::size_t>(s.ranks), 0);
  std::vector<double> free_at(static_cast<std::size_t>(s.ranks), 0.0);
  report.timeline.assign(static_cast<std::size_t>(s.ranks), {});
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < s.ranks; ++r) {
      const auto& list = s.actions[r];
      while (next[r] < static_cast<int>(list.size())) {
        const Action& a = list[next[r]];
        const int stage = s.stage(r, a.chunk);
        double start = free_at[r];
        if (const auto dep = dependency(s, r, a)) {
          const auto& ready = done(dep->first, dep->second, a.micro_batch);
          if (!ready) break;
          start = std::max(start, *ready);
        }
        const double end = start + time.duration(a.type);
        report.timeline[r].push_back({a, next[r], start, end});
        if (a.type == ActionType::Forward) done(ActionType::Forward, stage, a.micro_batch) = end;
        if (a.type == ActionType::Backward || a.type == ActionType::BackwardInput)
          done(ActionType::BackwardInput, stage, a.micro_batch) = end;
        free_at[r] = end;
        ++next[r];
        progress = true;
      }
    }
  }
  bool stuck = false;
  for (int r = 0; r < s.ranks; ++r) {
    if (next[r] == static_cast<int>(s.actions[r].size())) continue;
    stuck = true;
    const Action& a = s.actions[r][next[r]];
    const auto dep = dependency(s, r, a);
    const auto [type, stage] = *dep;
    // An input gradient may come from a full backward or from the input half of a split one.
    const bool gradient = type == ActionType::BackwardInput;
    const auto& full = index.at(ActionType::Backward, stage, a.micro_batch);
    const auto& at = gradient && !full.empty() ? full : index.at(type, stage, a.micro_batch);
    const std::string wanted =
        gradient ? fmt::format("the input gradient of micro-batch {} from stage {} (B{} or I{})",
                               a.micro_batch, stage, a.micro_batch, a.micro_batch)
                 : describe(type, stage, a.micro_batch);
    if (at.empty()) {
      problems.add("deadlock: {} waits for {}, which no rank runs", describe(s, r, next[r]),
                   wanted);
      continue;
    }
    const Position p = at.front();
    problems.add(
        "deadlock: {} waits for {}, which rank {} runs at step {}, but rank {} is stuck "
        "at {}",
        describe(s, r, next[r]), wanted, p.rank, p.step, p.rank,
        next[p.rank] < static_cast<int>(s.actions[p.rank].size())
            ? describe_step(s, p.rank, next[p.rank])
            : "its end");
  }
  if (stuck) return;
  report.simulated = true;
  double busy = 0;
  for (int r = 0; r < s.ranks; ++r) {
    report.makespan = std::max(report.makespan, free_at[r]);
    for (const TimedAction& t : report.timeline[r])
      if (t.action.type != ActionType::Idle) report.ranks[r].busy += t.end - t.start;
    busy += report.ranks[r].busy;
  }
  double idle = 0;
  for (RankReport& r : report.ranks) {
    r.idle = report.makespan - r.busy;
    idle += r.idle;
  }
  report.bubble_over_ideal = busy > 0 ? idle / busy : 0;
  report.idle_over_total = report.makespan > 0 ? idle / (s.ranks * report.makespan) : 0;
}

}  // namespace

ScheduleReport simulate_schedule(const PipelineSchedule& schedule, const TimeModel& time) {
  ScheduleReport report;
  {
    Problems problems(report.problems);
    if (!check_shape(schedule, problems)) return report;
    ActionIndex index(schedule.stages(), schedule.micro_batches);
    check_actions(schedule, index, problems);
    report.ranks.assign(static_cast<std::size_t>(schedule.ranks), {});
    count_activations(schedule, report.ranks);
    if (!report.problems.empty()) return report;
    run(schedule, time, index, report, problems);
  }
  return report;
}

}  // namespace weave::graphs
