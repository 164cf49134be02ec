#include "weave/devices/device.hpp"

#include <fmt/format.h>
#include <hwloc.h>
#include <tbb/task_scheduler_observer.h>

#include <cstdlib>
#include <new>
#include <stdexcept>

#include "weave/runtime/thread_handoff.hpp"

namespace weave::devices {

namespace {

// The cpuset this thread is bound to, so that re-entering an arena on the same cores costs no
// system call (binding takes tens of microseconds here).
struct ThreadBinding {
  hwloc_bitmap_t cpuset = hwloc_bitmap_alloc();
  bool bound = false;
  ~ThreadBinding() { hwloc_bitmap_free(cpuset); }
};
thread_local ThreadBinding t_binding;

class AllocationError : public std::bad_alloc {
 public:
  explicit AllocationError(std::string message) : message_(std::move(message)) {}
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

constexpr std::size_t kAlignment = 64;

}  // namespace

// The affinity a thread that is not the arena's worker (the one that calls run() and helps the
// devices) had before it entered a device's arena, restored when it leaves.
struct HelperBinding {
  hwloc_bitmap_t saved = hwloc_bitmap_alloc();
  bool restore = false;
  ~HelperBinding() { hwloc_bitmap_free(saved); }
};
thread_local HelperBinding t_helper;

// Pins the arena's worker threads to the device's cores as they enter it, and the thread that
// calls run() while it helps the device: it takes the arena's free slot, so the device's work runs
// on it. Left where it was, it ran one device's tasks on another device's core (the scheduler
// places it anywhere its own affinity allows): two devices on one core while the other idled.
// Measured with 2 devices on 2 cores: the helper ran 45 % of the work, and one device's products
// took 1.5 times the other's. It gets its own affinity back when it leaves the arena.
struct Device::Pinning : tbb::task_scheduler_observer {
  Pinning(tbb::task_arena& arena, hwloc_topology_t topology, hwloc_const_cpuset_t cpuset)
      : tbb::task_scheduler_observer(arena),
        topology_(topology),
        cpuset_(hwloc_bitmap_dup(cpuset)) {
    // Workers call on_scheduler_entry after a hand-off inside libtbb.
    rt::announce_handoff(this);
    observe(true);
  }
  ~Pinning() override {
    // Stops the callbacks and waits, inside libtbb, for those still running on workers.
    observe(false);
    rt::accept_handoff(this);
    hwloc_bitmap_free(cpuset_);
  }
  void on_scheduler_entry(bool is_worker) override {
    if (!is_worker) {
      bind_helper();
      return;
    }
    rt::accept_handoff(this);
    bind_this_thread();
    // For the destructor, which frees cpuset_ once libtbb says this call is over.
    rt::announce_handoff(this);
  }
  void on_scheduler_exit(bool is_worker) override {
    if (is_worker || !t_helper.restore) return;
    t_helper.restore = false;
    hwloc_set_cpubind(topology_, t_helper.saved, HWLOC_CPUBIND_THREAD);
  }

 private:
  // The helper enters one arena at a time (an arena's task never waits for a run).
  void bind_helper() {
    if (t_helper.restore) return;
    if (hwloc_get_cpubind(topology_, t_helper.saved, HWLOC_CPUBIND_THREAD) != 0) return;
    if (hwloc_bitmap_isequal(t_helper.saved, cpuset_)) return;
    t_helper.restore = hwloc_set_cpubind(topology_, cpuset_, HWLOC_CPUBIND_THREAD) == 0;
  }
  void bind_this_thread() {
    if (t_binding.bound && hwloc_bitmap_isequal(t_binding.cpuset, cpuset_)) return;
    if (hwloc_set_cpubind(topology_, cpuset_, HWLOC_CPUBIND_THREAD) == 0) {
      hwloc_bitmap_copy(t_binding.cpuset, cpuset_);
      t_binding.bound = true;
    }
  }

  hwloc_topology_t topology_;
  hwloc_bitmap_t cpuset_;
};

Device::Device(const Topology& topology, DevicePlacement placement, rt::MemoryTracker& memory,
               bool pin)
    : topology_(topology),
      placement_(std::move(placement)),
      memory_(memory),
      arena_(placement_.sharing > 1 ? 1 : static_cast<int>(placement_.cores.size()),
             /*reserved_for_masters=*/0) {
  if (pin && !topology.is_synthetic()) {
    auto* handle = static_cast<hwloc_topology_t>(topology.hwloc_handle());
    hwloc_bitmap_t cpuset = hwloc_bitmap_alloc();
    for (int c : placement_.cores) {
      for (int pu : topology.core_list()[c].pus)
        hwloc_bitmap_set(cpuset, static_cast<unsigned>(pu));
    }
    arena_.initialize();
    pinning_ = std::make_unique<Pinning>(arena_, handle, cpuset);
    hwloc_bitmap_free(cpuset);
  }
}

Device::~Device() = default;

int Device::concurrency() const {
  return const_cast<tbb::task_arena&>(arena_).max_concurrency();
}

void* Device::allocate(std::size_t bytes, rt::MemoryCategory category) {
  const std::size_t size =
      std::max<std::size_t>(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  void* p = nullptr;
  if (topology_.numa_nodes() > 1 && !topology_.is_synthetic()) {
    auto* handle = static_cast<hwloc_topology_t>(topology_.hwloc_handle());
    hwloc_obj_t node =
        hwloc_get_obj_by_type(handle, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(numa_node()));
    p = node ? hwloc_alloc_membind(handle, size, node->nodeset, HWLOC_MEMBIND_BIND,
                                   HWLOC_MEMBIND_BYNODESET)
             : nullptr;
  } else {
    p = std::aligned_alloc(kAlignment, size);
  }
  if (!p) {
    throw AllocationError(fmt::format("device {} could not allocate {} bytes of {} (NUMA node {})",
                                      id(), bytes, rt::to_string(category), numa_node()));
  }
  memory_.allocated(id(), category, static_cast<std::int64_t>(bytes));
  allocated_.fetch_add(static_cast<std::int64_t>(bytes), std::memory_order_relaxed);
  return p;
}

void Device::reserve(std::size_t bytes, rt::MemoryCategory category) {
  memory_.allocated(id(), category, static_cast<std::int64_t>(bytes));
}

void Device::unreserve(std::size_t bytes, rt::MemoryCategory category) {
  memory_.released(id(), category, static_cast<std::int64_t>(bytes));
}

void Device::deallocate(void* pointer, std::size_t bytes, rt::MemoryCategory category) {
  if (!pointer) return;
  memory_.released(id(), category, static_cast<std::int64_t>(bytes));
  allocated_.fetch_sub(static_cast<std::int64_t>(bytes), std::memory_order_relaxed);
  const std::size_t size =
      std::max<std::size_t>(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  if (topology_.numa_nodes() > 1 && !topology_.is_synthetic()) {
    hwloc_free(static_cast<hwloc_topology_t>(topology_.hwloc_handle()), pointer, size);
  } else {
    std::free(pointer);
  }
}

}  // namespace weave::devices
