// Per-device ready queues drained inside the device's oneTBB arena.
//
// Ready work is pushed to its device's queue; up to the arena's concurrency "drainers" are
// enqueued into the arena to run it. A drainer runs items until the queue is empty and then
// leaves, so no thread ever waits inside a drainer. The thread that started a run (or waits
// in eager mode) helps: it drains queues whose arena has a free slot, and sleeps when there
// is nothing to do. With no TBB worker threads at all, that thread alone runs everything.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>

#include <tbb/task_arena.h>
#include <mutex>
#include <thread>
#include <vector>

#include "weave/runtime/types.hpp"

namespace weave::rt::detail {

// A unit of ready work: run(target, arg). Must not throw. Urgent work (communication and host
// bookkeeping: cheap, and it unblocks other devices) is taken before the rest.
struct WorkItem {
  void (*run)(void* target, std::uint32_t arg);
  void* target;
  std::uint32_t arg;
  bool urgent;
};

class SpinLock {
 public:
  void lock() {
    for (int spins = 0; locked_.exchange(true, std::memory_order_acquire);) {
      while (locked_.load(std::memory_order_relaxed)) {
        if (++spins > 64) std::this_thread::yield();  // the holder may have lost its core
      }
    }
  }
  void unlock() { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};

// FIFO ring buffer that grows.
class WorkRing {
 public:
  bool empty() const { return head_ == tail_; }
  void push(const WorkItem& item);
  WorkItem pop() { return buffer_[head_++ & (buffer_.size() - 1)]; }

 private:
  std::vector<WorkItem> buffer_ = std::vector<WorkItem>(64);
  std::uint64_t head_ = 0;
  std::uint64_t tail_ = 0;
};

struct alignas(64) DeviceQueue {
  tbb::task_arena* arena = nullptr;
  int max_drainers = 1;
  SpinLock lock;
  WorkRing urgent;
  WorkRing normal;
  std::atomic<std::uint32_t> queued{0};
  std::atomic<std::uint32_t> urgent_queued{0};
  std::atomic<int> drainers{0};  // enqueued into the arena and not yet finished
  std::atomic<int> running{0};   // threads inside drain(): drainers and helpers
  std::atomic<std::uint64_t> pops{0};
};

class DeviceQueues : public std::enable_shared_from_this<DeviceQueues> {
 public:
  explicit DeviceQueues(std::vector<tbb::task_arena*> arenas);

  std::size_t size() const { return queues_.size(); }
  DeviceQueue& queue(DeviceId d) { return *queues_[d]; }

  void push(DeviceId device, const WorkItem& item);
  // Pushes several items of one device under one lock.
  void push_batch(DeviceId device, const WorkItem* items, std::size_t count);

  // Runs queued work on the calling thread until done() holds. Calls tick() about every
  // `period`, between the pieces of work it runs and while idle (the stall watchdog and the
  // deadline live there).
  void help_until(const std::function<bool()>& done, const std::function<void()>& tick,
                  Nanos period);
  // Wakes threads sleeping in help_until (their condition may have changed).
  void wake_helpers();

  // True when no thread is inside any queue's drain loop and nothing is queued.
  bool quiescent() const;
  std::uint64_t total_pops() const;
  // True while a drainer is enqueued in or running on some arena.
  bool drainers_pending() const;

 private:
  void request_drainer(DeviceQueue& q);
  void drainer(DeviceQueue& q);
  // Takes up to `most` items, and no more than this thread's share of what is queued so that
  // the arena's other threads get work too.
  static std::size_t pop_some(DeviceQueue& q, WorkItem* out, std::size_t most);
  static void drain(DeviceQueue& q, std::size_t budget);
  // Spins a little for more work on q before a thread leaves the arena; false when none came,
  // another device's queue needs a thread, or *stop says so.
  bool linger(const DeviceQueue& q, const std::function<bool()>* stop = nullptr) const;
  static bool helpable(const DeviceQueue& q);
  bool any_helpable() const;

  std::vector<std::unique_ptr<DeviceQueue>> queues_;
  std::mutex sleep_mutex_;
  std::condition_variable sleep_cv_;
  std::atomic<int> sleepers_{0};
};

// Set while a thread runs a task's work; nested runs and synchronisations are refused.
bool inside_task();
class InsideTaskScope {
 public:
  InsideTaskScope();
  ~InsideTaskScope();

 private:
  bool previous_;
};

}  // namespace weave::rt::detail
