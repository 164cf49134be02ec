// Run by mpi_test under `mpirun -np P`: every collective across processes against a serial
// reference, bitwise. N = 3P devices (every process holds 3), with groups that span every
// process, some processes or one (odd sizes, devices out of order, pairs), buffers of zero,
// odd and multi-KiB lengths (up to 80 KB, past the one-round all-reduce of more than 2
// processes), all-reduces pipelined by segments (three segments, the last a part one, and over
// 2 processes one of 16 MB whose segments grow to stay within an operation's rounds), issued over
// groups in a different order in every process and run twice with fresh data. Prints "mpi
// collectives: C cases, F failed" on process 0 and exits 1 when any failed.
//
//   --size-mismatch  one all-reduce whose buffer is larger on process 1: the run must fail on
//                    every process with weave's message naming the peer and the sizes
//   --peer-ends      process 1 ends (SIGKILL) before running: the others must fail naming it
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <csignal>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "weave/devices/collective_matcher.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/mpi_communicator.hpp"
#include "weave/runtime/error.hpp"

namespace weave::devices {
namespace {

// Values spread over many binades, so that the order of a sum changes its rounding; a
// function of (seed, case, member, index) so every process knows every member's data.
float value(std::uint64_t seed, int c, int member, std::size_t i) {
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ (static_cast<std::uint64_t>(c) << 40) ^
                    (static_cast<std::uint64_t>(member) << 32) ^ i;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  const float mantissa = static_cast<float>(x & 0xffffff) / 16777216.f * 2.f - 1.f;
  const int exponent = static_cast<int>((x >> 24) % 25) - 12;
  return std::ldexp(mantissa, exponent);
}

float fold(ReduceOp op, float a, float b) {
  return op == ReduceOp::sum ? a + b : (a < b ? b : a);
}

struct Case {
  CollectiveOp op;
  ProcessGroup group;
  std::size_t size = 0;  // all_reduce, broadcast, send_recv: elements; others: per block
  ReduceOp reduce = ReduceOp::sum;
  int root = 0;
  // By member; only the members of held devices are used.
  std::vector<std::vector<float>> in, out;
  std::vector<std::vector<std::int64_t>> send_counts, recv_counts;
};

// Rows member j sends member k in an all_to_all_v (some zero).
std::int64_t rows(const Case& c, int index, std::uint64_t seed, int j, int k) {
  if (c.size == 0) return 0;
  return static_cast<std::int64_t>((seed + 3 * j + 5 * k + index) % 4);
}

constexpr std::int64_t kRow = 5;  // elements per all_to_all_v row

// Rows member j contributes to an all_gather_v, or the rows of block j of a reduce_scatter_v.
std::int64_t block_rows(const Case& c, int index, std::uint64_t seed, int j) {
  if (c.size == 0) return 0;
  return static_cast<std::int64_t>((seed + 3 * j + index) % 4);
}

class Check {
 public:
  Check(MpiCommunicator& comm, int devices) : comm_(comm), devices_(devices) {}

  void add(CollectiveOp op, std::vector<rt::DeviceId> members, std::size_t size,
           ReduceOp reduce = ReduceOp::sum, int root = 0) {
    const std::string name = fmt::format("g{}", cases_.size());
    cases_.push_back({.op = op,
                      .group = ProcessGroup(name, std::move(members)),
                      .size = size,
                      .reduce = reduce,
                      .root = root});
  }

  // Fills the inputs for a run and poisons the outputs, in the buffers the graph was built over
  // (allocated by the first fill).
  void fill(std::uint64_t seed) {
    const auto put = [](std::vector<float>& into, std::vector<float> values) {
      if (into.size() == values.size())
        std::copy(values.begin(), values.end(), into.begin());
      else
        into = std::move(values);
    };
    for (std::size_t ci = 0; ci < cases_.size(); ++ci) {
      Case& c = cases_[ci];
      const int n = c.group.size(), index = static_cast<int>(ci);
      c.in.resize(static_cast<std::size_t>(n));
      c.out.resize(static_cast<std::size_t>(n));
      c.send_counts.resize(static_cast<std::size_t>(n));
      c.recv_counts.resize(static_cast<std::size_t>(n));
      for (int r = 0; r < n; ++r) {
        if (!comm_.holds(c.group.device(r))) continue;
        auto& in = c.in[static_cast<std::size_t>(r)];
        auto& out = c.out[static_cast<std::size_t>(r)];
        const auto member_data = [&](std::size_t count) {
          std::vector<float> v(count);
          for (std::size_t i = 0; i < count; ++i)
            v[i] = value(seed, index, r, i);
          return v;
        };
        switch (c.op) {
          case CollectiveOp::all_reduce:
          case CollectiveOp::broadcast:
            put(out, member_data(c.size));
            break;
          case CollectiveOp::send_recv:
            put(in, member_data(c.size));
            put(out, std::vector<float>(c.size, std::nanf("")));
            break;
          case CollectiveOp::all_gather:
            put(in, member_data(c.size));
            put(out, std::vector<float>(c.size * n, std::nanf("")));
            break;
          case CollectiveOp::reduce_scatter:
            put(in, member_data(c.size * n));
            put(out, std::vector<float>(c.size, std::nanf("")));
            break;
          case CollectiveOp::all_to_all:
            put(in, member_data(c.size * n));
            put(out, std::vector<float>(c.size * n, std::nanf("")));
            break;
          case CollectiveOp::all_to_all_v: {
            auto& counts = c.send_counts[static_cast<std::size_t>(r)];
            counts.clear();
            std::size_t total = 0;
            for (int k = 0; k < n; ++k) {
              counts.push_back(rows(c, index, seed, r, k));
              total += static_cast<std::size_t>(counts.back() * kRow);
            }
            // Room for the most rows any split sends, so the buffers never move.
            std::vector<float> send = member_data(total);
            send.resize(static_cast<std::size_t>(3 * n * kRow), 0.f);
            put(in, std::move(send));
            put(out, std::vector<float>(static_cast<std::size_t>(3 * n * kRow), std::nanf("")));
            c.recv_counts[static_cast<std::size_t>(r)].assign(static_cast<std::size_t>(n), -1);
            break;
          }
          case CollectiveOp::all_gather_v: {
            const std::int64_t mine = block_rows(c, index, seed, r);
            std::vector<float> send = member_data(static_cast<std::size_t>(mine * kRow));
            send.resize(static_cast<std::size_t>(3 * kRow), 0.f);
            put(in, std::move(send));
            put(out, std::vector<float>(static_cast<std::size_t>(3 * n * kRow), std::nanf("")));
            c.send_counts[static_cast<std::size_t>(r)].assign(1, mine);
            c.recv_counts[static_cast<std::size_t>(r)].assign(static_cast<std::size_t>(n), -1);
            break;
          }
          case CollectiveOp::reduce_scatter_v: {
            auto& blocks = c.send_counts[static_cast<std::size_t>(r)];
            blocks.assign(static_cast<std::size_t>(n), 0);
            std::size_t total = 0;
            for (int j = 0; j < n; ++j) {
              blocks[static_cast<std::size_t>(j)] = block_rows(c, index, seed, j);
              total += static_cast<std::size_t>(blocks[static_cast<std::size_t>(j)] * kRow);
            }
            std::vector<float> send = member_data(total);
            send.resize(static_cast<std::size_t>(3 * n * kRow), 0.f);
            put(in, std::move(send));
            put(out, std::vector<float>(static_cast<std::size_t>(3 * kRow), std::nanf("")));
            break;
          }
          case CollectiveOp::barrier:
            break;
        }
      }
    }
  }

  // Issues every case's members held here, groups in an order that differs by process.
  void issue(CollectiveMatcher& matcher, int process) {
    const std::size_t n = cases_.size();
    for (std::size_t k = 0; k < n; ++k) {
      Case& c = cases_[(k + static_cast<std::size_t>(process) * 3) % n];
      const CollectiveOptions options{.name = c.group.name(), .stream = c.group.name()};
      for (int r = 0; r < c.group.size(); ++r) {
        if (!comm_.holds(c.group.device(r))) continue;
        auto& in = c.in[static_cast<std::size_t>(r)];
        auto& out = c.out[static_cast<std::size_t>(r)];
        switch (c.op) {
          case CollectiveOp::all_reduce:
            matcher.all_reduce(c.group, r, out, c.reduce, options);
            break;
          case CollectiveOp::broadcast:
            matcher.broadcast(c.group, r, out, c.root, options);
            break;
          case CollectiveOp::all_gather:
            matcher.all_gather(c.group, r, in, out, options);
            break;
          case CollectiveOp::reduce_scatter:
            matcher.reduce_scatter(c.group, r, in, out, c.reduce, options);
            break;
          case CollectiveOp::all_to_all:
            matcher.all_to_all(c.group, r, in, out, options);
            break;
          case CollectiveOp::all_to_all_v:
            matcher.all_to_all_v(c.group, r,
                                 {.send = in,
                                  .send_counts = &c.send_counts[static_cast<std::size_t>(r)],
                                  .recv = out,
                                  .recv_counts = c.recv_counts[static_cast<std::size_t>(r)]},
                                 kRow, options);
            break;
          case CollectiveOp::all_gather_v:
            matcher.all_gather_v(c.group, r,
                                 {.send = in,
                                  .send_rows = c.send_counts[static_cast<std::size_t>(r)].data(),
                                  .recv = out,
                                  .recv_rows = c.recv_counts[static_cast<std::size_t>(r)]},
                                 kRow, options);
            break;
          case CollectiveOp::reduce_scatter_v:
            matcher.reduce_scatter_v(
                c.group, r,
                {.send = in, .rows = &c.send_counts[static_cast<std::size_t>(r)], .recv = out},
                kRow, options);
            break;
          case CollectiveOp::send_recv:
            if (r == 0)
              matcher.send(c.group.device(0), c.group.device(1), in, options);
            else
              matcher.receive(c.group.device(0), c.group.device(1), out, options);
            break;
          case CollectiveOp::barrier:
            matcher.barrier(c.group, r, options);
            break;
        }
      }
    }
  }

  // Compares every held member's result with the serial reference; returns the failures.
  int verify(std::uint64_t seed) {
    int failures = 0;
    for (std::size_t ci = 0; ci < cases_.size(); ++ci) {
      const Case& c = cases_[ci];
      const int n = c.group.size(), index = static_cast<int>(ci);
      for (int r = 0; r < n; ++r) {
        if (!comm_.holds(c.group.device(r))) continue;
        const std::vector<float> expected = reference(c, index, seed, r);
        std::vector<float> got = c.out[static_cast<std::size_t>(r)];
        if (c.op == CollectiveOp::send_recv && r == 0) continue;
        if (c.op == CollectiveOp::all_gather_v || c.op == CollectiveOp::reduce_scatter_v)
          got.resize(expected.size());
        if (c.op == CollectiveOp::all_gather_v)
          for (int j = 0; j < n; ++j)
            if (c.recv_counts[static_cast<std::size_t>(r)][static_cast<std::size_t>(j)] !=
                block_rows(c, index, seed, j)) {
              ++failures;
              fmt::print("FAILED {} over {}: member {} got the wrong count of member {}\n",
                         to_string(c.op), fmt::join(c.group.devices(), ","), r, j);
            }
        if (c.op == CollectiveOp::all_to_all_v) {
          got.resize(expected.size());
          for (int j = 0; j < n; ++j)
            if (c.recv_counts[static_cast<std::size_t>(r)][static_cast<std::size_t>(j)] !=
                rows(c, index, seed, j, r)) {
              ++failures;
              fmt::print("FAILED {} over {}: member {} got the wrong count from member {}\n",
                         to_string(c.op), fmt::join(c.group.devices(), ","), r, j);
            }
        }
        // (memcmp of an empty vector's data(), possibly null, is undefined.)
        if (got.size() != expected.size() ||
            (!got.empty() &&
             std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)) != 0)) {
          std::size_t at = 0;
          while (at < std::min(got.size(), expected.size()) &&
                 std::memcmp(&got[at], &expected[at], sizeof(float)) == 0)
            ++at;
          ++failures;
          fmt::print("FAILED {} over devices {} (size {}): member {} differs at element {}\n",
                     to_string(c.op), fmt::join(c.group.devices(), ","), c.size, r, at);
        }
      }
    }
    return failures;
  }

  std::size_t size() const { return cases_.size(); }

 private:
  std::vector<float> reference(const Case& c, int index, std::uint64_t seed, int r) const {
    const int n = c.group.size();
    const auto data = [&](int member, std::size_t count) {
      std::vector<float> v(count);
      for (std::size_t i = 0; i < count; ++i)
        v[i] = value(seed, index, member, i);
      return v;
    };
    std::vector<float> out;
    switch (c.op) {
      case CollectiveOp::all_reduce: {
        out = data(0, c.size);
        for (int j = 1; j < n; ++j) {
          const std::vector<float> x = data(j, c.size);
          for (std::size_t i = 0; i < c.size; ++i)
            out[i] = fold(c.reduce, out[i], x[i]);
        }
        break;
      }
      case CollectiveOp::broadcast:
        out = data(c.root, c.size);
        break;
      case CollectiveOp::send_recv:
        out = data(0, c.size);
        break;
      case CollectiveOp::all_gather:
        for (int j = 0; j < n; ++j) {
          const std::vector<float> x = data(j, c.size);
          out.insert(out.end(), x.begin(), x.end());
        }
        break;
      case CollectiveOp::reduce_scatter: {
        const std::size_t m = c.size;
        for (int j = 0; j < n; ++j) {
          const std::vector<float> x = data(j, m * n);
          if (j == 0)
            out.assign(x.begin() + r * m, x.begin() + (r + 1) * m);
          else
            for (std::size_t i = 0; i < m; ++i)
              out[i] = fold(c.reduce, out[i], x[r * m + i]);
        }
        break;
      }
      case CollectiveOp::all_to_all:
        for (int j = 0; j < n; ++j) {
          const std::vector<float> x = data(j, c.size * n);
          out.insert(out.end(), x.begin() + r * c.size, x.begin() + (r + 1) * c.size);
        }
        break;
      case CollectiveOp::all_to_all_v:
        for (int j = 0; j < n; ++j) {
          std::size_t from = 0, total = 0;
          for (int k = 0; k < n; ++k) {
            const auto len = static_cast<std::size_t>(rows(c, index, seed, j, k) * kRow);
            if (k < r) from += len;
            total += len;
          }
          const std::vector<float> x = data(j, total);
          const auto len = static_cast<std::size_t>(rows(c, index, seed, j, r) * kRow);
          out.insert(out.end(), x.begin() + from, x.begin() + from + len);
        }
        break;
      case CollectiveOp::all_gather_v:
        for (int j = 0; j < n; ++j) {
          const std::vector<float> x =
              data(j, static_cast<std::size_t>(block_rows(c, index, seed, j) * kRow));
          out.insert(out.end(), x.begin(), x.end());
        }
        break;
      case CollectiveOp::reduce_scatter_v: {
        std::size_t first = 0, total = 0;
        for (int j = 0; j < n; ++j) {
          const auto len = static_cast<std::size_t>(block_rows(c, index, seed, j) * kRow);
          if (j < r) first += len;
          total += len;
        }
        const auto len = static_cast<std::size_t>(block_rows(c, index, seed, r) * kRow);
        for (int j = 0; j < n; ++j) {
          const std::vector<float> x = data(j, total);
          if (j == 0)
            out.assign(x.begin() + first, x.begin() + first + len);
          else
            for (std::size_t i = 0; i < len; ++i)
              out[i] = fold(ReduceOp::sum, out[i], x[first + i]);
        }
        break;
      }
      case CollectiveOp::barrier:
        break;
    }
    return out;
  }

  MpiCommunicator& comm_;
  int devices_;
  std::vector<Case> cases_;
};

int check_all(int processes, int process) {
  const int devices = 3 * processes, last = devices - 1;
  MpiCommunicator comm(devices);
  DeviceSet set(devices, {.pin = false, .held = comm.held_devices()});
  Check check(comm, devices);
  std::vector<rt::DeviceId> all;
  for (int d = 0; d < devices; ++d)
    all.push_back(static_cast<rt::DeviceId>(d));
  // Groups: everyone; an odd group spanning the first two processes; one process alone; a
  // pair across processes; devices out of rank order spanning the first and last process.
  const std::vector<std::vector<rt::DeviceId>> groups = {
      all, {1, 2, 3}, {0, 1, 2}, {2, 4}, {static_cast<rt::DeviceId>(last), 0, 4}};
  const std::size_t sizes[] = {0, 1, 37, 3000, 20000};
  for (const auto& g : groups) {
    for (std::size_t s : sizes) {
      check.add(CollectiveOp::all_reduce, g, s * 3, ReduceOp::sum);
      check.add(CollectiveOp::all_gather, g, s);
      check.add(CollectiveOp::reduce_scatter, g, s, ReduceOp::sum);
      check.add(CollectiveOp::all_to_all, g, s);
      check.add(CollectiveOp::all_to_all_v, g, s);
      check.add(CollectiveOp::all_gather_v, g, s);
      check.add(CollectiveOp::reduce_scatter_v, g, s);
      check.add(CollectiveOp::broadcast, g, s, ReduceOp::sum, static_cast<int>(g.size()) - 1);
    }
    check.add(CollectiveOp::all_reduce, g, 1000, ReduceOp::max);
    check.add(CollectiveOp::reduce_scatter, g, 101, ReduceOp::max);
    check.add(CollectiveOp::barrier, g, 0);
  }
  // Past 256 KiB an all-reduce goes by segments of 256 KiB (65536 floats), two in flight:
  // two and a part (the third reuses the first's buffers), over everyone (several members per
  // process), an odd group and a pair (one member per process: the pieces go straight from its
  // buffer); and, over 2 processes, one that would take 63 segments, more than an operation's 64
  // rounds allow with two in flight.
  for (std::size_t g : {0, 1, 3})
    check.add(CollectiveOp::all_reduce, groups[g], 2 * 65536 + 26003, ReduceOp::sum);
  if (processes == 2)
    check.add(CollectiveOp::all_reduce, groups[3], 62 * 65536 + 4099, ReduceOp::sum);
  for (std::size_t s : sizes) {
    check.add(CollectiveOp::send_recv, {0, static_cast<rt::DeviceId>(last)}, s);
    check.add(CollectiveOp::send_recv, {static_cast<rt::DeviceId>(last), 1}, s);
    check.add(CollectiveOp::send_recv, {3, 4}, s);
  }
  check.fill(1);
  rt::GraphBuilder builder;
  CollectiveMatcher matcher(builder, comm);
  check.issue(matcher, process);
  matcher.finish();
  const rt::Graph graph = builder.build();
  int failures = 0;
  for (std::uint64_t seed : {1u, 2u}) {
    check.fill(seed);
    set.executor().run(graph);
    failures += check.verify(seed);
  }
  double totals[] = {static_cast<double>(failures)};
  comm.processes().sum(totals);
  if (process == 0)
    fmt::print("mpi collectives: {} cases x 2 runs over {} processes, {} failed\n", check.size(),
               processes, totals[0]);
  return totals[0] == 0 ? 0 : 1;
}

// An all-reduce whose buffer is larger on process 1 than elsewhere.
int check_size_mismatch(int processes, int process) {
  MpiCommunicator comm(processes);
  DeviceSet set(processes, {.pin = false, .held = comm.held_devices()});
  std::vector<rt::DeviceId> all;
  for (int d = 0; d < processes; ++d)
    all.push_back(static_cast<rt::DeviceId>(d));
  std::vector<float> data(process == 1 ? 128 : 64, 1.f);
  rt::GraphBuilder builder;
  CollectiveMatcher matcher(builder, comm);
  matcher.all_reduce(ProcessGroup("world", all), process, data, ReduceOp::sum, {.name = "sum"});
  matcher.finish();
  try {
    set.executor().run(builder.build());
  } catch (const rt::TaskError& e) {
    fmt::print("process {} failed as expected: {}\n", process, e.what());
    return 0;
  }
  fmt::print("process {}: the run with mismatched sizes did not fail\n", process);
  return 1;
}

// Process 1 ends before running; the others must fail naming it.
int check_peer_ends(int processes, int process) {
  MpiCommunicator comm(processes);
  DeviceSet set(processes, {.pin = false, .held = comm.held_devices()});
  std::vector<rt::DeviceId> all;
  for (int d = 0; d < processes; ++d)
    all.push_back(static_cast<rt::DeviceId>(d));
  std::vector<float> data(64, 1.f);
  rt::GraphBuilder builder;
  CollectiveMatcher matcher(builder, comm);
  matcher.all_reduce(ProcessGroup("world", all), process, data, ReduceOp::sum, {.name = "sum"});
  matcher.finish();
  if (process == 1) std::raise(SIGKILL);
  try {
    set.executor().run(builder.build());
  } catch (const rt::TaskError& e) {
    fmt::print("process {} stopped: {}\n", process, e.what());
    comm.abort(3);
  }
  fmt::print("process {}: the run went on without process 1\n", process);
  return 1;
}

}  // namespace
}  // namespace weave::devices

int main(int argc, char** argv) {
  using namespace weave::devices;
  const std::string mode = argc > 1 ? argv[1] : "";
  try {
    // The process count and index, from a communicator of one device per process.
    int processes = 0, process = 0;
    {
      const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
      const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
      if (!size || !rank) {
        fmt::print("run me under mpirun\n");
        return 2;
      }
      processes = std::atoi(size);
      process = std::atoi(rank);
    }
    if (mode == "--size-mismatch") return check_size_mismatch(processes, process);
    if (mode == "--peer-ends") return check_peer_ends(processes, process);
    return check_all(processes, process);
  } catch (const std::exception& e) {
    fmt::print("error: {}\n", e.what());
    return 1;
  }
}
