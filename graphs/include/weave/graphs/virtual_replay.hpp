// A training step on the virtual clock: the modelled machine for a set of devices, and one step
// of a configuration replayed there, to compare configurations (Ampipe degrees, pipeline
// schedules) by the time accelerators would take rather than by this host's.
#pragma once

#include <functional>

#include "weave/devices/device_set.hpp"
#include "weave/devices/machine_model.hpp"
#include "weave/graphs/trainer_config.hpp"
#include "weave/graphs/training_data.hpp"
#include "weave/graphs/training_step.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::graphs {

// The cost model of `devices` under `machine`: every device computes at machine.device_flops,
// transfers take the link preset's time between the devices' NUMA nodes, collectives the time
// of their algorithm on machine.cluster when there is one. Throws
// std::invalid_argument for an unknown link preset.
devices::MachineModel machine_model(const devices::DeviceSet& devices,
                                    const ModelledMachine& machine);

// Sees the step after its replay, and its devices (whose memory tracker holds the peaks).
using ReplayInspector = std::function<void(TrainingStep& step, devices::DeviceSet& devices)>;

// Iteration 1 of `config` on its first training samples, replayed on the virtual clock of
// config.machine on devices of its own (unpinned). `execute`: run the kernels too, so MoE
// routing (and with it the all-to-alls' sizes) follows the data; without, only the cost hints
// count and the all-to-alls are timed as for balanced routing, which replays many devices in
// seconds. `samples` may be empty when !execute. The configuration is validated on a copy
// (throws ConfigError). Returns the makespan (ns) and the trace.
rt::VirtualRunResult replay_step(TrainerConfig config, const SampleSource& samples, bool execute,
                                 const ReplayInspector& inspect = {});

}  // namespace weave::graphs
