#include "weave/graphs/pipeline_replay_figure.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <stdexcept>
#include <tuple>

#include "weave/graphs/pipeline_schedule_svg.hpp"

namespace weave::graphs {

namespace {

ActionType action_type(rt::Phase phase, bool split_backward) {
  switch (phase) {
    case rt::Phase::forward:
      return ActionType::Forward;
    case rt::Phase::backward:
      return split_backward ? ActionType::BackwardInput : ActionType::Backward;
    case rt::Phase::weight:
      return split_backward ? ActionType::BackwardWeight : ActionType::Backward;
    case rt::Phase::none:
      break;
  }
  return ActionType::Idle;
}

struct Extent {
  rt::Nanos start = 0, end = 0;
};

}  // namespace

std::pair<PipelineSchedule, ScheduleReport> replayed_schedule(const rt::Trace& trace,
                                                              const ReplayedPipeline& pipeline) {
  const int ranks = static_cast<int>(pipeline.stage_devices.size());
  PipelineSchedule schedule{.name = pipeline.name,
                            .ranks = ranks,
                            .chunks = std::max(1, pipeline.chunks),
                            .layout = pipeline.layout,
                            .actions = {}};
  // (micro-batch, chunk, type) -> the extent of its compute tasks, per rank.
  using Key = std::tuple<int, int, int>;
  std::vector<std::map<Key, Extent>> boxes(static_cast<std::size_t>(ranks));
  std::map<rt::DeviceId, int> rank_of;
  for (int r = 0; r < ranks; ++r)
    rank_of[pipeline.stage_devices[static_cast<std::size_t>(r)]] = r;
  for (const rt::Span& s : trace.spans()) {
    const rt::TaskInfo& t = trace.tasks()[s.task];
    const auto rank = rank_of.find(t.device);
    if (rank == rank_of.end() || t.kind != rt::TaskKind::compute || t.tags.micro_batch < 0)
      continue;
    const ActionType type = action_type(t.tags.phase, pipeline.split_backward);
    if (type == ActionType::Idle) continue;
    const int chunk = t.tags.virtual_stage >= 0 && t.tags.virtual_stage < schedule.stages()
                          ? schedule.chunk_of(t.tags.virtual_stage)
                          : 0;
    const Key key{t.tags.micro_batch, chunk, static_cast<int>(type)};
    const auto [it, added] =
        boxes[static_cast<std::size_t>(rank->second)].try_emplace(key, Extent{s.start, s.end});
    if (!added) {
      it->second.start = std::min(it->second.start, s.start);
      it->second.end = std::max(it->second.end, s.end);
    }
  }
  rt::Nanos origin = 0;
  bool any = false;
  int micro_batches = 0;
  for (int r = 0; r < ranks; ++r) {
    if (boxes[static_cast<std::size_t>(r)].empty())
      throw std::invalid_argument(fmt::format(
          "pipeline rank {} (device {}) ran no task of a micro-batch in the replay: the figure "
          "needs every stage's replay",
          r, pipeline.stage_devices[static_cast<std::size_t>(r)]));
    for (const auto& [key, extent] : boxes[static_cast<std::size_t>(r)]) {
      origin = any ? std::min(origin, extent.start) : extent.start;
      any = true;
      micro_batches = std::max(micro_batches, std::get<0>(key) + 1);
    }
  }
  schedule.micro_batches = micro_batches;
  ScheduleReport report;
  report.simulated = true;
  report.timeline.resize(static_cast<std::size_t>(ranks));
  report.ranks.resize(static_cast<std::size_t>(ranks));
  const auto ms = [origin](rt::Nanos t) { return static_cast<double>(t - origin) * 1e-6; };
  for (int r = 0; r < ranks; ++r) {
    std::vector<TimedAction>& line = report.timeline[static_cast<std::size_t>(r)];
    for (const auto& [key, extent] : boxes[static_cast<std::size_t>(r)])
      line.push_back({.action = {.type = static_cast<ActionType>(std::get<2>(key)),
                                 .micro_batch = std::get<0>(key),
                                 .chunk = std::get<1>(key)},
                      .start = ms(extent.start),
                      .end = ms(extent.end)});
    std::sort(line.begin(), line.end(),
              [](const TimedAction& a, const TimedAction& b) { return a.start < b.start; });
    std::vector<Action> actions;
    for (std::size_t i = 0; i < line.size(); ++i) {
      line[i].step = static_cast<int>(i);
      actions.push_back(line[i].action);
      report.ranks[static_cast<std::size_t>(r)].busy += line[i].end - line[i].start;
      report.makespan = std::max(report.makespan, line[i].end);
    }
    schedule.actions.push_back(std::move(actions));
  }
  double busy = 0, idle = 0;
  for (RankReport& rank : report.ranks) {
    rank.idle = report.makespan - rank.busy;
    busy += rank.busy;
    idle += rank.idle;
  }
  report.bubble_over_ideal = busy > 0 ? idle / busy : 0;
  report.idle_over_total = report.makespan > 0 ? idle / (ranks * report.makespan) : 0;
  return {std::move(schedule), std::move(report)};
}

std::string render_replayed_pipeline_svg(const rt::Trace& trace, const ReplayedPipeline& pipeline) {
  const auto [schedule, report] = replayed_schedule(trace, pipeline);
  return render_schedule_svg(
      schedule, report,
      {.time_axis = "ms on the virtual clock (a box: one micro-batch's tasks of one phase on the "
                    "stage, from the first's start to the last's end)",
       .fill_width = true});
}

}  // namespace weave::graphs
