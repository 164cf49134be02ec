// Collectives across processes in the style of nccl-tests: weave's MPI backend against Open
// MPI's own calls (MPI_Allreduce, MPI_Allgather, MPI_Reduce_scatter_block, MPI_Alltoall,
// MPI_Alltoallv, MPI_Send/MPI_Recv), on the same processes and buffers. Run under
// `mpirun -np P` (bench/mpi_bench.sh: 2 processes, one per core), one device per process.
//
// For each size S from 8 B to --max-bytes (default 64 MiB), times 4 apart: a graph of 10
// back-to-back collectives on one stream (the weave backend: rank-order reduction, messages
// posted and polled by the device's thread, deferred completion when they take longer) run
// repeatedly, and the same 10 calls of MPI's. Columns:
//   size    S: the all-reduce buffer, each rank's all-gather output, reduce-scatter input and
//           all-to-all buffer (the variable one split evenly), the message sent
//   time    mean per collective in a timed batch, on process 0 after a barrier closes it; the
//           best of 5 batches, weave's and MPI's taken in turn (the host is shared: a batch
//           that lost its core to another program says nothing about either)
//   busbw   nccl-tests' bus bandwidth: all-reduce 2(n-1)/n x S / time, the gathers,
//           scatters and all-to-alls (n-1)/n, send/recv S / time (process 0 to process 1)
//   vs MPI  weave's time over MPI's (1.00: as fast)
#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "weave/devices/collective_matcher.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/mpi_communicator.hpp"

namespace {

using namespace weave;
using Clock = std::chrono::steady_clock;
constexpr int kChain = 10;   // collectives per timed graph run
constexpr int kBatches = 5;  // timed batches of each, the best kept

enum class Op { all_reduce, all_gather, reduce_scatter, all_to_all, all_to_all_v, send_recv };

const char* title(Op op) {
  switch (op) {
    case Op::all_reduce:
      return "all-reduce (sum, float)";
    case Op::all_gather:
      return "all-gather (float)";
    case Op::reduce_scatter:
      return "reduce-scatter (sum, float)";
    case Op::all_to_all:
      return "all-to-all (float)";
    case Op::all_to_all_v:
      return "variable all-to-all (float, even split)";
    case Op::send_recv:
      return "send/recv (float, process 0 to process 1)";
  }
  return "";
}

// nccl-tests' bus bandwidth factor over n ranks.
double bus_factor(Op op, double n) {
  switch (op) {
    case Op::all_reduce:
      return 2 * (n - 1) / n;
    case Op::send_recv:
      return 1;
    default:
      return (n - 1) / n;
  }
}

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
  std::optional<Op> only;  // --only=NAME: one collective (all_reduce ... send_recv)
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--max-bytes=", 12) == 0)
      max_bytes = std::strtoull(argv[i] + 12, nullptr, 10);
    const std::string arg = argv[i];
    const std::pair<const char*, Op> names[] = {
        {"all_reduce", Op::all_reduce},         {"all_gather", Op::all_gather},
        {"reduce_scatter", Op::reduce_scatter}, {"all_to_all", Op::all_to_all},
        {"all_to_all_v", Op::all_to_all_v},     {"send_recv", Op::send_recv}};
    for (const auto& [name, op] : names)
      if (arg == std::string("--only=") + name) only = op;
  }
  const int processes =
      std::atoi(std::getenv("OMPI_COMM_WORLD_SIZE") ? std::getenv("OMPI_COMM_WORLD_SIZE") : "1");
  devices::MpiCommunicator comm(processes);  // one device per process
  devices::Topology topology = devices::Topology::detect();
  const std::vector<int> cores = comm.cores(topology);
  devices::DeviceSet set(std::move(topology), processes,
                         {.held = comm.held_devices(), .cores = cores});
  const int me = comm.processes().index();
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
  std::vector<Op> ops{Op::all_reduce, Op::all_gather,   Op::reduce_scatter,
                      Op::all_to_all, Op::all_to_all_v, Op::send_recv};
  if (only) ops = {*only};
  for (Op op : ops) {
    if (op == Op::send_recv && processes < 2) continue;
    if (me == 0) {
      fmt::print("\n{}\n", title(op));
      fmt::print("{:>9} {:>12} {:>12} {:>12} {:>12} {:>8}\n", "size", "weave (us)", "busbw GB/s",
                 "MPI (us)", "busbw GB/s", "vs MPI");
    }
    const double factor = bus_factor(op, n);
    for (std::size_t bytes = 8; bytes <= max_bytes; bytes *= 4) {
      const std::size_t count = std::max<std::size_t>(bytes / sizeof(float), processes);
      const std::size_t block = count / static_cast<std::size_t>(processes);
      const auto P = static_cast<std::size_t>(processes);
      std::vector<float> a(count, 1e-3f), b(count, 0.f);
      // The variable all-to-all: an even split, in rows of one float.
      std::vector<std::int64_t> rows(P, static_cast<std::int64_t>(block)), got(P, 0);
      std::vector<int> counts(P, static_cast<int>(block)), displs(P, 0);
      for (std::size_t p = 0; p < P; ++p)
        displs[p] = static_cast<int>(p * block);
      // The graph: kChain collectives in a row on this process's device.
      rt::GraphBuilder builder;
      devices::CollectiveMatcher matcher(builder, comm);
      const std::span<const float> in(a.data(), block * P);
      for (int k = 0; k < kChain; ++k) {
        switch (op) {
          case Op::all_reduce:
            matcher.all_reduce(world, me, a, devices::ReduceOp::sum, {.name = "ar"});
            break;
          case Op::all_gather:
            matcher.all_gather(world, me, in.first(block), std::span(b).first(block * P),
                               {.name = "ag"});
            break;
          case Op::reduce_scatter:
            matcher.reduce_scatter(world, me, in, std::span(b).first(block), devices::ReduceOp::sum,
                                   {.name = "rs"});
            break;
          case Op::all_to_all:
            matcher.all_to_all(world, me, in, std::span(b).first(block * P), {.name = "a2a"});
            break;
          case Op::all_to_all_v:
            matcher.all_to_all_v(world, me,
                                 {.send = in, .send_counts = &rows, .recv = b, .recv_counts = got},
                                 1, {.name = "a2av"});
            break;
          case Op::send_recv:
            if (me == 0) matcher.send(0, 1, in.first(block), {.name = "p2p"});
            if (me == 1) matcher.receive(0, 1, std::span(b).first(block), {.name = "p2p"});
            break;
        }
      }
      matcher.finish();
      const rt::Graph graph = builder.build();
      const int runs = static_cast<int>(
          std::clamp<std::size_t>((std::size_t{16} << 20) / (bytes * kChain), 2, 50));
      const int c = static_cast<int>(count), m = static_cast<int>(block);
      const auto mpi_calls = [&] {
        for (int k = 0; k < kChain; ++k) {
          switch (op) {
            case Op::all_reduce:
              MPI_Allreduce(MPI_IN_PLACE, a.data(), c, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
              break;
            case Op::all_gather:
              MPI_Allgather(a.data(), m, MPI_FLOAT, b.data(), m, MPI_FLOAT, MPI_COMM_WORLD);
              break;
            case Op::reduce_scatter:
              MPI_Reduce_scatter_block(a.data(), b.data(), m, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
              break;
            case Op::all_to_all:
              MPI_Alltoall(a.data(), m, MPI_FLOAT, b.data(), m, MPI_FLOAT, MPI_COMM_WORLD);
              break;
            case Op::all_to_all_v:
              MPI_Alltoallv(a.data(), counts.data(), displs.data(), MPI_FLOAT, b.data(),
                            counts.data(), displs.data(), MPI_FLOAT, MPI_COMM_WORLD);
              break;
            case Op::send_recv:
              if (me == 0) MPI_Send(a.data(), m, MPI_FLOAT, 1, 0, MPI_COMM_WORLD);
              if (me == 1)
                MPI_Recv(b.data(), m, MPI_FLOAT, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
              break;
          }
        }
      };
      double weave_time = 1e300, mpi_time = 1e300;
      for (int batch = 0; batch < kBatches; ++batch) {
        weave_time = std::min(weave_time, timed(runs, [&] { set.executor().run(graph); }));
        mpi_time = std::min(mpi_time, timed(runs, mpi_calls));
      }
      // The bytes the size column names: the all-gather's output, the reduce-scatter's input,
      // the message of send/recv (one block).
      const double size =
          static_cast<double>((op == Op::send_recv ? block : block * P) * sizeof(float));
      if (me == 0)
        fmt::print("{:>9} {:>12.1f} {:>12.3f} {:>12.1f} {:>12.3f} {:>8.2f}\n",
                   bytes_text(static_cast<std::size_t>(size)), weave_time * 1e6,
                   factor * size / weave_time * 1e-9, mpi_time * 1e6,
                   factor * size / mpi_time * 1e-9, weave_time / mpi_time);
    }
  }
  return 0;
}
