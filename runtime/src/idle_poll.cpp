#include "weave/runtime/idle_poll.hpp"

#include <atomic>
#include <thread>

#include "idle_polling.hpp"

namespace weave::rt {

namespace {
std::atomic<IdlePoll*> g_poll{nullptr};
// Threads inside a call of the installed poll: removing it waits for them to leave.
std::atomic<int> g_inside{0};

// Calls f on the installed poll, if any; the poll cannot be removed meanwhile.
template <typename F>
bool with_poll(F f) {
  if (!g_poll.load(std::memory_order_acquire)) return false;  // the common case: none
  g_inside.fetch_add(1, std::memory_order_seq_cst);
  IdlePoll* p = g_poll.load(std::memory_order_seq_cst);
  const bool result = p && f(*p);
  g_inside.fetch_sub(1, std::memory_order_seq_cst);
  return result;
}
}  // namespace

void set_idle_poll(IdlePoll* poll) {
  g_poll.store(poll, std::memory_order_seq_cst);
  while (g_inside.load(std::memory_order_seq_cst) != 0)
    std::this_thread::yield();
}

namespace detail {

bool idle_poll_busy() {
  return with_poll([](IdlePoll& p) { return p.busy(); });
}

void idle_poll_now() {
  with_poll([](IdlePoll& p) {
    p.poll();
    return true;
  });
}

}  // namespace detail
}  // namespace weave::rt
