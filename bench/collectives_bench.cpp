// Shared-memory collectives in the style of nccl-tests, beside the host's copy bandwidth.
//
// For 2, 4 and 8 devices (one single-slot arena each, run by rt::Executor, link model off) and
// sizes from 8 B up to 64 MiB: all-reduce (sum), all-gather, reduce-scatter (sum) and
// all-to-all, each a prebuilt one-collective graph run repeatedly. Columns:
//   size     S as nccl-tests counts it: the all-reduce buffer, the all-gather output, the
//            reduce-scatter input, each rank's all-to-all buffer
//   time     median wall time per run of the graph
//   algbw    S / time
//   busbw    algbw x nccl-tests' factor: all-reduce 2(n-1)/n, the others (n-1)/n
//   bus/cpy  busbw / memcpy bandwidth for S bytes (the better of one and two threads)
//   traffic  the bytes any in-process algorithm must read and write (all-reduce and
//            all-to-all 2nS, all-gather and reduce-scatter (n+1)S) per second
//   of peak  traffic / the traffic of the fastest copy of S bytes measured on this host
//            (memcpy, or a copy with streaming stores on two threads): 1.0 is copy speed
//
// nccl-tests' busbw assumes each rank owns its link. Here every rank shares one memory
// system and an in-place all-reduce must read n buffers and write n buffers, n copies' worth
// of traffic: at copy speed, busbw / copy bandwidth can reach only 2(n-1)/n^2 (0.5 for n = 2,
// 0.22 for n = 8). "of peak" says how close to the memory's speed a collective runs.
// Collectives report the median of five timed batches; the copy references report the best
// batch, so the ratios err low.
//
// Options: --max-bytes=N (default 64 MiB), --seconds=T timing budget per point (default 0.2),
// --threads=N worker threads (default: the hardware's), --ops=all_reduce,all_gather,... (default
// all four).
#include <fmt/format.h>
#include <tbb/global_control.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/runtime/executor.hpp"

namespace {

using namespace weave;
using Clock = std::chrono::steady_clock;

enum class Op { all_reduce, all_gather, reduce_scatter, all_to_all };
constexpr Op kOps[] = {Op::all_reduce, Op::all_gather, Op::reduce_scatter, Op::all_to_all};

std::string_view name(Op op) {
  switch (op) {
    case Op::all_reduce:
      return "all_reduce";
    case Op::all_gather:
      return "all_gather";
    case Op::reduce_scatter:
      return "reduce_scatter";
    case Op::all_to_all:
      return "all_to_all";
  }
  return "";
}

double bus_factor(Op op, int n) {
  const double f = static_cast<double>(n - 1) / n;
  return op == Op::all_reduce ? 2 * f : f;
}

// Bytes read plus bytes written by any in-process implementation, in units of S.
double traffic_factor(Op op, int n) {
  return op == Op::all_reduce || op == Op::all_to_all ? 2.0 * n : n + 1.0;
}

struct Options {
  std::size_t max_bytes = std::size_t{64} << 20;
  double seconds = 0.2;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::string ops = "all_reduce,all_gather,reduce_scatter,all_to_all";
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    const auto value = [&](std::string_view key) -> const char* {
      return arg.starts_with(key) ? argv[i] + key.size() : nullptr;
    };
    if (const char* v = value("--max-bytes="))
      o.max_bytes = std::strtoull(v, nullptr, 10);
    else if (const char* v = value("--seconds="))
      o.seconds = std::strtod(v, nullptr);
    else if (const char* v = value("--threads="))
      o.threads = std::atoi(v);
    else if (const char* v = value("--ops="))
      o.ops = v;
    else {
      fmt::print(stderr, "usage: {} [--max-bytes=N] [--seconds=T] [--threads=N] [--ops=a,b,...]\n",
                 argv[0]);
      std::exit(2);
    }
  }
  if (o.max_bytes < 8 || o.threads < 1 || !(o.seconds > 0)) {
    fmt::print(stderr, "need --max-bytes >= 8, --threads >= 1 and --seconds > 0\n");
    std::exit(2);
  }
  return o;
}

// 8 B, 32 B, ... (x4) below the largest, and the largest itself.
std::vector<std::size_t> sizes(std::size_t max_bytes) {
  std::vector<std::size_t> s;
  for (std::size_t b = 8; b < max_bytes; b *= 4)
    s.push_back(b);
  s.push_back(max_bytes);
  return s;
}

std::string human(std::size_t bytes) {
  if (bytes >= (1u << 20) && bytes % (1u << 20) == 0) return fmt::format("{} MiB", bytes >> 20);
  if (bytes >= (1u << 10) && bytes % (1u << 10) == 0) return fmt::format("{} KiB", bytes >> 10);
  return fmt::format("{} B", bytes);
}

// 64-byte aligned like Device::allocate, and touched, so no page fault is timed.
class Buffer {
 public:
  explicit Buffer(std::size_t bytes, char value = 1)
      : data_(static_cast<char*>(
            std::aligned_alloc(64, std::max<std::size_t>(64, (bytes + 63) / 64 * 64)))),
        bytes_(bytes) {
    std::memset(data_.get(), value, bytes);
  }
  char* data() { return data_.get(); }
  std::span<float> floats() { return {reinterpret_cast<float*>(data_.get()), bytes_ / 4}; }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char[], Free> data_;
  std::size_t bytes_;
};

struct Timing {
  double median;  // seconds per call
  double best;
};

// Five timed batches of about a fifth of the budget each, after a warm-up call.
template <typename Fn>
Timing time_calls(Fn&& fn, double budget) {
  fn();
  auto start = Clock::now();
  fn();
  const double once = std::chrono::duration<double>(Clock::now() - start).count();
  const auto calls =
      static_cast<int>(std::clamp(budget / 5 / std::max(once, 1e-9), 1.0, 1'000'000.0));
  std::vector<double> batches;
  for (int b = 0; b < 5; ++b) {
    start = Clock::now();
    for (int c = 0; c < calls; ++c)
      fn();
    batches.push_back(std::chrono::duration<double>(Clock::now() - start).count() / calls);
  }
  std::sort(batches.begin(), batches.end());
  return {batches[batches.size() / 2], batches.front()};
}

// A copy that writes around the caches, as the collectives do for large buffers.
void streaming_copy(char* to, const char* from, std::size_t bytes) {
#if defined(__SSE2__)
  const std::size_t head = std::min(bytes, (16 - reinterpret_cast<std::uintptr_t>(to) % 16) % 16);
  std::memcpy(to, from, head);
  std::size_t i = head;
  for (; i + 64 <= bytes; i += 64)
    for (std::size_t k = 0; k < 64; k += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(to + i + k),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i + k)));
  std::memcpy(to + i, from + i, bytes - i);
  _mm_sfence();
#else
  std::memcpy(to, from, bytes);
#endif
}

// Best S / t for copying S bytes split evenly over `threads` threads of one arena.
double copy_bandwidth(std::size_t bytes, int threads, bool streaming, double budget) {
  tbb::task_arena arena(threads);
  Buffer from(bytes, 1), to(bytes, 0);
  const auto part = [&](std::size_t first, std::size_t last) {
    if (streaming)
      streaming_copy(to.data() + first, from.data() + first, last - first);
    else
      std::memcpy(to.data() + first, from.data() + first, last - first);
  };
  const Timing t = time_calls(
      [&] {
        if (threads == 1) return part(0, bytes);
        arena.execute([&] {
          tbb::parallel_for(
              0, threads, [&](int i) { part(bytes * i / threads, bytes * (i + 1) / threads); },
              tbb::static_partitioner());
        });
      },
      budget);
  return static_cast<double>(bytes) / t.best;
}

struct CopyReference {
  double memcpy_one = 0, memcpy_two = 0, streaming_two = 0;  // bytes per second
  double memcpy() const { return std::max(memcpy_one, memcpy_two); }
  double fastest() const { return std::max(memcpy(), streaming_two); }
  void merge(const CopyReference& o) {
    memcpy_one = std::max(memcpy_one, o.memcpy_one);
    memcpy_two = std::max(memcpy_two, o.memcpy_two);
    streaming_two = std::max(streaming_two, o.streaming_two);
  }
};

CopyReference measure_copies(std::size_t bytes, double budget) {
  return {copy_bandwidth(bytes, 1, false, budget), copy_bandwidth(bytes, 2, false, budget),
          copy_bandwidth(bytes, 2, true, budget)};
}

// The element count an operation runs for S bytes: whole blocks of n floats where it splits
// the buffer by rank.
std::size_t element_count(Op op, int n, std::size_t bytes) {
  const auto un = static_cast<std::size_t>(n);
  return op == Op::all_reduce ? std::max<std::size_t>(bytes / 4, 1)
                              : std::max(bytes / 4 / un, std::size_t{1}) * un;
}

double time_collective(Op op, int n, std::size_t count, double budget) {
  std::vector<std::unique_ptr<tbb::task_arena>> arenas;
  std::vector<tbb::task_arena*> raw;
  for (int d = 0; d < n; ++d) {
    arenas.push_back(std::make_unique<tbb::task_arena>(1, 0));
    raw.push_back(arenas.back().get());
  }
  rt::Executor executor(raw);
  std::vector<rt::DeviceId> devices(static_cast<std::size_t>(n));
  std::iota(devices.begin(), devices.end(), 0u);
  const devices::ProcessGroup group("bench", devices);
  devices::SharedMemoryCommunicator comm;

  const auto un = static_cast<std::size_t>(n);
  const std::size_t in_count = op == Op::all_gather ? count / un : count;
  const std::size_t out_count = op == Op::reduce_scatter ? count / un : count;
  std::vector<Buffer> in, out;
  std::vector<std::span<float>> in_spans, out_spans;
  std::vector<std::span<const float>> in_const;
  for (int r = 0; r < n; ++r) {
    // Zero bytes are 0.0f: sums stay finite however often the all-reduce repeats.
    in.emplace_back(in_count * 4, 0);
    in_spans.push_back(in.back().floats());
    in_const.push_back(in.back().floats());
    if (op != Op::all_reduce) {
      out.emplace_back(out_count * 4, 0);
      out_spans.push_back(out.back().floats());
    }
  }
  rt::GraphBuilder b;
  switch (op) {
    case Op::all_reduce:
      comm.all_reduce(b, group, in_spans, devices::ReduceOp::sum);
      break;
    case Op::all_gather:
      comm.all_gather(b, group, in_const, out_spans);
      break;
    case Op::reduce_scatter:
      comm.reduce_scatter(b, group, in_const, out_spans, devices::ReduceOp::sum);
      break;
    case Op::all_to_all:
      comm.all_to_all(b, group, in_const, out_spans);
      break;
  }
  const rt::Graph graph = b.build();
  return time_calls([&] { executor.run(graph); }, budget).median;
}

struct Row {
  Op op;
  int n;
  std::size_t bytes;
  double seconds;
};

void print_header() {
  fmt::print("{:>10} {:>11} {:>9} {:>9} {:>8} {:>9} {:>8}\n", "size", "time(us)", "algbw", "busbw",
             "bus/cpy", "traffic", "of peak");
}

void print_row(const Row& r, const CopyReference& copy, bool with_op) {
  const double algbw = static_cast<double>(r.bytes) / r.seconds;
  const double busbw = algbw * bus_factor(r.op, r.n);
  const double traffic = algbw * traffic_factor(r.op, r.n);
  if (with_op) fmt::print("{:>15} {:>2} ", name(r.op), r.n);
  fmt::print("{:>10} {:>11.1f} {:>9.2f} {:>9.2f} {:>8.2f} {:>9.2f} {:>8.2f}\n", human(r.bytes),
             r.seconds * 1e6, algbw * 1e-9, busbw * 1e-9, busbw / copy.memcpy(), traffic * 1e-9,
             traffic / (2 * copy.fastest()));
}

}  // namespace

int main(int argc, char** argv) {
  const Options options = parse(argc, argv);
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism,
                            static_cast<std::size_t>(options.threads));
  const std::vector<std::size_t> all_sizes = sizes(options.max_bytes);

  fmt::print(
      "# weave shared-memory collectives, nccl-tests style: {} worker threads, link model off, "
      "float32, 64-byte aligned buffers; bandwidths in GB/s\n\n",
      options.threads);
  fmt::print("# copy bandwidth (best batch)\n{:>10} {:>10} {:>10} {:>14}\n", "size", "memcpy 1T",
             "memcpy 2T", "streaming 2T");
  std::map<std::size_t, CopyReference> copies;
  const auto print_copy = [](std::size_t bytes, const CopyReference& c) {
    fmt::print("{:>10} {:>10.2f} {:>10.2f} {:>14.2f}\n", human(bytes), c.memcpy_one * 1e-9,
               c.memcpy_two * 1e-9, c.streaming_two * 1e-9);
  };
  for (std::size_t s : all_sizes) {
    copies[s] = measure_copies(s, options.seconds);
    print_copy(s, copies[s]);
  }

  std::vector<Row> largest;
  for (Op op : kOps) {
    if (("," + options.ops + ",").find(fmt::format(",{},", name(op))) == std::string::npos)
      continue;
    for (int n : {2, 4, 8}) {
      fmt::print("\n# {} n={}\n", name(op), n);
      print_header();
      std::size_t previous = 0;
      for (std::size_t s : all_sizes) {
        const std::size_t count = element_count(op, n, s);
        if (count * 4 == previous) continue;  // rounded up to the same size as the last one
        previous = count * 4;
        const Row row{op, n, count * 4, time_collective(op, n, count, options.seconds)};
        print_row(row, copies[s], false);
        if (s == all_sizes.back()) largest.push_back(row);
      }
    }
  }

  // The copies measured again: the host's memory bandwidth drifts, and the better figure keeps
  // the ratios conservative.
  const std::size_t top = all_sizes.back();
  copies[top].merge(measure_copies(top, options.seconds));
  fmt::print("\n# summary at {}; copy references (best of two measurements):\n", human(top));
  fmt::print("{:>10} {:>10} {:>10} {:>14}\n", "size", "memcpy 1T", "memcpy 2T", "streaming 2T");
  print_copy(top, copies[top]);
  fmt::print("{:>15} {:>2} ", "op", "n");
  print_header();
  for (const Row& r : largest)
    print_row(r, copies[top], true);
  return 0;
}
