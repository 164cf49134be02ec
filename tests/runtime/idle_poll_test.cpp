// IdlePoll: a transfer that moves only while some thread polls it. The executor's idle threads
// must poll it, so a deferred task whose completion only a poll delivers still completes (on
// one thread or several), and a poll removed is never called again.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <vector>

#include "arenas.hpp"
#include "weave/runtime/executor.hpp"
#include "weave/runtime/idle_poll.hpp"

namespace weave::rt {
namespace {

using testing::Arenas;
using testing::limit_threads;

// Completes each deferred task on the `polls_needed`-th poll after it was handed over, and
// only then: no thread of its own.
class PolledTransfers final : public IdlePoll {
 public:
  explicit PolledTransfers(int polls_needed) : polls_needed_(polls_needed) {}
  void hand_over(Completion c) {
    std::lock_guard lock(mutex_);
    waiting_.push_back({std::move(c), 0});
    in_flight_.fetch_add(1);
  }
  bool busy() const noexcept override { return in_flight_.load() > 0; }
  void poll() noexcept override {
    polls_.fetch_add(1);
    std::vector<Completion> done;
    {
      std::unique_lock lock(mutex_, std::try_to_lock);
      if (!lock.owns_lock()) return;
      for (auto& w : waiting_)
        if (++w.polls == polls_needed_) done.push_back(std::move(w.completion));
      std::erase_if(waiting_, [&](const Waiting& w) { return w.polls >= polls_needed_; });
    }
    for (Completion& c : done) {
      in_flight_.fetch_sub(1);
      c.complete();
    }
  }
  int polls() const { return polls_.load(); }

 private:
  struct Waiting {
    Completion completion;
    int polls;
  };
  const int polls_needed_;
  std::mutex mutex_;
  std::vector<Waiting> waiting_;
  std::atomic<int> in_flight_{0}, polls_{0};
};

class IdlePollThreads : public ::testing::TestWithParam<int> {};

// A chain of transfers on two devices, each completed only by polling: the run finishes and
// the tasks ran in order.
TEST_P(IdlePollThreads, DeferredTasksThatOnlyPollingCompletesFinishTheRun) {
  auto limit = limit_threads(GetParam());
  Arenas arenas(2);
  Executor executor(arenas.pointers());
  PolledTransfers transfers(3);
  set_idle_poll(&transfers);
  GraphBuilder b;
  std::vector<int> order;
  std::mutex order_mutex;
  TaskId previous = kNoTask;
  for (int i = 0; i < 40; ++i) {
    const TaskId t = b.add({.device = static_cast<DeviceId>(i % 2),
                            .stream = kCommStream,
                            .kind = TaskKind::comm,
                            .name = "transfer " + std::to_string(i)},
                           [&, i](TaskContext& ctx) {
                             {
                               std::lock_guard lock(order_mutex);
                               order.push_back(i);
                             }
                             transfers.hand_over(ctx.defer());
                           });
    if (previous != kNoTask) b.precede(previous, t);
    previous = t;
  }
  // A stall would mean nobody polled: fail the run rather than wait for the default minute.
  executor.run(b.build(), {.stall_timeout = 5'000'000'000});
  set_idle_poll(nullptr);
  ASSERT_EQ(order.size(), 40u);
  for (int i = 0; i < 40; ++i)
    EXPECT_EQ(order[static_cast<std::size_t>(i)], i);
  EXPECT_GE(transfers.polls(), 3 * 40);
}

INSTANTIATE_TEST_SUITE_P(Threads, IdlePollThreads, ::testing::Values(1, 2, 3));

TEST(IdlePoll, ARemovedPollIsNotCalledAgain) {
  Arenas arenas(1);
  Executor executor(arenas.pointers());
  PolledTransfers transfers(1);
  set_idle_poll(&transfers);
  set_idle_poll(nullptr);
  GraphBuilder b;
  b.add({.name = "work"}, [&](TaskContext&) {});
  executor.run(b.build());
  EXPECT_EQ(transfers.polls(), 0);
}

}  // namespace
}  // namespace weave::rt
