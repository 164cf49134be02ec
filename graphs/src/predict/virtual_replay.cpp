#include "weave/graphs/virtual_replay.hpp"

#include "weave/devices/link_model.hpp"
#include "weave/devices/shared_memory_communicator.hpp"

namespace weave::graphs {

devices::MachineModel machine_model(const devices::DeviceSet& devices,
                                    const ModelledMachine& machine) {
  // By device id; a device another process holds is costed as on NUMA node 0.
  std::vector<int> numa(devices.size(), 0);
  for (const auto& placement : devices.layout())
    numa[placement.device] = placement.numa_node;
  if (machine.attention_flops > 0)
    return devices::MachineModel(
        std::move(numa),
        devices::KernelRates{
            .matmul_flops_per_second = machine.device_flops,
            .matmul_overhead_dimension = machine.matmul_overhead_dimension,
            .attention_flops_per_second = machine.attention_flops,
            .attention_backward_flops_per_second = machine.attention_backward_flops,
            .memory_bytes_per_second = machine.device_memory_bandwidth,
            .kernel_launch_seconds = machine.kernel_launch_seconds},
        devices::LinkModel::preset(machine.link), machine.cluster);
  return devices::MachineModel(std::move(numa), machine.device_flops,
                               devices::LinkModel::preset(machine.link),
                               machine.device_memory_bandwidth, machine.cluster);
}

rt::VirtualRunResult replay_step(TrainerConfig config, const SampleSource& samples, bool execute,
                                 const ReplayInspector& inspect) {
  validate(config);
  devices::DeviceSet set(config.plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  TrainingStep step(config.model, config.plan, config.step_optimizer(), set, comm);
  if (samples) fill_micro_batches(step, config.model, config.plan, samples, 0);
  step.prepare(1, config.learning_rate.at(1));
  const devices::MachineModel machine = machine_model(set, config.machine);
  rt::VirtualClock clock(machine, {.execute = execute, .record_trace = true});
  rt::VirtualRunResult run = clock.run(step.graph());
  if (inspect) inspect(step, set);
  return run;
}

}  // namespace weave::graphs
