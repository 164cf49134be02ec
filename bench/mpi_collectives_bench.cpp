// Collectives across processes in the style of nccl-tests: weave's MPI backend against Open
// MPI's own MPI_Allreduce and MPI_Alltoall, on the same processes and buffers. Run under
// `mpirun -np P` (bench/mpi_bench.sh: 2 processes, one per core), one device per process.
//
// For each size S from 8 B to --max-bytes (default 64 MiB), times 4 apart: a graph of 10
// back-to-back collectives on one stream (the weave backend: progress thread, deferred
// completion, rank-order reduction) run repeatedly, and the same 10 calls of MPI's. Columns:
//   size    S: the all-reduce buffer, each rank's all-to-all buffer
//   time    mean per collective, on process 0 after a barrier closes each timed batch
//   busbw   nccl-tests' bus bandwidth: all-reduce 2(n-1)/n x S / time, all-to-all (n-1)/n
//   vs MPI  weave's time over MPI's (1.00: as fast)
#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "weave/devices/collective_matcher.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/mpi_communicator.hpp"

namespace {

using namespace weave;
using Clock = std::chrono::steady_clock;
constexpr int kChain = 10;  // collectives per timed graph run

enum class Op { all_reduce, all_to_all };

// Seconds per collective over `runs` runs of `body` (kChain collectives each), measured by
// process 0 between barriers.
template <typename Body>
double timed(int runs, Body body) {
  body();  // warm up: buffers touched, connections made
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t0 = Clock::now();
  for (int i = 0; i < runs; ++i)
    body();
  MPI_Barrier(MPI_COMM_WORLD);
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return seconds / (runs * kChain);
}

std::string bytes_text(std::size_t b) {
  if (b >= (1u << 20)) return fmt::format("{} MiB", b >> 20);
  if (b >= (1u << 10)) return fmt::format("{} KiB", b >> 10);
  return fmt::format("{} B", b);
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t max_bytes = std::size_t{64} << 20;
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--max-bytes=", 12) == 0)
      max_bytes = std::strtoull(argv[i] + 12, nullptr, 10);
  const int processes =
      std::atoi(std::getenv("OMPI_COMM_WORLD_SIZE") ? std::getenv("OMPI_COMM_WORLD_SIZE") : "1");
  devices::MpiCommunicator comm(processes);  // one device per process
  devices::Topology topology = devices::Topology::detect();
  const std::vector<int> cores = comm.cores(topology);
  devices::DeviceSet set(std::move(topology), processes,
                         {.held = comm.held_devices(), .cores = cores});
  const int me = comm.processes().index();
  const rt::DeviceId device = comm.held_devices().front();
  std::vector<rt::DeviceId> all;
  for (int d = 0; d < processes; ++d)
    all.push_back(static_cast<rt::DeviceId>(d));
  const devices::ProcessGroup world("world", all);
  const double n = processes;
  if (me == 0)
    fmt::print(
        "{} processes, one device each on core(s) of their own; {} collectives per timed "
        "run\n",
        processes, kChain);
  for (Op op : {Op::all_reduce, Op::all_to_all}) {
    if (me == 0) {
      fmt::print("\n{}\n", op == Op::all_reduce ? "all-reduce (sum, float)" : "all-to-all (float)");
      fmt::print("{:>9} {:>12} {:>12} {:>12} {:>12} {:>8}\n", "size", "weave (us)", "busbw GB/s",
                 "MPI (us)", "busbw GB/s", "vs MPI");
    }
    const double factor = op == Op::all_reduce ? 2 * (n - 1) / n : (n - 1) / n;
    for (std::size_t bytes = 8; bytes <= max_bytes; bytes *= 4) {
      const std::size_t count = std::max<std::size_t>(bytes / sizeof(float), processes);
      std::vector<float> a(count, 1e-3f), b(count, 0.f);
      // The graph: kChain collectives in a row on this process's device.
      rt::GraphBuilder builder;
      devices::CollectiveMatcher matcher(builder, comm);
      for (int k = 0; k < kChain; ++k) {
        if (op == Op::all_reduce)
          matcher.all_reduce(world, me, a, devices::ReduceOp::sum, {.name = "ar"});
        else
          matcher.all_to_all(world, me, a, b, {.name = "a2a"});
      }
      matcher.finish();
      const rt::Graph graph = builder.build();
      const int runs = static_cast<int>(
          std::clamp<std::size_t>((std::size_t{64} << 20) / (bytes * kChain), 3, 200));
      const double weave_time = timed(runs, [&] { set.executor().run(graph); });
      const double mpi_time = timed(runs, [&] {
        for (int k = 0; k < kChain; ++k) {
          if (op == Op::all_reduce)
            MPI_Allreduce(MPI_IN_PLACE, a.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM,
                          MPI_COMM_WORLD);
          else
            MPI_Alltoall(a.data(), static_cast<int>(count / processes), MPI_FLOAT, b.data(),
                         static_cast<int>(count / processes), MPI_FLOAT, MPI_COMM_WORLD);
        }
      });
      const double size = static_cast<double>(count * sizeof(float));
      if (me == 0)
        fmt::print("{:>9} {:>12.1f} {:>12.3f} {:>12.1f} {:>12.3f} {:>8.2f}\n",
                   bytes_text(count * sizeof(float)), weave_time * 1e6,
                   factor * size / weave_time * 1e-9, mpi_time * 1e6,
                   factor * size / mpi_time * 1e-9, weave_time / mpi_time);
      (void)device;
    }
  }
  return 0;
}
