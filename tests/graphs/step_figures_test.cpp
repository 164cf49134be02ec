// The figures drawn from a replayed step: the Ampipe figure's lanes are the streams the layer's
// tasks used, every chunk of every kind of the layer is there in both phases, each box sits at its
// task's replayed start and end on the virtual clock, and the red hatch is the communication time
// the device computed nothing through; the pipeline figure of a p=8, m=32 step numbers every
// micro-batch in every stage's row at the replayed times, coloured by phase.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <map>
#include <regex>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "tiny_model.hpp"
#include "weave/graphs/ampipe_figure.hpp"
#include "weave/graphs/pipeline_replay_figure.hpp"
#include "weave/graphs/prediction.hpp"

namespace weave::graphs {
namespace {

// A step replayed with every task kept (as weave predict keeps it when it draws a figure).
Prediction replay(const ModelConfig& m, const ParallelPlan& plan) {
  TrainerConfig c;
  c.model = m;
  c.plan = plan;
  c.machine = {.device_flops = 1e12, .device_memory_bandwidth = 1e11, .link = "nvlink4"};
  return predict_step(c, {.fold_tensor_parallel = false, .fold_context_parallel = false});
}

ParallelPlan ampipe_plan(int degree) {
  return {.tensor_parallel = 2,
          .sequence_parallel = true,
          .expert_parallel = 2,
          .data_parallel = 2,
          .micro_batch_size = 1,
          .global_batch_size = 2,
          .ampipe_degree = degree};
}

ModelConfig one_moe_layer() {
  ModelConfig m = tiny(4);
  m.num_layers = 1;
  m.moe_layer_freq = 1;
  m.seq_length = 64;
  return m;
}

struct Drawn {
  rt::TaskId task;
  std::string kind, phase;
  int chunk;
  double x, width;
};

std::vector<Drawn> boxes_in(const std::string& svg) {
  const std::regex box(
      "class=\"task\" data-task=\"([0-9]+)\" data-kind=\"([^\"]*)\" data-phase=\"([FBW])\" "
      "data-chunk=\"(-?[0-9]+)\" x=\"([0-9.]+)\" y=\"[0-9.]+\" width=\"([0-9.]+)\"");
  std::vector<Drawn> out;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), box); it != std::sregex_iterator();
       ++it)
    out.push_back({static_cast<rt::TaskId>(std::stoul((*it)[1])), (*it)[2], (*it)[3],
                   std::stoi((*it)[4]), std::stod((*it)[5]), std::stod((*it)[6])});
  return out;
}

std::vector<std::string> all_of(const std::string& svg, const std::string& pattern) {
  const std::regex re(pattern);
  std::vector<std::string> out;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), re); it != std::sregex_iterator();
       ++it)
    out.push_back((*it)[1]);
  return out;
}

// The test's own selection: device 0's tasks of `layer`, micro-batch 0, by panel (forward, the
// rest), with each panel's extent on the virtual clock.
struct Expected {
  std::vector<rt::TaskId> tasks[2];
  rt::Nanos first[2] = {0, 0}, last[2] = {0, 0};
  std::set<std::string> streams[2];
};

Expected expected_of(const rt::Trace& trace, int layer) {
  Expected e;
  for (const rt::Span& s : trace.spans()) {
    const rt::TaskInfo& t = trace.tasks()[s.task];
    if (t.device != 0 || t.tags.layer != layer || t.tags.phase == rt::Phase::none ||
        t.tags.micro_batch > 0)
      continue;
    const int panel = t.tags.phase == rt::Phase::forward ? 0 : 1;
    if (e.tasks[panel].empty() || s.start < e.first[panel]) e.first[panel] = s.start;
    e.last[panel] = std::max(e.last[panel], s.end);
    e.tasks[panel].push_back(s.task);
    e.streams[panel].insert(std::string(trace.tasks().stream_name(t.stream)));
  }
  return e;
}

// The time within [start, end) that no compute task of device 0 covers, by brute force over
// the compute spans' edges.
rt::Nanos uncovered(const rt::Trace& trace, rt::Nanos start, rt::Nanos end) {
  std::vector<rt::Nanos> edges{start, end};
  std::vector<const rt::Span*> compute;
  for (const rt::Span& s : trace.spans())
    if (trace.tasks()[s.task].device == 0 && trace.tasks()[s.task].kind == rt::TaskKind::compute) {
      compute.push_back(&s);
      for (const rt::Nanos t : {s.start, s.end})
        if (t > start && t < end) edges.push_back(t);
    }
  std::sort(edges.begin(), edges.end());
  rt::Nanos free = 0;
  for (std::size_t i = 0; i + 1 < edges.size(); ++i) {
    const rt::Nanos mid_lo = edges[i], mid_hi = edges[i + 1];
    if (mid_hi <= mid_lo) continue;
    const bool covered = std::any_of(compute.begin(), compute.end(), [&](const rt::Span* s) {
      return s->start <= mid_lo && s->end >= mid_hi;
    });
    if (!covered) free += mid_hi - mid_lo;
  }
  return free;
}

TEST(StepFigures, AmpipeFigurePlacesEveryChunksTasksAtTheirReplayedTimes) {
  const Prediction p = replay(one_moe_layer(), ampipe_plan(2));
  const std::string svg = render_ampipe_figure(p.trace, {.layer = 0, .device = 0});
  const Expected e = expected_of(p.trace, 0);
  const std::vector<Drawn> drawn = boxes_in(svg);
  ASSERT_EQ(drawn.size(), e.tasks[0].size() + e.tasks[1].size());

  // Lanes: each panel's streams, by their names, compute first.
  const std::vector<std::string> lanes = all_of(svg, "class=\"lane\"[^>]*>([^<]*)</text>");
  ASSERT_EQ(lanes.size(), e.streams[0].size() + e.streams[1].size());
  EXPECT_EQ(lanes.front(), "compute");
  EXPECT_EQ(std::set<std::string>(lanes.begin(), lanes.begin() + e.streams[0].size()),
            e.streams[0]);
  EXPECT_GE(e.streams[0].size(), 2u);  // compute and the expert all-to-alls' stream at least

  // Every kind of the layer's Ampipe work, both chunks, forward and backward.
  std::set<std::tuple<std::string, std::string, int>> seen;
  for (const Drawn& d : drawn)
    for (const char* kind : {"attention", "dispatch", "expert", "combine"})
      if (d.kind.find(kind) != std::string::npos) seen.insert({kind, d.phase, d.chunk});
  for (const char* kind : {"attention", "dispatch", "expert", "combine"})
    for (const char* phase : {"F", "B"})
      for (int c = 0; c < 2; ++c)
        EXPECT_TRUE(seen.contains({kind, phase, c})) << kind << " " << phase << c;

  // Every box at its task's start and end, scaled into its panel.
  for (const Drawn& d : drawn) {
    const int panel = d.phase == "F" ? 0 : 1;
    const rt::Span* s = p.trace.find(d.task);
    ASSERT_NE(s, nullptr);
    EXPECT_EQ(std::count(e.tasks[panel].begin(), e.tasks[panel].end(), d.task), 1);
    const double scale =
        kAmpipeFigurePlotWidth / static_cast<double>(e.last[panel] - e.first[panel]);
    EXPECT_NEAR(d.x, kAmpipeFigureLeft + static_cast<double>(s->start - e.first[panel]) * scale,
                0.006);
    EXPECT_NEAR(d.x + d.width,
                kAmpipeFigureLeft + static_cast<double>(s->end - e.first[panel]) * scale, 0.012);
  }

  // The phase and chunk are legible in every box wide enough for them (30 px).
  const std::regex parts(
      "data-phase=\"([FBW])\" data-chunk=\"(-?[0-9]+)\" x=\"[0-9.]+\" "
      "y=\"[0-9.]+\" width=\"([0-9.]+)\"");
  const std::regex label("class=\"label\"[^>]*font-size=\"([0-9.]+)\"[^>]*>([^<]*)</text>");
  int legible = 0;
  for (const std::string& line : all_of(svg, "(<g><title>[^\n]*)")) {
    std::smatch box, text;
    ASSERT_TRUE(std::regex_search(line, box, parts)) << line;
    if (std::stod(box[3]) < 30) continue;
    ASSERT_TRUE(std::regex_search(line, text, label)) << line;
    const std::string chunk = box[2].str() == "-1" ? "" : box[2].str();
    const std::string wanted = box[1].str() + chunk;
    EXPECT_TRUE(text[2].str() == wanted || text[2].str().ends_with(" " + wanted)) << line;
    EXPECT_GE(std::stod(text[1]), 5.0) << line;
    ++legible;
  }
  EXPECT_GT(legible, 8);

  // The red hatch: the communication time during which device 0 computed nothing.
  double hatched = 0;
  for (const std::string& w : all_of(svg,
                                     "class=\"exposed\" x=\"[0-9.]+\" y=\"[0-9.]+\" "
                                     "width=\"([0-9.]+)\""))
    hatched += std::stod(w);
  double expected_hatch = 0;
  for (int panel = 0; panel < 2; ++panel)
    for (const rt::TaskId t : e.tasks[panel])
      if (p.trace.tasks()[t].kind != rt::TaskKind::compute) {
        const rt::Span* s = p.trace.find(t);
        expected_hatch += static_cast<double>(uncovered(p.trace, s->start, s->end)) *
                          kAmpipeFigurePlotWidth /
                          static_cast<double>(e.last[panel] - e.first[panel]);
      }
  EXPECT_GT(expected_hatch, 0);
  EXPECT_NEAR(hatched, expected_hatch, 0.02 * static_cast<double>(drawn.size()));
}

// Under full recomputation the second forward runs within the backward and is drawn there: the
// forward panel holds the first forward alone and ends before the backward panel starts.
TEST(StepFigures, AmpipeFigureDrawsTheRecomputedForwardWithTheBackward) {
  ModelConfig m = one_moe_layer();
  const std::string plain = render_ampipe_figure(replay(m, ampipe_plan(2)).trace, {});
  m.recompute = {.granularity = RecomputeGranularity::full,
                 .method = RecomputeMethod::uniform,
                 .num_layers = 1};
  const std::string recomputed = render_ampipe_figure(replay(m, ampipe_plan(2)).trace, {});
  const auto numbers = [](const std::string& svg, const char* name) {
    std::smatch m;
    const std::string pattern = fmt::format(
        "class=\"panel\"[^>]*>{} \\(([0-9]+) tasks, ([0-9.]+) ms from ([0-9.]+) ms", name);
    EXPECT_TRUE(std::regex_search(svg, m, std::regex(pattern))) << name;
    return std::array<double, 3>{std::stod(m[1]), std::stod(m[2]), std::stod(m[3])};
  };
  const auto forward = numbers(recomputed, "Forward"), backward = numbers(recomputed, "Backward");
  EXPECT_EQ(forward[0], numbers(plain, "Forward")[0]);
  EXPECT_GT(backward[0], numbers(plain, "Backward")[0]);
  EXPECT_LE(forward[2] + forward[1], backward[2] + 0.0015);
  EXPECT_GT(boxes_in(recomputed).size(), boxes_in(plain).size());
}

// Without Ampipe the layer is drawn as one chunk; a layer or a device the replay does not have is
// refused naming what there is.
TEST(StepFigures, AmpipeFigureOfAnUnsplitLayerAndWrongRequests) {
  const Prediction p = replay(one_moe_layer(), ampipe_plan(1));
  const std::string svg = render_ampipe_figure(p.trace, {.layer = 0, .device = 0});
  const std::vector<Drawn> drawn = boxes_in(svg);
  ASSERT_FALSE(drawn.empty());
  for (const Drawn& d : drawn)
    EXPECT_EQ(d.chunk, -1) << d.kind;
  EXPECT_NE(svg.find("one chunk: the layer is not split"), std::string::npos);
  EXPECT_FALSE(all_of(svg, "class=\"task\"[^>]*data-kind=\"(dispatch[^\"]*)\"").empty());

  const auto refusal = [&](const AmpipeFigureRequest& r) {
    try {
      (void)render_ampipe_figure(p.trace, r);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("not refused");
  };
  EXPECT_NE(refusal({.layer = 3, .device = 0}).find("which runs layer 0"), std::string::npos)
      << refusal({.layer = 3, .device = 0});
  EXPECT_NE(refusal({.layer = 0, .device = 9}).find("its devices are 0 to"), std::string::npos)
      << refusal({.layer = 0, .device = 9});
  EXPECT_THROW((void)render_ampipe_figure(rt::Trace(), {}), std::invalid_argument);
}

// p=8, m=32 on the virtual clock: every stage's row holds micro-batches 0..31 in both phases,
// each box spans its tasks' replayed times, and colour follows the phase alone.
TEST(StepFigures, PipelineFigureOfAReplayedStepNumbersEveryMicroBatchByPhase) {
  ModelConfig m = tiny(0);
  m.num_layers = 8;
  const ParallelPlan plan{.pipeline_parallel = 8, .micro_batch_size = 1, .global_batch_size = 32};
  const Prediction p = replay(m, plan);
  ReplayedPipeline pipeline{.name = "1f1b", .stage_devices = {}, .chunks = 1};
  for (rt::DeviceId d = 0; d < 8; ++d)
    pipeline.stage_devices.push_back(d);
  const auto [schedule, report] = replayed_schedule(p.trace, pipeline);
  ASSERT_EQ(schedule.ranks, 8);
  EXPECT_EQ(schedule.micro_batches, 32);

  // The boxes' extents from the trace, by the test: per (device, micro-batch, phase).
  std::map<std::tuple<int, int, int>, std::pair<rt::Nanos, rt::Nanos>> extent;
  rt::Nanos origin = -1;
  for (const rt::Span& s : p.trace.spans()) {
    const rt::TaskInfo& t = p.trace.tasks()[s.task];
    if (t.device >= 8 || t.kind != rt::TaskKind::compute || t.tags.micro_batch < 0 ||
        t.tags.phase == rt::Phase::none)
      continue;
    const int phase = t.tags.phase == rt::Phase::forward ? 0 : 1;
    auto [it, added] = extent.try_emplace({static_cast<int>(t.device), t.tags.micro_batch, phase},
                                          std::pair{s.start, s.end});
    it->second.first = std::min(it->second.first, s.start);
    it->second.second = std::max(it->second.second, s.end);
    origin = origin < 0 ? s.start : std::min(origin, s.start);
  }
  for (int r = 0; r < 8; ++r) {
    const auto& line = report.timeline[static_cast<std::size_t>(r)];
    ASSERT_EQ(line.size(), 64u) << r;
    for (const TimedAction& a : line) {
      const int phase = a.action.type == ActionType::Forward ? 0 : 1;
      const auto& [start, end] = extent.at({r, a.action.micro_batch, phase});
      EXPECT_NEAR(a.start, static_cast<double>(start - origin) * 1e-6, 1e-9);
      EXPECT_NEAR(a.end, static_cast<double>(end - origin) * 1e-6, 1e-9);
    }
  }

  const std::string svg = render_replayed_pipeline_svg(p.trace, pipeline);
  const std::regex box(
      "<g><title>rank ([0-9]+) step [0-9]+: ([FB])[^<]*</title><rect class=\"action\" "
      "x=\"[0-9.]+\" y=\"[0-9.]+\" width=\"([0-9.]+)\"[^>]*fill=\"(#[0-9a-f]{6})\"[^>]*/>"
      "<text class=\"micro-batch\"[^>]*font-size=\"([0-9.]+)\"[^>]*>([0-9]+)</text></g>");
  std::map<int, std::map<char, std::set<int>>> numbers;
  std::map<char, std::set<std::string>> fills;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), box); it != std::sregex_iterator();
       ++it) {
    const char phase = (*it)[2].str()[0];
    numbers[std::stoi((*it)[1])][phase].insert(std::stoi((*it)[6]));
    fills[phase].insert((*it)[4]);
    EXPECT_GE(std::stod((*it)[5]), 5.0) << (*it)[0];
  }
  std::set<int> all;
  for (int mb = 0; mb < 32; ++mb)
    all.insert(mb);
  ASSERT_EQ(numbers.size(), 8u);
  for (const auto& [rank, by_phase] : numbers) {
    EXPECT_EQ(by_phase.at('F'), all) << rank;
    EXPECT_EQ(by_phase.at('B'), all) << rank;
  }
  ASSERT_EQ(fills.size(), 2u);
  EXPECT_EQ(fills['F'].size(), 1u);
  EXPECT_EQ(fills['B'].size(), 1u);
  EXPECT_NE(*fills['F'].begin(), *fills['B'].begin());
  EXPECT_NE(svg.find("width=\"1600\""), std::string::npos);

  // A stage device the replay has no micro-batch's task of is named.
  pipeline.stage_devices.back() = 99;
  try {
    (void)replayed_schedule(p.trace, pipeline);
    ADD_FAILURE() << "not refused";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("pipeline rank 7 (device 99)"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace weave::graphs
