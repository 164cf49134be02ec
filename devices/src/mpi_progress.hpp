// The progress engine of a process's MPI traffic. Operations (a collective's part in this
// process, a host exchange) are rounds of non-blocking sends and receives, one round in flight
// at a time or, for a pipelined one (a large all-reduce by segments), several; whichever thread
// polls the engine tests them, starts each operation's next rounds and finishes the operations
// that are over. The thread that submits an operation posts its first round itself and polls
// for a few microseconds: a small collective whose peers are ready completes there, on the
// device's own thread, with no hand-off. One that is not over by then is polled by the
// executor's idle threads (the engine is their rt::IdlePoll, so a device waiting for its
// transfer completes it itself) and by the engine's own thread, woken then, which also polls
// while the devices compute and watches the peers an operation waits for: one that has ended
// fails the operation, naming it, instead of leaving the job to hang.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "weave/runtime/idle_poll.hpp"

namespace weave::devices::detail {

class MpiJob;

struct MpiMessage {
  int peer = 0;  // the other process's rank
  void* data = nullptr;
  std::size_t bytes = 0;
};

// Messages that may all be in flight at once; the next round starts when all have completed.
struct MpiRound {
  std::vector<MpiMessage> sends, receives;
};

class MpiOperation {
 public:
  // Rounds per operation at most: round r's messages carry tag (id * kRounds + r) mod the
  // job's tag bound, so operations of different ids never match each other's messages.
  static constexpr int kRounds = 64;

  virtual ~MpiOperation() = default;
  // The next round: called by the thread polling the engine, first when the operation is
  // submitted and then each time one of its rounds has completed, again and again while fewer
  // than depth() of its rounds are in flight and it returns one. std::nullopt: nothing to post
  // yet; the operation is over when it says so with none of its rounds in flight. May throw:
  // the operation fails with that error.
  virtual std::optional<MpiRound> next() = 0;
  // How many of its rounds may be in flight at once. 1: each round starts once the previous
  // one has completed. More: a pipeline, whose next() tells by completed_rounds which rounds'
  // buffers it may read or reuse.
  virtual int depth() const { return 1; }
  // Called once, by the thread polling the engine (outside its lock), when the operation is
  // over (error null) or failed.
  virtual void finished(std::exception_ptr error) = 0;
  // What it is, for messages: "all_reduce 'grads' over group 'dp'".
  virtual std::string describe() const = 0;

  MPI_Comm comm = MPI_COMM_NULL;
  std::int64_t id = 0;
  // From submit() until finished() is called.
  std::atomic<bool> in_flight{false};
  // Rounds of this submission whose messages have all completed (they complete in the order
  // they were posted); set by the engine before each next(), under its lock.
  int completed_rounds = 0;
};

class MpiProgress final : public rt::IdlePoll {
 public:
  explicit MpiProgress(MpiJob& job);
  ~MpiProgress() override;  // finishes what was submitted, then stops the thread
  MpiProgress(const MpiProgress&) = delete;
  MpiProgress& operator=(const MpiProgress&) = delete;

  // Posts op's first round on the calling thread and returns; polling drives it from then on.
  void submit(std::shared_ptr<MpiOperation> op);
  // Polls on the calling thread until `op` is over (its finished() called or being called) or
  // `budget` has passed; true when over. When not, the engine's thread takes over (so an
  // operation submitted is always driven).
  bool drive(const MpiOperation& op, std::chrono::nanoseconds budget);

  // rt::IdlePoll: any thread may poll; a poll that another thread is making is skipped.
  bool busy() const noexcept override { return in_flight_.load(std::memory_order_seq_cst) > 0; }
  void poll() noexcept override;

 private:
  struct Active;
  using Finished = std::vector<std::pair<std::shared_ptr<MpiOperation>, std::exception_ptr>>;
  void loop();
  void wake();
  // One pass over the operations in flight, under the job's lock (held by the caller): those
  // that ended go to `done`, to be told once the lock is released.
  void pass(Finished& done);
  void start_rounds(Active& a, Finished& done);
  void test(Active& a, Finished& done);
  void fail(Active& a, std::exception_ptr error, Finished& done);
  void check_peers(Finished& done);
  void tell(Finished& done);

  MpiJob& job_;
  std::vector<Active> active_;  // under job_.lock()
  std::set<int> ended_;         // peers found gone (under job_.lock())
  std::atomic<int> in_flight_{0};
  // The engine's thread sleeps on this when nothing is in flight.
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<bool> sleeping_{false};
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace weave::devices::detail
