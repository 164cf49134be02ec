// Faults injected into training steps (rt::FaultPlan on the devices' executor): a task of the
// forward, the backward or the optimizer throws, or a collective member never arrives (inside an
// Ampipe chunk, a pipeline transfer, a data-parallel gradient bucket), on a chosen device and
// iteration. The step must fail with an error naming the task and its device (and, for a member
// that never arrives, the collective and the members that did), the iterations before it stay
// done, and the same devices then train again exactly as devices that never saw a fault.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tiny_model.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/graphs/token_dataset.hpp"
#include "weave/graphs/trainer.hpp"
#include "weave/runtime/error.hpp"
#include "weave/runtime/fault_plan.hpp"

namespace weave::graphs {
namespace {

// How long a run waits with nothing running before the watchdog names what it waits for: far
// above any pause of a healthy run, far below a test's timeout.
constexpr rt::Nanos kStallTimeout = 2'000'000'000;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The tiny MoE model over byte tokens on 2 devices: expert and data parallel with Ampipe
// degree 2 (layer 0 is the MoE layer), or a 2-stage pipeline.
TrainerConfig moe_ampipe_config() {
  TrainerConfig c;
  c.model = tiny(4);
  c.model.vocab_size = 256;
  c.plan = {.expert_parallel = 2,
            .data_parallel = 2,
            .micro_batch_size = 2,
            .global_batch_size = 8,
            .ampipe_degree = 2};
  c.learning_rate = {.lr = 1e-2, .min_lr = 1e-3, .warmup_iters = 2};
  c.train_iters = 4;
  c.pin_devices = false;
  return c;
}

TrainerConfig pipeline_config() {
  TrainerConfig c = moe_ampipe_config();
  c.model = tiny(0);
  c.model.vocab_size = 256;
  c.plan = {.pipeline_parallel = 2, .micro_batch_size = 1, .global_batch_size = 4};
  return c;
}

TrainingData mock_data(const TrainerConfig& c) {
  return TrainingData::from(TokenDataset::mock(c.model.seq_length, c.model.seed));
}

std::vector<double> losses(Trainer& trainer) {
  std::vector<double> out;
  trainer.run({.iteration = [&](const IterationMetrics& m) {
    out.push_back(m.loss);
    return TrainingControl::proceed;
  }});
  return out;
}

// Trains config.train_iters iterations with `point` planned for iteration `iteration` (run
// iteration - 1: no evaluation runs in between); checks that the error blames `task` and says
// each of `says`, and that the iterations before it are done; then trains a new Trainer on the
// same devices without faults and checks it gives a fault-free run's losses.
void expect_fault_reported_and_devices_reusable(const TrainerConfig& config, rt::FaultPoint point,
                                                const std::string& task,
                                                const std::vector<std::string>& says,
                                                int iteration) {
  const std::vector<double> reference = [&] {
    devices::DeviceSet devices(config.plan.devices(), {.pin = false});
    Trainer trainer(config, mock_data(config), devices);
    return losses(trainer);
  }();

  devices::DeviceSet devices(config.plan.devices(), {.pin = false});
  point.run = static_cast<std::uint64_t>(iteration - 1);
  devices.executor().set_fault_plan({.points = {point}, .stall_timeout = kStallTimeout});
  {
    Trainer trainer(config, mock_data(config), devices);
    std::vector<double> before;
    try {
      trainer.run({.iteration = [&](const IterationMetrics& m) {
        before.push_back(m.loss);
        return TrainingControl::proceed;
      }});
      FAIL() << "the fault in '" << point.task << "' did not fail the step";
    } catch (const rt::TaskError& e) {
      const std::string msg = e.what();
      EXPECT_EQ(e.task_name(), task) << msg;
      for (const std::string& phrase : says)
        EXPECT_TRUE(contains(msg, phrase)) << "missing \"" << phrase << "\" in: " << msg;
    }
    EXPECT_EQ(trainer.iteration(), iteration - 1);
    ASSERT_EQ(before.size(), static_cast<std::size_t>(iteration - 1));
    for (std::size_t i = 0; i < before.size(); ++i)
      EXPECT_EQ(before[i], reference[i]) << "iteration " << i + 1;
  }

  devices.executor().set_fault_plan({});
  Trainer again(config, mock_data(config), devices);
  EXPECT_EQ(losses(again), reference);
}

TEST(StepFaults, ForwardTaskThrowsOnAChosenDeviceAndIteration) {
  expect_fault_reported_and_devices_reusable(
      moe_ampipe_config(),
      rt::FaultPoint{.task = "L0.qkv", .device = 1, .phase = rt::Phase::forward, .micro_batch = 1},
      "L0.qkv", {"task 'L0.qkv' (device 1", "fault injected"}, 3);
}

TEST(StepFaults, BackwardTaskThrows) {
  expect_fault_reported_and_devices_reusable(
      moe_ampipe_config(),
      rt::FaultPoint{.task = "L0.qkv_backward", .device = 0, .phase = rt::Phase::backward},
      "L0.qkv_backward", {"task 'L0.qkv_backward' (device 0", "fault injected"}, 2);
}

TEST(StepFaults, OptimizerTaskThrows) {
  expect_fault_reported_and_devices_reusable(
      moe_ampipe_config(), rt::FaultPoint{.task = "optimizer", .device = 1}, "optimizer",
      {"task 'optimizer' (device 1", "fault injected"}, 4);
}

TEST(StepFaults, TaskInsideAnAmpipeChunkThrows) {
  expect_fault_reported_and_devices_reusable(
      moe_ampipe_config(), rt::FaultPoint{.task = "L0.c1.experts", .device = 0, .micro_batch = 0},
      "L0.c1.experts", {"task 'L0.c1.experts' (device 0"}, 2);
}

TEST(StepFaults, AmpipeChunksAllToAllMemberNeverArrives) {
  expect_fault_reported_and_devices_reusable(
      moe_ampipe_config(),
      rt::FaultPoint{.task = "L0.c1.dispatch[*]",
                     .device = 1,
                     .phase = rt::Phase::forward,
                     .micro_batch = 0,
                     .kind = rt::FaultKind::never_arrive},
      "L0.c1.dispatch[1]",
      {"task 'L0.c1.dispatch[1]' (device 1", "stalled",
       "Collective 'L0.c1.dispatch' has 1 of its 2 members: arrived "
       "'L0.c1.dispatch[0]' (device 0); never arrived 'L0.c1.dispatch[1]' (device 1, "
       "held back by the fault plan)"},
      2);
}

TEST(StepFaults, DataParallelBucketReductionMemberNeverArrives) {
  expect_fault_reported_and_devices_reusable(
      moe_ampipe_config(),
      rt::FaultPoint{.task = "layers.0.attention/dense.dp[*]",
                     .device = 0,
                     .kind = rt::FaultKind::never_arrive},
      "layers.0.attention/dense.dp[0]",
      {"task 'layers.0.attention/dense.dp[0]' (device 0",
       "Collective 'layers.0.attention/dense.dp' has 1 of its 2 members: arrived "
       "'layers.0.attention/dense.dp[1]' (device 1)"},
      3);
}

TEST(StepFaults, PipelineTransferNeverArrives) {
  expect_fault_reported_and_devices_reusable(
      pipeline_config(),
      rt::FaultPoint{.task = "stage0_to_1.activations[1]",
                     .micro_batch = 2,
                     .kind = rt::FaultKind::never_arrive},
      "stage0_to_1.activations[1]",
      {"task 'stage0_to_1.activations[1]' (device 1",
       "Collective 'stage0_to_1.activations' has 1 of its 2 members: arrived "
       "'stage0_to_1.activations[0]' (device 0)"},
      2);
}

TEST(StepFaults, PipelineStageBackwardThrows) {
  expect_fault_reported_and_devices_reusable(
      pipeline_config(),
      rt::FaultPoint{
          .task = "L0.mlp_backward", .device = 0, .phase = rt::Phase::backward, .micro_batch = 3},
      "L0.mlp_backward", {"task 'L0.mlp_backward' (device 0", "fault injected"}, 3);
}

}  // namespace
}  // namespace weave::graphs
