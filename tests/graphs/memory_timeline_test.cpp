// Memory over a step: a predicted step's series per device reach, for every category and in
// total, exactly the peaks the prediction's trackers counted (what weave predict prints), rise
// only as the step reaches new buffers, and span the replay; and events land at the start of the
// first task built after them.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "tiny_model.hpp"
#include "weave/graphs/memory_timeline.hpp"
#include "weave/graphs/prediction.hpp"
#include "weave/runtime/cost_model.hpp"
#include "weave/runtime/graph.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::graphs {
namespace {

TEST(MemoryTimeline, PredictedSeriesPeakAtTheTrackersPeaks) {
  TrainerConfig c;
  c.model = tiny(4);
  c.plan = {.data_parallel = 2,
            .pipeline_parallel = 2,
            .micro_batch_size = 1,
            .global_batch_size = 8,
            .distributed_optimizer = true};
  c.machine = {.device_flops = 1e12, .device_memory_bandwidth = 1e11, .link = "nvlink4"};
  // Replicas folded, as weave predict --report does: a folded device shows its source's series.
  const Prediction p = predict_step(c, {.fold_tensor_parallel = false});
  ASSERT_FALSE(p.trace.empty());
  const MemoryTimeline& m = p.memory_over_step;
  ASSERT_EQ(m.devices.size(), p.memory.size());
  const rt::Nanos makespan = std::llround(p.step_ms * 1e6);
  for (std::size_t d = 0; d < m.devices.size(); ++d) {
    for (std::size_t k = 0; k < rt::kMemoryCategoryCount; ++k)
      EXPECT_EQ(m.peak(d, static_cast<rt::MemoryCategory>(k)), p.memory[d][k])
          << "device " << d << ", " << rt::to_string(static_cast<rt::MemoryCategory>(k));
    EXPECT_EQ(m.peak_total(d), p.memory_total[d]) << "device " << d;
    const std::vector<MemoryPoint>& points = m.devices[d];
    ASSERT_GE(points.size(), 3U);
    EXPECT_EQ(points.front().at, 0);
    EXPECT_EQ(std::accumulate(points.front().bytes.begin(), points.front().bytes.end(), 0LL), 0);
    EXPECT_EQ(points.back().at, makespan);
    for (std::size_t i = 1; i < points.size(); ++i)
      EXPECT_LE(points[i - 1].at, points[i].at);
  }
  // The parameters are held from the start; the activations are reached during the step, not all
  // before the first task.
  const std::vector<MemoryPoint>& first = m.devices[0];
  const auto activations = static_cast<std::size_t>(rt::MemoryCategory::activations);
  const auto parameters = static_cast<std::size_t>(rt::MemoryCategory::parameters);
  std::int64_t at_zero = 0, parameters_at_zero = 0;
  for (const MemoryPoint& point : first)
    if (point.at == 0) {
      at_zero = point.bytes[activations];
      parameters_at_zero = point.bytes[parameters];
    }
  EXPECT_EQ(parameters_at_zero, p.memory[0][parameters]);
  EXPECT_LT(at_zero, p.memory[0][activations]);
  EXPECT_GT(p.memory[0][activations], 0);
}

// Without the series (PredictionOptions::memory_over_step false, as weave predict without
// --report and --advise ask): none kept, the figures and peaks the same.
TEST(MemoryTimeline, APredictionWithoutTheSeriesKeepsTheSameFigures) {
  TrainerConfig c;
  c.model = tiny(4);
  c.plan = {
      .data_parallel = 2, .pipeline_parallel = 2, .micro_batch_size = 1, .global_batch_size = 8};
  c.machine = {.device_flops = 1e12, .device_memory_bandwidth = 1e11, .link = "nvlink4"};
  const Prediction with = predict_step(c), without = predict_step(c, {.memory_over_step = false});
  EXPECT_EQ(with.memory_over_step.devices.size(), with.memory.size());
  EXPECT_TRUE(without.memory_over_step.devices.empty());
  EXPECT_EQ(without.step_ms, with.step_ms);
  EXPECT_EQ(without.memory, with.memory);
  EXPECT_EQ(without.memory_total, with.memory_total);
  EXPECT_EQ(without.tasks_built, with.tasks_built);
}

TEST(MemoryTimeline, EventsLandAtTheNextTaskBuilt) {
  // Two tasks on one stream: a for 100 ns, then b for 50 ns (1 FLOP a ns).
  rt::GraphBuilder b;
  b.add({.name = "a", .cost = {.flops = 100}});
  b.add({.name = "b", .cost = {.flops = 50}});
  const rt::Graph g = b.build();
  const rt::UniformCostModel costs(1e9, 0, 1e9);
  const rt::Trace trace =
      rt::VirtualClock(costs, {.execute = false, .record_trace = true}).run(g).trace;
  const auto act = rt::MemoryCategory::activations;
  const auto par = rt::MemoryCategory::parameters;
  // Built: parameters before any task, a buffer for task b (after a was built), a temporary
  // released at once, and a buffer past the last task.
  const std::vector<MemoryEvent> events = {
      {.device = 0, .category = par, .bytes = 64},
      {.device = 0, .category = act, .bytes = 32, .tasks_built = 1},
      {.device = 0, .category = act, .bytes = 8, .tasks_built = 1},
      {.device = 0, .category = act, .bytes = -8, .tasks_built = 1},
      {.device = 1, .category = act, .bytes = 4, .tasks_built = 2}};
  const MemoryTimeline m = memory_timeline(events, trace, 2);
  ASSERT_EQ(m.devices[0].size(), 6U);
  EXPECT_EQ(m.devices[0][1].at, 0);
  EXPECT_EQ(m.devices[0][2].at, 100);  // b starts when a ends
  EXPECT_EQ(m.devices[0][2].bytes[static_cast<std::size_t>(act)], 32);
  EXPECT_EQ(m.peak(0, act), 40);  // the temporary counts
  EXPECT_EQ(m.peak_total(0), 104);
  EXPECT_EQ(m.devices[0].back().at, 150);
  EXPECT_EQ(m.devices[1][1].at, 150);  // past the last task: the step's end
  EXPECT_EQ(m.peak(1, act), 4);
  EXPECT_THROW(memory_timeline(events, trace, 1), std::invalid_argument);
}

}  // namespace
}  // namespace weave::graphs
