// This host's kernel rates, measured, as an accelerator preset (`weave calibrate`): the virtual
// clock then prices a step as this host runs it, so a prediction can be set against the wall
// clock here (tools/dev predict-bench).
//
// Each kernel is timed on every device of a set of `devices` at once, each device on its share
// of the cores, so the rates are what a device sustains while the others compute too, as in a run
// of that many devices. The figures are in the units the step's cost hints count
// (graphs/src/step/step_costs.hpp): 2mnk per product, the causal attention's FLOPs, the bytes a
// streaming task is charged. From them:
//   matrix products: t = (2mnk + d0 x 2(mn + nk + mk)) / R, least squares over the shapes on
//                    relative error (devices::KernelRates), R and d0 >= 0;
//   attention:       forward and backward FLOPs over their time at 4 head dimensions (16 to
//                    128) by 4 sequence lengths (128 to 1024), the preset's table for the
//                    backends that run the blockwise kernel here (flash, fused, auto), and
//                    over all of them the flat rates the others fall back to;
//   streaming:       the norms', residual adds' and AdamW's bytes over their time.
#pragma once

#include <string>
#include <vector>

#include "weave/devices/accelerator.hpp"

namespace weave::graphs {

struct CalibrationOptions {
  int devices = 1;  // devices measured side by side
  // Each measurement repeats its kernel for at least this long; the median of three is kept.
  double seconds_per_measurement = 0.05;
};

struct KernelMeasurement {
  std::string kernel;           // "matmul", "attention", "streaming"
  std::string shape;            // what was run, for the report
  double seconds = 0;           // one run, measured
  double modelled_seconds = 0;  // one run, from the fitted rates
};

struct HostCalibration {
  devices::Accelerator preset;  // the fitted rates as a preset (Accelerator::to_json)
  std::vector<KernelMeasurement> measurements;
};

// Throws std::invalid_argument for devices < 1 or more than the host's cores, or a time <= 0.
HostCalibration calibrate_host(const CalibrationOptions& options);

}  // namespace weave::graphs
