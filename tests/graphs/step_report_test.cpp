// The step report's JSON document against the step it reports: every task with its replayed span,
// the layer view's nodes partitioning the tasks, the critical path tiling the step, a lane for
// every device and stream that holds a task, and the page holding the document whole and
// loading nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "tiny_model.hpp"
#include "weave/graphs/path_bubble.hpp"
#include "weave/graphs/prediction.hpp"
#include "weave/graphs/step_report.hpp"

namespace weave::graphs {
namespace {

TrainerConfig reported_config() {
  TrainerConfig c;
  c.model = tiny(4);
  c.plan = {.tensor_parallel = 2,
            .sequence_parallel = true,
            .expert_parallel = 2,
            .pipeline_parallel = 2,
            .micro_batch_size = 1,
            .global_batch_size = 4};
  c.machine = {.device_flops = 1e12, .device_memory_bandwidth = 1e11, .link = "nvlink4"};
  return c;
}

Prediction predicted_step() {
  return predict_step(
      reported_config(),
      {.fold_data_parallel = false, .fold_tensor_parallel = false, .fold_context_parallel = false});
}

TEST(StepReport, DocumentHoldsTheReplayedStepWhole) {
  const Prediction p = predicted_step();
  ASSERT_FALSE(p.trace.empty());
  const rt::TaskTable& tasks = p.graph.tasks();
  const nlohmann::json j =
      nlohmann::json::parse(step_report_json(p.graph, p.trace,
                                             {.title = "test",
                                              .configuration_json = R"({"plan": {"tp": 2}})",
                                              .memory = p.memory,
                                              .memory_source = "predicted"}));

  // Every task, with the span the replay gave it.
  const nlohmann::json& t = j["tasks"];
  ASSERT_EQ(t["name"].size(), tasks.size());
  rt::Nanos last_end = 0;
  for (rt::TaskId id = 0; id < tasks.size(); ++id) {
    const rt::Span* span = p.trace.find(id);
    ASSERT_NE(span, nullptr) << id;
    EXPECT_EQ(t["start"][id].get<rt::Nanos>(), span->start) << id;
    EXPECT_EQ(t["end"][id].get<rt::Nanos>(), span->end) << id;
    EXPECT_EQ(t["name"][id].get<std::string>(), tasks.name(id));
    EXPECT_EQ(t["device"][id].get<rt::DeviceId>(), tasks[id].device);
    EXPECT_EQ(t["stream"][id].get<rt::StreamId>(), tasks[id].stream);
    EXPECT_EQ(t["layer"][id].get<int>(), tasks[id].tags.layer);
    last_end = std::max(last_end, span->end);
  }
  EXPECT_EQ(j["makespan_ns"].get<rt::Nanos>(), last_end);
  EXPECT_DOUBLE_EQ(static_cast<double>(last_end) * 1e-6, p.step_ms);

  // A lane for each device and stream that holds a task, and no other.
  std::set<std::pair<rt::DeviceId, rt::StreamId>> used, lanes;
  for (rt::TaskId id = 0; id < tasks.size(); ++id)
    used.insert({tasks[id].device, tasks[id].stream});
  for (const nlohmann::json& l : j["lanes"])
    EXPECT_TRUE(
        lanes.insert({l["device"].get<rt::DeviceId>(), l["stream"].get<rt::StreamId>()}).second)
        << l.dump();
  EXPECT_EQ(lanes, used);
  std::set<rt::DeviceId> holding;
  for (const auto& lane : used)
    holding.insert(lane.first);
  EXPECT_EQ(j["devices"].get<std::set<rt::DeviceId>>(), holding);

  // The layer view's nodes partition the tasks, each node's tasks sharing its placement and tags.
  std::vector<int> seen(tasks.size(), 0);
  for (const nlohmann::json& n : j["graph"]["nodes"])
    for (const rt::TaskId id : n["tasks"].get<std::vector<rt::TaskId>>()) {
      ++seen[id];
      EXPECT_EQ(n["device"].get<rt::DeviceId>(), tasks[id].device);
      EXPECT_EQ(n["stream"].get<rt::StreamId>(), tasks[id].stream);
      EXPECT_EQ(n["layer"].get<int>(), tasks[id].tags.layer);
      EXPECT_EQ(n["phase"].get<std::string>(), rt::to_string(tasks[id].tags.phase));
    }
  for (rt::TaskId id = 0; id < tasks.size(); ++id)
    EXPECT_EQ(seen[id], 1) << tasks.name(id);
  EXPECT_EQ(j["graph"]["level"], "layer");
  EXPECT_LT(j["graph"]["nodes"].size(), tasks.size() / 4);  // collapsed

  // The critical path tiles the step from 0 to its end, each step within its task's span, and
  // each step follows the one before in the graph, on its stream or through its collective.
  const nlohmann::json& steps = j["critical_path"]["steps"];
  ASSERT_FALSE(steps.empty());
  EXPECT_EQ(j["critical_path"]["length_ns"].get<rt::Nanos>(), last_end);
  rt::Nanos at = 0;
  for (const nlohmann::json& s : steps) {
    const auto id = s["task"].get<rt::TaskId>();
    EXPECT_EQ(s["begin"].get<rt::Nanos>(), at);
    EXPECT_GE(s["begin"].get<rt::Nanos>(), p.trace.find(id)->start);
    EXPECT_EQ(s["end"].get<rt::Nanos>(), p.trace.find(id)->end);
    at = s["end"].get<rt::Nanos>();
  }
  EXPECT_EQ(at, last_end);

  // Exposed communication of the groups this plan has, none more than its streams were busy.
  std::map<std::string, rt::Nanos> exposed;
  for (const nlohmann::json& e : j["exposed"])
    exposed[e["group"]] = e["ns"].get<rt::Nanos>();
  EXPECT_TRUE(exposed.count("tp") && exposed.count("ep") && exposed.count("pipeline"))
      << j["exposed"].dump();
  for (const auto& [group, ns] : exposed) {
    rt::Nanos busy = 0;
    for (rt::TaskId id = 0; id < tasks.size(); ++id)
      if (j["streams"][tasks[id].stream]["group"] == group)
        busy += p.trace.find(id)->end - p.trace.find(id)->start;
    EXPECT_LE(ns, busy) << group;
  }
  // At the level of a node per micro-batch, the nodes partition the tasks by micro-batch.
  const nlohmann::json by_micro_batch = nlohmann::json::parse(
      step_report_json(p.graph, p.trace, {.level = rt::DetailLevel::stage_micro_batch}))["graph"];
  EXPECT_EQ(by_micro_batch["level"], "stage-micro-batch");
  std::vector<int> counted(tasks.size(), 0);
  for (const nlohmann::json& n : by_micro_batch["nodes"])
    for (const rt::TaskId id : n["tasks"].get<std::vector<rt::TaskId>>()) {
      ++counted[id];
      EXPECT_EQ(n["micro_batch"].get<int>(), tasks[id].tags.micro_batch);
      EXPECT_EQ(n["layer"].get<int>(), -1);
    }
  EXPECT_EQ(counted, std::vector<int>(tasks.size(), 1));

  EXPECT_EQ(j["memory"]["devices"].size(), p.memory.size());
  EXPECT_EQ(j["memory"]["shows"], "peak");
  EXPECT_EQ(j["configuration"]["plan"]["tp"], 2);
}

TEST(StepReport, PageInlinesTheDocumentAndLoadsNothing) {
  const Prediction p = predicted_step();
  // A task name that would end the script element if written as it is.
  const std::string json =
      step_report_json(p.graph, p.trace, {.configuration_json = R"({"data": "</script>"})"});
  const std::string page = step_report_page(json);
  const std::string open = "<script id=\"step-data\" type=\"application/json\">";
  const std::size_t begin = page.find(open);
  ASSERT_NE(begin, std::string::npos);
  const std::size_t end = page.find("</script>", begin);
  const nlohmann::json inlined =
      nlohmann::json::parse(page.substr(begin + open.size(), end - begin - open.size()));
  EXPECT_EQ(inlined, nlohmann::json::parse(json));
  EXPECT_EQ(page.find("src="), std::string::npos);
  EXPECT_EQ(page.find("http:"), std::string::npos);
  EXPECT_EQ(page.find("https:"), std::string::npos);
  EXPECT_THROW((void)step_report_json(p.graph, rt::Trace(), {}), std::invalid_argument);
}

// The memory charts' series peak at the prediction's figures, the path's kinds hold the pipeline's
// bubble as path_bubble.hpp counts it, and a step past the page's size is refused by name.
TEST(StepReport, MemoryOverTheStepBubbleAndSizeGuard) {
  const Prediction p = predicted_step();
  TrainerConfig c = reported_config();
  (void)validate(c);
  const std::vector<int> stages = pipeline_stage_of_devices(Mesh(c.plan));
  StepReportInput input{.stage_of_device = stages,
                        .memory = p.memory,
                        .memory_source = "predicted",
                        .memory_over_step = p.memory_over_step};
  const nlohmann::json j = nlohmann::json::parse(step_report_json(p.graph, p.trace, input));
  const nlohmann::json& over = j["memory"]["over_step"];
  ASSERT_EQ(over.size(), p.memory.size());
  for (std::size_t d = 0; d < over.size(); ++d) {
    std::array<std::int64_t, rt::kMemoryCategoryCount> most{};
    for (const nlohmann::json& row : over[d]["bytes"])
      for (std::size_t k = 0; k < rt::kMemoryCategoryCount; ++k)
        most[k] = std::max(most[k], row[k].get<std::int64_t>());
    EXPECT_EQ(most, p.memory[d]) << "device " << d;
  }
  const rt::CriticalPath path = rt::critical_path(p.graph, p.trace);
  const rt::Nanos bubble = pipeline_bubble(path, p.trace, stages);
  EXPECT_GT(bubble, 0);
  rt::Nanos listed = -1, steps = 0;
  for (const nlohmann::json& k : j["critical_path"]["by_kind"])
    if (k["what"] == "pipeline bubble") listed = k["ns"].get<rt::Nanos>();
  for (const nlohmann::json& s : j["critical_path"]["steps"])
    steps += s["bubble_ns"].get<rt::Nanos>();
  EXPECT_EQ(listed, bubble);
  EXPECT_EQ(steps, bubble);

  input.most_tasks = p.graph.size() - 1;
  try {
    (void)step_report_json(p.graph, p.trace, input);
    ADD_FAILURE() << "a step past most_tasks was reported";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(p.graph.size()) + " tasks"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("--graph-level"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace weave::graphs
