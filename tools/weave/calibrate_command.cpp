// weave calibrate: this host's kernel rates, measured and written as an accelerator preset, so
// `weave predict --accelerator FILE` prices a step as this host runs it.
#include <fmt/format.h>

#include <fstream>
#include <memory>

#include "commands.hpp"
#include "memory_estimate.hpp"
#include "output_paths.hpp"
#include "weave/graphs/host_calibration.hpp"

namespace weave::cli {

namespace {

struct CalibrateOptions {
  graphs::CalibrationOptions calibration;
  std::string output;
};

int run_calibrate(const CalibrateOptions& o) {
  check_writable("--output", o.output);
  fmt::print("weave calibrate: {} device(s) side by side, {:.3g} s a measurement\n",
             o.calibration.devices, o.calibration.seconds_per_measurement);
  graphs::HostCalibration result = graphs::calibrate_host(o.calibration);
  devices::Accelerator& a = result.preset;
  a.memory_bytes = host_memory_bytes() / o.calibration.devices;
  a.assumed =
      "peak_flops is the fitted rate of large matrix products here (efficiency 1), not a "
      "datasheet figure; memory_bytes is this host's memory shared by the devices; the "
      "shared-memory link (10 GB/s, 1 us) is the virtual clock's host link, not measured";
  fmt::print("{:<10} {:<70} {:>12} {:>12} {:>7}\n", "kernel", "shape", "measured ms", "modelled ms",
             "error");
  for (const graphs::KernelMeasurement& m : result.measurements)
    fmt::print("{:<10} {:<70} {:>12.4f} {:>12.4f} {:>6.1f}%\n", m.kernel, m.shape, 1e3 * m.seconds,
               1e3 * m.modelled_seconds, 100 * (m.modelled_seconds - m.seconds) / m.seconds);
  fmt::print(
      "matrix products {:.4g} FLOP/s, half that at {:.1f} rows; attention {:.4g} FLOP/s over "
      "the shapes (the preset's table by head width and sequence); streaming {:.4g} B/s\n",
      a.sustained_flops(), a.matmul_overhead_dimension, a.sustained_attention_flops(),
      a.sustained_memory_bandwidth());
  std::ofstream out(o.output, std::ios::binary | std::ios::trunc);
  out << a.to_json();
  out.close();
  if (!out) throw std::runtime_error(fmt::format("could not write the preset to '{}'", o.output));
  fmt::print("wrote {}: weave predict --accelerator {} prices a step as this host runs it\n",
             o.output, o.output);
  return 0;
}

}  // namespace

void add_calibrate_command(CLI::App& app) {
  auto o = std::make_shared<CalibrateOptions>();
  CLI::App* cmd = app.add_subcommand(
      "calibrate",
      "Measure this host's kernel rates (matrix products over shapes, attention, streaming) and "
      "write them as an accelerator preset for weave predict --accelerator");
  cmd->add_option("--output,-o", o->output, "The preset file to write (JSON)")->required();
  cmd->add_option("--devices", o->calibration.devices,
                  "Devices measured side by side, each on its share of the cores: calibrate for "
                  "the device count you will predict")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--seconds", o->calibration.seconds_per_measurement,
                  "Each measurement repeats its kernel this long (three times)")
      ->check(positive())
      ->capture_default_str();
  cmd->footer(
      "Example:\n"
      "  weave calibrate --devices 2 --output host2.json\n"
      "  weave predict --accelerator host2.json --devices 2 --tensor-model-parallel-size 2");
  cmd->callback([o] { throw CommandExit{run_calibrate(*o)}; });
}

}  // namespace weave::cli
