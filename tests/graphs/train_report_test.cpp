// What weave train --report and --critical-path read from a run: the spans of iteration
// trace_iteration with the graph that ran (TrainerCallbacks::traced), the critical path on the
// wall clock taken from them into the report, and each device's memory over the step recorded
// while the step was built (TrainerConfig::record_step_memory), peaking at what the trackers
// measured over the run, without changing a bit of the losses. And the report's size guard,
// which refuses a step too large once it is built, before it is replayed.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "tiny_model.hpp"
#include "weave/graphs/path_bubble.hpp"
#include "weave/graphs/prediction.hpp"
#include "weave/graphs/step_report.hpp"
#include "weave/graphs/token_dataset.hpp"
#include "weave/graphs/trainer.hpp"
#include "weave/graphs/virtual_replay.hpp"
#include "weave/runtime/critical_path.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::graphs {
namespace {

// The tiny MoE model on two devices, expert and data parallel, over byte tokens.
TrainerConfig shown_config(bool record_memory) {
  TrainerConfig c;
  c.model = tiny(4);
  c.model.vocab_size = 256;
  c.plan = {
      .expert_parallel = 2, .data_parallel = 2, .micro_batch_size = 2, .global_batch_size = 8};
  c.learning_rate = {.lr = 1e-2, .min_lr = 1e-3, .warmup_iters = 2};
  c.train_iters = 3;
  c.trace_iteration = 2;
  c.pin_devices = false;
  c.record_step_memory = record_memory;
  return c;
}

struct Shown {
  std::vector<double> losses, norms;
  int traced_calls = 0;
  std::int64_t traced_iteration = 0;
  rt::Trace trace;
  std::optional<rt::CriticalPath> path;
};

Shown run(Trainer& trainer) {
  Shown s;
  trainer.run({.iteration =
                   [&](const IterationMetrics& m) {
                     s.losses.push_back(m.loss);
                     s.norms.push_back(m.grad_norm);
                     return TrainingControl::proceed;
                   },
               .traced =
                   [&](std::int64_t iteration, const rt::Graph& graph, const rt::Trace& trace) {
                     ++s.traced_calls;
                     s.traced_iteration = iteration;
                     s.trace = trace;
                     s.path = rt::wall_critical_path(graph, trace);
                   }});
  return s;
}

TEST(TrainReport, WallPathAndMemoryOverTheStepOfARun) {
  const TrainerConfig plain = shown_config(false), recorded = shown_config(true);
  Trainer without(plain, TrainingData::from(TokenDataset::mock(16, plain.model.seed)));
  Trainer with(recorded, TrainingData::from(TokenDataset::mock(16, recorded.model.seed)));
  const Shown a = run(without), b = run(with);
  // Recording the build's memory changes no bit of training.
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_EQ(a.norms, b.norms);
  EXPECT_TRUE(without.step().memory_events().empty());

  // The spans of iteration trace_iteration, once, every task of the step that ran.
  const rt::Graph& graph = with.step().graph();
  ASSERT_EQ(b.traced_calls, 1);
  EXPECT_EQ(b.traced_iteration, 2);
  ASSERT_EQ(b.trace.clock(), rt::ClockKind::wall);
  ASSERT_EQ(b.trace.spans().size(), graph.size());
  EXPECT_EQ(&b.trace.tasks(), &graph.tasks());

  // Memory over the step, placed on the virtual clock's replay, peaks at the trackers' figures.
  const rt::Trace replay = rt::VirtualClock(machine_model(with.devices(), with.config().machine),
                                            {.execute = false, .record_trace = true})
                               .run(graph)
                               .trace;
  const rt::MemoryTracker& memory = with.devices().memory();
  const MemoryTimeline over = memory_timeline(with.step().memory_events(), replay, 2);
  ASSERT_EQ(over.devices.size(), 2u);
  std::vector<std::array<std::int64_t, rt::kMemoryCategoryCount>> peaks(2);
  for (std::size_t d = 0; d < 2; ++d) {
    for (std::size_t k = 0; k < rt::kMemoryCategoryCount; ++k) {
      const auto category = static_cast<rt::MemoryCategory>(k);
      peaks[d][k] = memory.peak(static_cast<rt::DeviceId>(d), category);
      EXPECT_EQ(over.peak(d, category), peaks[d][k]) << "device " << d << " category " << k;
    }
    EXPECT_EQ(over.peak_total(d), memory.peak_total(static_cast<rt::DeviceId>(d)));
    EXPECT_GT(over.peak_total(d), 0);
  }

  // The report holds the run's path on the wall clock: the step's span from its recorded spans,
  // its shares summing to it.
  ASSERT_TRUE(b.path.has_value());
  StepReportInput input{.memory = peaks,
                        .memory_source = "measured",
                        .memory_over_step = over,
                        .wall_critical_path = *b.path,
                        .wall_trace = b.trace,
                        .wall_iteration = b.traced_iteration};
  const nlohmann::json j = nlohmann::json::parse(step_report_json(graph, replay, input));
  rt::Nanos first = b.trace.spans()[0].start, last = b.trace.spans()[0].end;
  for (const rt::Span& s : b.trace.spans()) {
    first = std::min(first, s.start);
    last = std::max(last, s.end);
  }
  const nlohmann::json& wall = j["wall_critical_path"];
  ASSERT_TRUE(wall.is_object()) << j["wall_critical_path"];
  EXPECT_EQ(wall["iteration"], 2);
  EXPECT_EQ(wall["start_ns"].get<rt::Nanos>(), first);
  EXPECT_EQ(wall["length_ns"].get<rt::Nanos>(), last - first);
  for (const char* list : {"by_kind", "by_wait"}) {
    rt::Nanos total = 0;
    for (const nlohmann::json& k : wall[list])
      total += k["ns"].get<rt::Nanos>();
    EXPECT_EQ(total, last - first) << list;
  }
  rt::Nanos tiled = 0;
  for (const nlohmann::json& s : wall["steps"])
    tiled += s["end"].get<rt::Nanos>() - s["begin"].get<rt::Nanos>() + s["waited"].get<rt::Nanos>();
  EXPECT_EQ(tiled, last - first);
  // A prediction's page has none.
  EXPECT_TRUE(
      nlohmann::json::parse(step_report_json(graph, replay, {}))["wall_critical_path"].is_null());
}

TEST(TrainReport, SizeGuardRefusesByTheCountBeforeTheReplay) {
  EXPECT_NO_THROW(check_report_size(kStepReportMostTasks));
  EXPECT_NO_THROW(check_report_size(9, 9));
  EXPECT_THROW(check_report_size(10, 9), std::invalid_argument);
  try {
    check_report_size(kStepReportMostTasks + 1);
    ADD_FAILURE() << "a step past the page's size was allowed";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("100001 tasks, more than the 100000"), std::string::npos)
        << e.what();
  }
  // A prediction asked to refuse it does so naming the step's size (the count of the graph it
  // would have replayed), and one within the size predicts.
  TrainerConfig c = shown_config(false);
  c.machine = {.device_flops = 1e12, .device_memory_bandwidth = 1e11, .link = "nvlink4"};
  const Prediction p = predict_step(c, {.fold_data_parallel = false});
  const std::size_t tasks = p.graph.size();
  ASSERT_GT(tasks, 0u);
  EXPECT_NO_THROW((void)predict_step(c, {.fold_data_parallel = false, .most_tasks = tasks}));
  try {
    (void)predict_step(c, {.fold_data_parallel = false, .most_tasks = tasks - 1});
    ADD_FAILURE() << "a prediction past most_tasks was replayed";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(tasks) + " tasks"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace weave::graphs
