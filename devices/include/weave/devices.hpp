// weave's devices: the host's Topology, pinned Devices and the DeviceSet that runs graphs on
// them, link and machine models for the virtual clock, process groups and the collectives
// (Communicator, CollectiveMatcher, the shared-memory and MPI backends, ProcessSet). See
// docs/api.md.
#pragma once

#include "weave/devices/accelerator.hpp"
#include "weave/devices/cluster.hpp"
#include "weave/devices/collective.hpp"
#include "weave/devices/collective_matcher.hpp"
#include "weave/devices/communicator.hpp"
#include "weave/devices/device.hpp"
#include "weave/devices/device_layout.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/folded_communicator.hpp"
#include "weave/devices/kernel_rates.hpp"
#include "weave/devices/link_model.hpp"
#include "weave/devices/machine_model.hpp"
#include "weave/devices/mpi_communicator.hpp"
#include "weave/devices/process_group.hpp"
#include "weave/devices/process_set.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/devices/topology.hpp"
