// The pipeline's bubble on the critical path of a two-stage step with one micro-batch: the stage
// that ends the step waits, between its forward and its backward, for the other stage's forward
// and backward and the transfers there and back; the bubble is exactly that wait read from the
// replay's spans by their phase (the tied embedding's and the gradient norm's collectives, also
// idle time of the stage, are their groups' communication, not the schedule's); without a
// pipeline there is none.
#include <gtest/gtest.h>

#include <algorithm>

#include "tiny_model.hpp"
#include "weave/graphs/path_bubble.hpp"
#include "weave/graphs/prediction.hpp"

namespace weave::graphs {
namespace {

TrainerConfig two_stages(int pipeline) {
  TrainerConfig c;
  c.model = tiny(4);
  c.plan = {.pipeline_parallel = pipeline, .micro_batch_size = 1, .global_batch_size = 1};
  c.machine = {.device_flops = 1e12, .device_memory_bandwidth = 1e11, .link = "nvlink4"};
  return c;
}

// What the schedule leaves device `d`'s compute stream idle with one micro-batch: from the end of
// its forward to the start of its backward, the other stage's forward and backward and the two
// transfers between them.
rt::Nanos idle_between_forward_and_backward(const rt::Trace& trace, rt::DeviceId d) {
  rt::Nanos forward_end = 0, backward_start = -1;
  for (const rt::Span& s : trace.spans()) {
    const rt::TaskInfo& t = trace.tasks()[s.task];
    if (t.device != d || t.stream != rt::kComputeStream) continue;
    if (t.tags.phase == rt::Phase::forward) forward_end = std::max(forward_end, s.end);
    if (t.tags.phase == rt::Phase::backward && (backward_start < 0 || s.start < backward_start))
      backward_start = s.start;
  }
  return backward_start - forward_end;
}

TEST(PathBubble, EqualsTheLastStagesWaitBetweenItsForwardAndBackward) {
  const TrainerConfig c = two_stages(2);
  const Prediction p = predict_step(c, {.fold_micro_batches = false});
  const rt::CriticalPath path = rt::critical_path(p.graph, p.trace);
  const std::vector<int> stages = pipeline_stage_of_devices(Mesh(c.plan));
  ASSERT_EQ(stages, (std::vector<int>{0, 1}));
  const rt::DeviceId last = p.graph.tasks()[path.steps.back().task].device;
  const rt::Nanos bubble = pipeline_bubble(path, p.trace, stages);
  EXPECT_GT(bubble, 0);
  EXPECT_EQ(bubble, idle_between_forward_and_backward(p.trace, last));
  // The summary moves that time out of the other kinds into "pipeline bubble", the total kept.
  const rt::CriticalPathSummary summary = summarize_with_bubble(path, p.trace, stages);
  rt::Nanos total = 0, named = -1;
  for (const rt::PathShare& s : summary.by_kind) {
    total += s.time;
    if (s.what == "pipeline bubble") named = s.time;
  }
  EXPECT_EQ(total, path.length);
  EXPECT_EQ(named, bubble);
}

TEST(PathBubble, NoneWithoutAPipeline) {
  const TrainerConfig c = two_stages(1);
  const Prediction p = predict_step(c, {.fold_micro_batches = false});
  const rt::CriticalPath path = rt::critical_path(p.graph, p.trace);
  EXPECT_EQ(pipeline_bubble(path, p.trace, pipeline_stage_of_devices(Mesh(c.plan))), 0);
}

}  // namespace
}  // namespace weave::graphs
