#include "device_queues.hpp"

#include <tbb/global_control.h>
#include <tbb/task_arena.h>

#include <chrono>

#include "clock.hpp"
#include "idle_polling.hpp"
#include "weave/runtime/thread_handoff.hpp"

namespace weave::rt::detail {

namespace {
thread_local bool t_inside_task = false;
// A helper drains this many items from one queue before looking at the others, so that a
// single thread serving many devices moves all of them forward.
constexpr std::size_t kHelpBudget = 256;
// How long a helper spins for new work before it sleeps: a sleeping thread takes tens of
// microseconds to wake here.
constexpr Nanos kHelperSpin = 30'000;
// How long a drainer waits for more work on its own queue before it leaves the arena.
constexpr Nanos kDrainerLinger = 20'000;
// How long a thread with nothing to run keeps polling transfers in flight (IdlePoll) before it
// leaves or sleeps: a transfer it completes lets its device go on without waking a thread. About
// what waking a thread costs here (tens of microseconds): spinning that long, then sleeping, never
// wastes more than twice the best choice made knowing when the transfer ends. It spins rather
// than yields between polls: on a core shared with another program a yield hands that program
// the core for a whole time slice (milliseconds), which the transfer's completion would wait for.
constexpr Nanos kPollLinger = 100'000;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}
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

void DeviceQueues::push(DeviceId device, const WorkItem& item) {
  push_batch(device, &item, 1);
}

void DeviceQueues::push_batch(DeviceId device, const WorkItem* items, std::size_t count) {
  DeviceQueue& q = *queues_[device];
  q.lock.lock();
  std::uint32_t urgent = 0;
  for (std::size_t i = 0; i < count; ++i) {
    if (items[i].urgent) {
      q.urgent.push(items[i]);
      ++urgent;
    } else {
      q.normal.push(items[i]);
    }
  }
  if (urgent) q.urgent_queued.fetch_add(urgent, std::memory_order_relaxed);
  q.queued.fetch_add(static_cast<std::uint32_t>(count), std::memory_order_seq_cst);
  q.lock.unlock();
  request_drainer(q);
  wake_helpers();
}

std::size_t DeviceQueues::pop_some(DeviceQueue& q, WorkItem* out, std::size_t most) {
  if (q.queued.load(std::memory_order_acquire) == 0) return 0;
  q.lock.lock();
  const std::size_t share =
      q.queued.load(std::memory_order_relaxed) / static_cast<std::size_t>(q.max_drainers);
  const std::size_t take = std::clamp<std::size_t>(share, 1, most);
  std::size_t n = 0, urgent = 0;
  for (; n < take && !q.urgent.empty(); ++n, ++urgent)
    out[n] = q.urgent.pop();
  for (; n < take && !q.normal.empty(); ++n)
    out[n] = q.normal.pop();
  if (n) {
    if (urgent)
      q.urgent_queued.fetch_sub(static_cast<std::uint32_t>(urgent), std::memory_order_relaxed);
    q.queued.fetch_sub(static_cast<std::uint32_t>(n), std::memory_order_relaxed);
    q.pops.fetch_add(n, std::memory_order_relaxed);
  }
  q.lock.unlock();
  return n;
}

void DeviceQueues::drain(DeviceQueue& q, std::size_t budget) {
  constexpr std::size_t kBatch = 16;
  WorkItem batch[kBatch];
  while (budget > 0) {
    const std::size_t n = pop_some(q, batch, std::min(budget, kBatch));
    if (n == 0) return;
    for (std::size_t i = 0; i < n; ++i)
      batch[i].run(batch[i].target, batch[i].arg);
    budget -= n;
    // Transfers move while some thread polls: between tasks too, not only when idle.
    if (idle_poll_busy()) idle_poll_now();
  }
}

bool DeviceQueues::linger(const DeviceQueue& q, const std::function<bool()>* stop) const {
  const Nanos start = steady_now();
  for (unsigned spin = 1;; ++spin) {
    if (q.queued.load(std::memory_order_acquire) > 0) return true;
    if (spin % 64 == 0) {
      const Nanos waited = steady_now() - start;
      // With transfers in flight, stay and poll them: the one this device waits for then
      // completes here, and what follows it runs at once.
      const bool polling = waited < kPollLinger && idle_poll_busy();
      if ((!polling && waited > kDrainerLinger) || (stop && (*stop)())) return false;
      for (const auto& other : queues_) {
        // Work another device's own thread will take is no reason to leave.
        if (other.get() != &q && helpable(*other)) return false;
      }
      if (polling) {
        idle_poll_now();
        spin = 48;  // poll again after a few spins
        continue;
      }
    }
    cpu_relax();
  }
}

void DeviceQueues::request_drainer(DeviceQueue& q) {
  int d = q.drainers.load(std::memory_order_seq_cst);
  if (d >= q.max_drainers) return;
  // With no worker threads at all an enqueued drainer would never run (and would hold these
  // queues forever); the helping thread runs everything then.
  if (tbb::global_control::active_value(tbb::global_control::max_allowed_parallelism) <= 1) return;
  while (d < q.max_drainers) {
    if (q.drainers.compare_exchange_weak(d, d + 1, std::memory_order_seq_cst)) {
      q.arena->enqueue(HandedOver([self = shared_from_this(), &q] { self->drainer(q); }));
      return;
    }
  }
}

void DeviceQueues::drainer(DeviceQueue& q) {
  q.running.fetch_add(1, std::memory_order_seq_cst);
  for (;;) {
    drain(q, SIZE_MAX);
    // Staying a moment costs far less than leaving and being enqueued again for the next
    // piece of work, which is often a few hundred nanoseconds away (an event round trip).
    if (linger(q)) continue;
    q.running.fetch_sub(1, std::memory_order_seq_cst);
    // Give the slot back, then look again: work pushed while this drainer still held the
    // slot did not start another one.
    q.drainers.fetch_sub(1, std::memory_order_seq_cst);
    if (q.queued.load(std::memory_order_seq_cst) == 0) return;
    int d = q.drainers.load(std::memory_order_seq_cst);
    if (d >= q.max_drainers || !q.drainers.compare_exchange_strong(d, d + 1)) return;
    q.running.fetch_add(1, std::memory_order_seq_cst);
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
    // Between pieces of work too, not only when idle: a run's deadline passes while it works.
    if (const Nanos now = steady_now(); now - last_tick >= period) {
      last_tick = now;
      tick();
    }
    bool worked = false;
    for (auto& qp : queues_) {
      DeviceQueue& q = *qp;
      // Help only where the arena has a free slot: entering a full arena would park this
      // thread until a worker ran its share.
      if (!helpable(q)) continue;
      // The helper counts as a drainer while it is here: work pushed meanwhile then enqueues
      // no extra drainer, which would pull a worker into this arena's slot and make the next
      // execute() wait for that worker.
      q.running.fetch_add(1, std::memory_order_seq_cst);
      q.drainers.fetch_add(1, std::memory_order_seq_cst);
      // When the arena is full, TBB hands this functor to a worker and waits (HandedOver
      // tells ThreadSanitizer both ways).
      const HandedOver help([this, &q, &done] {
        // Like a drainer, stay for work that is about to arrive rather than pay for entering
        // the arena again.
        do {
          drain(q, kHelpBudget);
        } while (!done() && linger(q, &done));
      });
      q.arena->execute(help);
      accept_handoff(&help);
      q.running.fetch_sub(1, std::memory_order_seq_cst);
      q.drainers.fetch_sub(1, std::memory_order_seq_cst);
      // Work pushed while this thread held the drainer slot started no drainer.
      if (q.queued.load(std::memory_order_seq_cst) > 0) request_drainer(q);
      worked = true;
    }
    if (worked) continue;

    const Nanos spin_start = steady_now();
    // Work another thread is draining is not ours to wait for: sleep until helpable work or
    // the end of the run wakes this thread.
    for (;;) {
      if (any_helpable() || done()) break;
      const Nanos waited = steady_now() - spin_start;
      if (waited < kPollLinger && idle_poll_busy()) {
        idle_poll_now();  // as a lingering drainer does, spinning between polls
        for (int i = 0; i < 16; ++i)
          cpu_relax();
        continue;
      }
      if (waited >= kHelperSpin) break;
      std::this_thread::yield();
    }
    if (!any_helpable() && !done()) {
      std::unique_lock lock(sleep_mutex_);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      if (!any_helpable() && !done()) sleep_cv_.wait_for(lock, std::chrono::nanoseconds(period));
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }
}

bool DeviceQueues::quiescent() const {
  for (const auto& q : queues_) {
    if (q->running.load(std::memory_order_seq_cst) != 0) return false;
  }
  return true;
}

bool DeviceQueues::drainers_pending() const {
  for (const auto& q : queues_) {
    if (q->drainers.load(std::memory_order_seq_cst) != 0) return true;
  }
  return false;
}

std::uint64_t DeviceQueues::total_pops() const {
  std::uint64_t n = 0;
  for (const auto& q : queues_)
    n += q->pops.load(std::memory_order_relaxed);
  return n;
}

}  // namespace weave::rt::detail
