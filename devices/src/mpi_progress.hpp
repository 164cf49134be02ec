// The thread that moves a process's MPI traffic: operations (a collective's part in this
// process, a host exchange) are handed to it as rounds of non-blocking sends and receives,
// which it posts, polls and follows with the operation's next round, so no device's worker
// thread ever waits on MPI. It also watches the peers an operation waits for: one that has
// ended fails the operation at once, naming it, instead of leaving the job to hang.
#pragma once

#include <mpi.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

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
  static constexpr int kRounds = 4;

  virtual ~MpiOperation() = default;
  // The next round: called on the progress thread, first when the operation is submitted and
  // then each time the previous round has completed. std::nullopt: the operation is over. May
  // throw: the operation fails with that error.
  virtual std::optional<MpiRound> next() = 0;
  // Called once, on the progress thread, when the operation is over (error null) or failed.
  virtual void finished(std::exception_ptr error) = 0;
  // What it is, for messages: "all_reduce 'grads' over group 'dp'".
  virtual std::string describe() const = 0;

  MPI_Comm comm = MPI_COMM_NULL;
  std::int64_t id = 0;
};

class MpiProgress {
 public:
  explicit MpiProgress(MpiJob& job);
  ~MpiProgress();  // finishes what was submitted, then stops the thread
  MpiProgress(const MpiProgress&) = delete;
  MpiProgress& operator=(const MpiProgress&) = delete;

  // Runs `op` on the progress thread; returns at once.
  void submit(std::shared_ptr<MpiOperation> op);

 private:
  struct Active;
  void loop();
  bool start_round(Active& a);
  bool poll(Active& a);
  void fail(Active& a, std::exception_ptr error);
  void check_peers(std::vector<Active>& active);

  MpiJob& job_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<MpiOperation>> queue_;
  bool stop_ = false;
  std::set<int> ended_;  // peers found gone (progress thread only)
  std::thread thread_;
};

}  // namespace weave::devices::detail
