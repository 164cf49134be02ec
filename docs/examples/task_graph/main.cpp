// A task graph of your own on 4 pinned devices: each device fills a buffer of its own, an
// all-reduce (a collective of the shared-memory communicator, one task per device on its comm
// stream) sums the four, and the run's trace is written as Chrome JSON for Perfetto.
//
//   task_graph [TRACE_PATH]     (default: task_graph.json)
#include <algorithm>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "weave/devices.hpp"
#include "weave/runtime.hpp"

int main(int argc, char** argv) {
  const std::string trace_path = argc > 1 ? argv[1] : "task_graph.json";
  std::vector<std::vector<float>> data(4, std::vector<float>(1024));
  // [embedding example]
  weave::devices::DeviceSet devices(4);  // 4 arenas pinned to this host's cores
  weave::devices::SharedMemoryCommunicator comm;
  weave::rt::GraphBuilder b;
  std::vector<weave::rt::TaskId> filled;
  for (weave::rt::DeviceId d = 0; d < 4; ++d)  // device d fills its buffer with d + 1
    filled.push_back(b.add({.device = d, .name = "fill", .cost = {.flops = 1e6}},
                           [&data, d](weave::rt::TaskContext&) {
                             std::fill(data[d].begin(), data[d].end(), static_cast<float>(d + 1));
                           }));
  const weave::devices::ProcessGroup all("all", {0, 1, 2, 3});
  const std::vector<std::span<float>> buffers(data.begin(), data.end());
  const auto summed = comm.all_reduce(b, all, buffers, weave::devices::ReduceOp::sum);
  for (int r = 0; r < 4; ++r)
    b.precede(filled[r], summed[r]);   // each member starts after its device's fill
  weave::rt::Graph graph = b.build();  // refuses cycles, naming their tasks
  const auto result = devices.executor().run(graph, {.record_trace = true});
  weave::rt::write_chrome_trace(result.trace, trace_path);
  // [embedding example]
  for (const auto& buffer : data)
    for (float x : buffer)
      if (x != 10.f) {
        std::printf("wrong sum %g\n", static_cast<double>(x));
        return 1;
      }
  std::printf("all-reduce over 4 devices: every element is 10 (1 + 2 + 3 + 4)\n");
  std::printf("%zu tasks, trace written to %s\n", graph.size(), trace_path.c_str());
  return 0;
}
