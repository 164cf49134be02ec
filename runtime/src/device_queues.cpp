#include "device_queues.hpp"

#include <tbb/task_arena.h>

#include <chrono>

#include "clock.hpp"

// libtbb is not built with ThreadSanitizer, so the hand-off of an enqueued drainer to a worker
// is invisible to it. Under TSan the hand-off is announced explicitly; the functor TBB copies
// is covered by tests/tsan.supp.
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#define WEAVE_HANDOFF_RELEASE(p) __tsan_release(p)
#define WEAVE_HANDOFF_ACQUIRE(p) __tsan_acquire(p)
#else
#define WEAVE_HANDOFF_RELEASE(p) ((void)(p))
#define WEAVE_HANDOFF_ACQUIRE(p) ((void)(p))
#endif

namespace weave::rt::detail {

namespace {
thread_local bool t_inside_task = false;
[[maybe_unused]] char g_delegation_token;  // an address for ThreadSanitizer hand-off notes
// A helper drains this many items from one queue before looking at the others, so that a
// single thread serving many devices moves all of them forward.
constexpr std::size_t kHelpBudget = 256;
// How long a helper spins for new work before it sleeps: a sleeping thread takes tens of
// microseconds to wake here.
constexpr Nanos kHelperSpin = 30'000;
}  // namespace

bool inside_task() {
  return t_inside_task;
}
InsideTaskScope::InsideTaskScope() : previous_(t_inside_task) {
  t_inside_task = true;
}
InsideTaskScope::~InsideTaskScope() {
  t_inside_task = previous_;
}

void WorkRing::push(const WorkItem& item) {
  if (tail_ - head_ == buffer_.size()) {
    std::vector<WorkItem> bigger(buffer_.size() * 2);
    const std::size_t n = tail_ - head_;
    for (std::size_t i = 0; i < n; ++i)
      bigger[i] = buffer_[(head_ + i) & (buffer_.size() - 1)];
    buffer_.swap(bigger);
    head_ = 0;
    tail_ = n;
  }
  buffer_[tail_++ & (buffer_.size() - 1)] = item;
}

DeviceQueues::DeviceQueues(std::vector<tbb::task_arena*> arenas) {
  queues_.reserve(arenas.size());
  for (tbb::task_arena* a : arenas) {
    auto q = std::make_unique<DeviceQueue>();
    a->initialize();
    q->arena = a;
    q->max_drainers = std::max(1, a->max_concurrency());
    queues_.push_back(std::move(q));
  }
}

void DeviceQueues::push(DeviceId device, const WorkItem& item, bool urgent) {
  DeviceQueue& q = *queues_[device];
  q.lock.lock();
  if (urgent) {
    q.urgent.push(item);
    q.urgent_queued.fetch_add(1, std::memory_order_relaxed);
  } else {
    q.normal.push(item);
  }
  q.queued.fetch_add(1, std::memory_order_seq_cst);
  q.lock.unlock();
  request_drainer(q);
  wake_helpers();
}

bool DeviceQueues::pop(DeviceQueue& q, WorkItem& item) {
  if (q.queued.load(std::memory_order_acquire) == 0) return false;
  q.lock.lock();
  bool got = true;
  if (!q.urgent.empty()) {
    item = q.urgent.pop();
    q.urgent_queued.fetch_sub(1, std::memory_order_relaxed);
  } else if (!q.normal.empty()) {
    item = q.normal.pop();
  } else {
    got = false;
  }
  if (got) {
    q.queued.fetch_sub(1, std::memory_order_relaxed);
    q.pops.fetch_add(1, std::memory_order_relaxed);
  }
  q.lock.unlock();
  return got;
}

void DeviceQueues::drain(DeviceQueue& q, std::size_t budget) {
  WorkItem item;
  while (budget-- > 0 && pop(q, item))
    item.run(item.target, item.arg);
}

void DeviceQueues::request_drainer(DeviceQueue& q) {
  int d = q.drainers.load(std::memory_order_seq_cst);
  while (d < q.max_drainers) {
    if (q.drainers.compare_exchange_weak(d, d + 1, std::memory_order_seq_cst)) {
      WEAVE_HANDOFF_RELEASE(&q);
      q.arena->enqueue([self = shared_from_this(), &q] {
        WEAVE_HANDOFF_ACQUIRE(&q);
        self->drainer(q);
      });
      return;
    }
  }
}

void DeviceQueues::drainer(DeviceQueue& q) {
  for (;;) {
    q.running.fetch_add(1, std::memory_order_seq_cst);
    drain(q, SIZE_MAX);
    q.running.fetch_sub(1, std::memory_order_seq_cst);
    // Give the slot back, then look again: work pushed while this drainer still held the
    // slot did not start another one.
    q.drainers.fetch_sub(1, std::memory_order_seq_cst);
    if (q.queued.load(std::memory_order_seq_cst) == 0) return;
    int d = q.drainers.load(std::memory_order_seq_cst);
    if (d >= q.max_drainers || !q.drainers.compare_exchange_strong(d, d + 1)) return;
  }
}

bool DeviceQueues::helpable(const DeviceQueue& q) {
  return q.queued.load(std::memory_order_seq_cst) > 0 &&
         q.running.load(std::memory_order_seq_cst) < q.max_drainers;
}

bool DeviceQueues::any_helpable() const {
  for (const auto& q : queues_) {
    if (helpable(*q)) return true;
  }
  return false;
}

void DeviceQueues::wake_helpers() {
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard lock(sleep_mutex_);
    sleep_cv_.notify_all();
  }
}

void DeviceQueues::help_until(const std::function<bool()>& done, const std::function<void()>& tick,
                              Nanos period) {
  Nanos last_tick = steady_now();
  while (!done()) {
    bool worked = false;
    for (auto& qp : queues_) {
      DeviceQueue& q = *qp;
      // Help only where the arena has a free slot: entering a full arena would park this
      // thread until a worker ran its share.
      if (!helpable(q)) continue;
      q.running.fetch_add(1, std::memory_order_seq_cst);
      // When the arena is full, TBB hands this functor to a worker and waits.
      // When the arena is full, TBB hands this functor to a worker and waits. The token is
      // announced before the functor's captures are read.
      auto help = [&q] {
        WEAVE_HANDOFF_ACQUIRE(&g_delegation_token);
        drain(q, kHelpBudget);
        WEAVE_HANDOFF_RELEASE(&g_delegation_token);
      };
      WEAVE_HANDOFF_RELEASE(&g_delegation_token);
      q.arena->execute(help);
      WEAVE_HANDOFF_ACQUIRE(&g_delegation_token);
      q.running.fetch_sub(1, std::memory_order_seq_cst);
      worked = true;
    }
    if (worked) continue;

    const Nanos spin_start = steady_now();
    // Work another thread is draining is not ours to wait for: sleep until helpable work or
    // the end of the run wakes this thread.
    while (!any_helpable() && !done() && steady_now() - spin_start < kHelperSpin) {
      std::this_thread::yield();
    }
    if (!any_helpable() && !done()) {
      std::unique_lock lock(sleep_mutex_);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      if (!any_helpable() && !done()) sleep_cv_.wait_for(lock, std::chrono::nanoseconds(period));
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    }
    const Nanos now = steady_now();
    if (now - last_tick >= period) {
      last_tick = now;
      tick();
    }
  }
}

bool DeviceQueues::quiescent() const {
  for (const auto& q : queues_) {
    if (q->running.load(std::memory_order_seq_cst) != 0) return false;
  }
  return true;
}

std::uint64_t DeviceQueues::total_pops() const {
  std::uint64_t n = 0;
  for (const auto& q : queues_)
    n += q->pops.load(std::memory_order_relaxed);
  return n;
}

}  // namespace weave::rt::detail
