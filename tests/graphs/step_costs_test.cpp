// Every compute task of a training step has a price on the virtual clock: matrix products by
// their FLOPs, element-wise work (norms, residuals, dropout, copies, the optimizer) by the memory
// it streams at the device's bandwidth, whichever is longer.
#include <gtest/gtest.h>

#include <cmath>

#include "tiny_model.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/virtual_replay.hpp"

namespace weave::graphs {
namespace {

struct Built {
  ParallelPlan plan;
  devices::DeviceSet set;
  devices::SharedMemoryCommunicator comm;
  TrainingStep step;
  Built(const ModelConfig& m, ParallelPlan p)
      : plan((validate(m, p), p)),
        set(plan.devices(), {.pin = false}),
        step(m, plan, {}, set, comm, {.materialize = false}) {}
};

TEST(StepCosts, NoComputeTaskIsFree) {
  const ModelConfig m = tiny(4);
  const ParallelPlan plans[] = {
      {.micro_batch_size = 2, .global_batch_size = 2},
      {.tensor_parallel = 2,
       .sequence_parallel = true,
       .expert_parallel = 2,
       .micro_batch_size = 2,
       .global_batch_size = 4,
       .ampipe_degree = 2},
      {.tensor_parallel = 2,
       .sequence_parallel = true,
       .expert_parallel = 2,
       .expert_tensor_parallel = 2,
       .data_parallel = 2,
       .micro_batch_size = 2,
       .global_batch_size = 4,
       .ampipe_degree = 2,
       .ampipe_tp_sp_comm_overlap = true},
      {.tensor_parallel = 2,
       .sequence_parallel = true,
       .expert_parallel = 2,
       .micro_batch_size = 2,
       .global_batch_size = 4,
       .ampipe_degree = 2,
       .pipe_experts = true,
       .pipe_experts_multi_data = 2},
      {.context_parallel = 2,
       .expert_parallel = 2,
       .pipeline_parallel = 2,
       .micro_batch_size = 1,
       .global_batch_size = 4,
       .distributed_optimizer = true},
  };
  for (const ParallelPlan& plan : plans) {
    Built b(m, plan);
    const devices::MachineModel machine = machine_model(b.set, ModelledMachine{});
    const rt::TaskTable& tasks = b.step.graph().tasks();
    int free = 0;
    for (rt::TaskId t = 0; t < tasks.size(); ++t)
      if (tasks[t].kind == rt::TaskKind::compute && machine.duration(tasks, t) == 0) {
        ++free;
        ADD_FAILURE() << tasks.name(t) << " lasts 0 ns";
      }
    EXPECT_EQ(free, 0);
  }
}

TEST(StepCosts, ElementWiseWorkStreamsAtTheMemoryBandwidth) {
  const ModelConfig m = tiny(0);
  Built b(m, {.micro_batch_size = 2, .global_batch_size = 2});
  const ModelledMachine modelled{.device_flops = 1e11, .device_memory_bandwidth = 1e10};
  const devices::MachineModel machine = machine_model(b.set, modelled);
  const rt::TaskTable& tasks = b.step.graph().tasks();
  bool seen_norm = false, seen_optimizer = false;
  for (rt::TaskId t = 0; t < tasks.size(); ++t) {
    const std::string_view name = tasks.name(t);
    if (name == "L0.input_norm") {
      // Reads and writes the [S, B, h] rows once: 2 x 16 x 2 x 32 floats.
      const double bytes = 4.0 * 2 * 16 * 2 * 32;
      EXPECT_EQ(machine.duration(tasks, t), std::llround(bytes / 1e10 * 1e9));
      seen_norm = true;
    }
    if (name == "optimizer") {
      // AdamW streams seven values per parameter element.
      EXPECT_GT(machine.duration(tasks, t), 0);
      seen_optimizer = true;
    }
    // A matrix product is priced by its arithmetic, as before.
    if (name == "L0.qkv") {
      EXPECT_GT(tasks[t].cost.flops, 0);
    }
  }
  EXPECT_TRUE(seen_norm);
  EXPECT_TRUE(seen_optimizer);
}

}  // namespace
}  // namespace weave::graphs
