// All of weave: the runtime, the devices, the operations and training. Link weave::weave.
#pragma once

#include "weave/devices.hpp"
#include "weave/graphs.hpp"
#include "weave/ops.hpp"
#include "weave/runtime.hpp"
