#include "timer.hpp"

#include "clock.hpp"

namespace weave::rt::detail {

namespace {
// A condition variable wakes tens of microseconds late on an idle core; the last stretch
// before a deadline is waited by yielding instead.
constexpr Nanos kSpinWindow = 100'000;
}  // namespace

Timer::~Timer() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Timer::at(Nanos deadline, std::function<void()> fn, bool counted) {
  {
    std::lock_guard lock(mutex_);
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    queue_.push(Entry{deadline, seq_++, std::move(fn), counted});
    if (counted) pending_.fetch_add(1, std::memory_order_acq_rel);
  }
  wake_.notify_one();
}

void Timer::loop() {
  std::unique_lock lock(mutex_);
  for (;;) {
    if (queue_.empty()) {
      if (stop_) return;
      wake_.wait(lock);
      continue;
    }
    const Nanos deadline = queue_.top().deadline;
    const Nanos now = steady_now();
    if (!stop_ && deadline - now > kSpinWindow) {
      wake_.wait_for(lock, std::chrono::nanoseconds(deadline - now - kSpinWindow));
      continue;
    }
    if (!stop_ && deadline > now) {
      lock.unlock();
      std::this_thread::yield();
      lock.lock();
      continue;
    }
    Entry e = std::move(const_cast<Entry&>(queue_.top()));
    queue_.pop();
    lock.unlock();
    e.fn();
    if (e.counted) pending_.fetch_sub(1, std::memory_order_acq_rel);
    lock.lock();
  }
}

}  // namespace weave::rt::detail
