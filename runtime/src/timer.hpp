// Calls functions at given times from one thread, so that holding a task's completion (a
// modelled link still "transferring") costs no core while it waits.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <queue>
#include <thread>
#include <vector>

#include "weave/runtime/types.hpp"

namespace weave::rt::detail {

class Timer {
 public:
  Timer() = default;
  // Calls whatever is still pending, at once, then stops.
  ~Timer();
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

  // Calls fn at the steady-clock time `deadline` (ns), or now if that has passed. A counted call
  // is pending() until it has returned: a task's completion held for its link. A run's deadline
  // is not counted, so that a run waiting only for it is seen as idle.
  void at(Nanos deadline, std::function<void()> fn, bool counted = true);
  std::size_t pending() const { return pending_.load(std::memory_order_acquire); }

 private:
  struct Entry {
    Nanos deadline;
    std::uint64_t seq;
    std::function<void()> fn;
    bool counted;
    bool operator>(const Entry& o) const {
      return deadline != o.deadline ? deadline > o.deadline : seq > o.seq;
    }
  };
  void loop();

  std::mutex mutex_;
  std::condition_variable wake_;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> queue_;
  std::uint64_t seq_ = 0;
  std::atomic<std::size_t> pending_{0};
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace weave::rt::detail
