#include "synthetic_workload.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace weave::cli {

namespace {

using rt::DeviceId;
using rt::TaskId;

// Buffers of one device, from its allocator so the memory tracker sees them.
class DeviceBuffer {
 public:
  DeviceBuffer(devices::Device& device, std::size_t bytes, rt::MemoryCategory category)
      : device_(device),
        bytes_(bytes),
        category_(category),
        data_(static_cast<float*>(device.allocate(bytes, category))) {
    std::memset(data_, 0, bytes);
  }
  ~DeviceBuffer() { device_.deallocate(data_, bytes_, category_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  float* data() { return data_; }
  std::size_t floats() const { return bytes_ / sizeof(float); }

 private:
  devices::Device& device_;
  std::size_t bytes_;
  rt::MemoryCategory category_;
  float* data_;
};

struct Buffers {
  std::vector<std::unique_ptr<DeviceBuffer>> work;  // per device: compute scratch
  std::vector<std::unique_ptr<DeviceBuffer>> send;  // per device: all-to-all input
  std::vector<std::unique_ptr<DeviceBuffer>> recv;  // per device: all-to-all output
};

constexpr std::size_t kScratchFloats = 4096;  // stays in L1/L2: the work is arithmetic

// About `flops` floating-point operations on a small buffer (two per element per sweep).
void burn(float* x, double flops) {
  const auto sweeps = static_cast<std::size_t>(std::max(1.0, flops / (2.0 * kScratchFloats)));
  for (std::size_t s = 0; s < sweeps; ++s) {
    for (std::size_t i = 0; i < kScratchFloats; ++i)
      x[i] = x[i] * 0.999f + 0.001f;
  }
}

void check(const WorkloadOptions& o) {
  auto fail = [](const std::string& what) { throw std::invalid_argument(what); };
  const auto shapes = workload_shapes();
  if (std::find(shapes.begin(), shapes.end(), o.shape) == shapes.end()) {
    fail(fmt::format("unknown workload '{}': choose one of {}", o.shape, fmt::join(shapes, ", ")));
  }
  if (o.devices < 1) fail(fmt::format("--devices must be at least 1 (got {})", o.devices));
  if (o.layers < 1) fail(fmt::format("--layers must be at least 1 (got {})", o.layers));
  if (o.chunks < 1) fail(fmt::format("--chunks must be at least 1 (got {})", o.chunks));
  if (o.size < 1) fail(fmt::format("--size must be at least 1 (got {})", o.size));
  if (!(o.flops_per_task >= 0))
    fail(fmt::format("--flops must be >= 0 (got {})", o.flops_per_task));
  if (!(o.bytes_per_exchange >= 0)) {
    fail(fmt::format("--bytes must be >= 0 (got {})", o.bytes_per_exchange));
  }
}

rt::Graph build_overlap(const WorkloadOptions& o, Buffers* buffers) {
  rt::GraphBuilder b;
  const auto p = static_cast<DeviceId>(o.devices);
  const double bytes = o.bytes_per_exchange;
  std::vector<TaskId> previous_combine(p, rt::kNoTask);
  for (int layer = 0; layer < o.layers; ++layer) {
    std::vector<std::vector<TaskId>> exchanges(p);
    for (int c = 0; c < o.chunks; ++c) {
      std::vector<TaskId> members;
      for (DeviceId d = 0; d < p; ++d) {
        rt::TaskFn compute;
        if (buffers) {
          compute = [work = (*buffers).work[d]->data(), &send = *(*buffers).send[d],
                     flops = o.flops_per_task, c, chunks = o.chunks](rt::TaskContext&) {
            burn(work, flops);
            // The chunk's share of the send buffer is what its exchange moves.
            const std::size_t share = send.floats() / static_cast<std::size_t>(chunks);
            std::fill_n(send.data() + share * static_cast<std::size_t>(c), share, work[0]);
          };
        }
        const rt::TaskTags tags{.layer = layer, .chunk = c, .phase = rt::Phase::forward};
        const TaskId t = b.add({.device = d,
                                .kind = rt::TaskKind::compute,
                                .name = fmt::format("L{}.chunk{}.compute", layer, c),
                                .tags = tags,
                                .cost = {.flops = o.flops_per_task}},
                               std::move(compute));
        if (c == 0 && previous_combine[d] != rt::kNoTask) b.precede(previous_combine[d], t);

        // All-to-all: member d gathers slice d of every member's chunk share.
        rt::TaskFn exchange;
        if (buffers) {
          exchange = [buffers, d, p, c, chunks = o.chunks](rt::TaskContext&) {
            const std::size_t share =
                (*buffers).send[d]->floats() / static_cast<std::size_t>(chunks);
            const std::size_t slice = share / p;
            for (DeviceId src = 0; src < p; ++src) {
              const float* from =
                  (*buffers).send[src]->data() + share * static_cast<std::size_t>(c) + slice * d;
              float* to =
                  (*buffers).recv[d]->data() + share * static_cast<std::size_t>(c) + slice * src;
              std::memcpy(to, from, slice * sizeof(float));
            }
          };
        }
        const TaskId a2a =
            b.add({.device = d,
                   .stream = rt::kCommStream,
                   .kind = rt::TaskKind::comm,
                   .name = fmt::format("L{}.chunk{}.all_to_all", layer, c),
                   .tags = tags,
                   .cost = {.bytes = bytes / o.chunks * (p - 1) / p, .messages = p - 1}},
                  std::move(exchange));
        b.precede(t, a2a);
        members.push_back(a2a);
        exchanges[d].push_back(a2a);
      }
      b.rendezvous(fmt::format("L{}.chunk{}.all_to_all", layer, c), members);
    }
    for (DeviceId d = 0; d < p; ++d) {
      rt::TaskFn combine;
      if (buffers) {
        combine = [recv = (*buffers).recv[d]->data(),
                   work = (*buffers).work[d]->data()](rt::TaskContext&) { work[0] += recv[0]; };
      }
      const TaskId t = b.add({.device = d,
                              .name = fmt::format("L{}.combine", layer),
                              .tags = {.layer = layer, .phase = rt::Phase::forward},
                              .cost = {.flops = o.flops_per_task / 10}},
                             std::move(combine));
      for (TaskId e : exchanges[d])
        b.precede(e, t);
      previous_combine[d] = t;
    }
  }
  return b.build();
}

rt::Graph build_shape(const WorkloadOptions& o, Buffers* buffers) {
  rt::GraphBuilder b;
  auto task = [&](DeviceId d, rt::StreamId s, std::string name) {
    rt::TaskFn work;
    if (buffers) {
      work = [x = (*buffers).work[d]->data(), f = o.flops_per_task](rt::TaskContext&) {
        burn(x, f);
      };
    }
    return b.add({.device = d, .stream = s, .name = name, .cost = {.flops = o.flops_per_task}},
                 std::move(work));
  };
  if (o.shape == "chain") {
    TaskId prev = rt::kNoTask;
    for (int i = 0; i < o.size; ++i) {
      const TaskId t =
          task(static_cast<DeviceId>(i % o.devices), rt::kComputeStream, fmt::format("chain{}", i));
      if (prev != rt::kNoTask) b.precede(prev, t);
      prev = t;
    }
  } else if (o.shape == "fanout") {
    const TaskId source = task(0, rt::kComputeStream, "source");
    const TaskId sink = task(0, rt::kComputeStream, "sink");
    std::vector<rt::StreamId> lanes;
    for (int s = 0; s < 4; ++s)
      lanes.push_back(b.stream(fmt::format("lane{}", s)));
    for (int i = 0; i < o.size; ++i) {
      const TaskId t = task(static_cast<DeviceId>(i % o.devices), lanes[i / o.devices % 4],
                            fmt::format("leaf{}", i));
      b.precede(source, t);
      b.precede(t, sink);
    }
  } else {  // wavefront: (i, j) after (i-1, j) and (i, j-1); row i on device i mod p
    std::vector<TaskId> row(static_cast<std::size_t>(o.size), rt::kNoTask);
    for (int i = 0; i < o.size; ++i) {
      for (int j = 0; j < o.size; ++j) {
        const TaskId t = task(static_cast<DeviceId>(i % o.devices), rt::kComputeStream,
                              fmt::format("w{}.{}", i, j));
        if (row[j] != rt::kNoTask) b.precede(row[j], t);
        row[j] = t;
      }
    }
  }
  return b.build();
}

}  // namespace

std::vector<std::string> workload_shapes() {
  return {"overlap", "chain", "fanout", "wavefront"};
}

Workload build_workload(const WorkloadOptions& options, devices::DeviceSet* devices) {
  check(options);
  Workload w;
  std::shared_ptr<Buffers> buffers;
  if (devices) {
    if (static_cast<int>(devices->size()) != options.devices) {
      throw std::invalid_argument(fmt::format("the workload is for {} devices but {} exist",
                                              options.devices, devices->size()));
    }
    buffers = std::make_shared<Buffers>();
    const auto chunk_bytes = static_cast<std::size_t>(options.bytes_per_exchange / options.chunks) /
                             sizeof(float) / static_cast<std::size_t>(options.devices) *
                             sizeof(float) * static_cast<std::size_t>(options.devices);
    const std::size_t exchange_bytes =
        std::max<std::size_t>(chunk_bytes * static_cast<std::size_t>(options.chunks), 64);
    for (DeviceId d = 0; d < devices->size(); ++d) {
      auto& dev = (*devices)[d];
      buffers->work.push_back(std::make_unique<DeviceBuffer>(dev, kScratchFloats * sizeof(float),
                                                             rt::MemoryCategory::workspace));
      buffers->send.push_back(
          std::make_unique<DeviceBuffer>(dev, exchange_bytes, rt::MemoryCategory::comm_buffers));
      buffers->recv.push_back(
          std::make_unique<DeviceBuffer>(dev, exchange_bytes, rt::MemoryCategory::comm_buffers));
    }
  }
  w.graph = options.shape == "overlap" ? build_overlap(options, buffers.get())
                                       : build_shape(options, buffers.get());
  w.buffers = buffers;
  return w;
}

}  // namespace weave::cli
