// Reading a trace and printing its metrics: a Chrome JSON trace written by weave (`weave train
// --trace`, the task_graph example, any Trace written with write_chrome_trace) read back, with
// each device's busy and exposed-communication time and each stream's share.
//
//   trace_metrics TRACE_PATH
#include <cstdio>
#include <exception>
#include <set>
#include <string>

#include "weave/runtime.hpp"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: trace_metrics TRACE_PATH\n");
    return 2;
  }
  try {
    const weave::rt::Trace trace = weave::rt::read_chrome_trace(argv[1]);
    const weave::rt::TraceMetrics m = weave::rt::measure(trace);
    std::printf("%s: %zu tasks on %zu devices, %s clock, makespan %.3f us\n", argv[1],
                trace.spans().size(), m.devices.size(),
                trace.clock() == weave::rt::ClockKind::wall ? "wall" : "virtual",
                static_cast<double>(m.makespan) * 1e-3);
    for (std::size_t d = 0; d < m.devices.size(); ++d) {
      const weave::rt::DeviceMetrics& dev = m.devices[d];
      std::printf("device %zu: compute %.3f us, communication %.3f us, exposed %.3f us\n", d,
                  static_cast<double>(dev.compute_busy) * 1e-3,
                  static_cast<double>(dev.comm_busy) * 1e-3,
                  static_cast<double>(dev.exposed_comm) * 1e-3);
      for (std::size_t s = 0; s < dev.stream_busy.size(); ++s)
        if (dev.stream_busy[s] > 0)
          std::printf(
              "  stream %-10s busy %.3f us\n",
              std::string(trace.tasks().stream_name(static_cast<weave::rt::StreamId>(s))).c_str(),
              static_cast<double>(dev.stream_busy[s]) * 1e-3);
    }
    std::printf("exposed communication: %.1f %% of busy time\n", 100 * m.exposed_comm_share());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "trace_metrics: %s\n", e.what());
    return 1;
  }
  return 0;
}
