// A collective whose members sit in several processes, as this process runs its part. The
// members held here meet in shared memory (the rendezvous starts them together, so their
// buffers are ready); the first of them to run hands the process's part to the progress thread,
// which packs the local members' data into one message per peer process, exchanges it,
// reduces or unpacks, and completes every local member's deferred task. Reductions fold the
// members in rank order, exactly as the shared-memory backend does, so a run across processes
// is bitwise the run in one process.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "mpi_progress.hpp"
#include "weave/devices/collective.hpp"

namespace weave::devices::detail {

class MpiJob;

class SpanningCollective : public MpiOperation,
                           public std::enable_shared_from_this<SpanningCollective> {
 public:
  // `process_of_member`: the MPI rank holding each member of c's group. Checks the sizes of
  // the local members' buffers against each other (std::invalid_argument); the other processes
  // check theirs, and a size that differs between processes fails the run when the messages
  // meet.
  static std::shared_ptr<SpanningCollective> make(const Collective& c, MpiJob& job,
                                                  std::vector<int> process_of_member);

  // What each local member's task does: defer its completion and, for the first of them in a
  // run, submit the process's part.
  MemberWork work();
  // The id every process gives this collective (from Communicator::commit); until it is set,
  // running the collective fails.
  void commit(std::int64_t collective_id);

  void finished(std::exception_ptr error) override;
  std::string describe() const override;

 protected:
  SpanningCollective(const Collective& c, MpiJob& job, std::vector<int> process_of_member);
  // Starts a run: the op's state machine back to its first round.
  virtual void restart() = 0;

  bool is_local(int member) const { return process_of_[member] == me_; }
  // Index of process `p` among the group's processes.
  int process_index(int p) const;

  Collective c_;
  MpiJob& job_;
  int n_ = 0, me_ = 0;
  std::vector<int> process_of_;               // by member
  std::vector<int> processes_;                // the group's, ascending
  std::vector<std::vector<int>> members_of_;  // by process index: its members, ascending
  std::vector<int> slot_;                     // by member: its place among its process's
  std::vector<int> local_;                    // members held here, ascending
  std::vector<int> others_;                   // the other processes, ascending

 private:
  void arrive(rt::TaskContext& context);
  bool committed_ = false;
  std::mutex mutex_;
  std::uint64_t run_ = UINT64_MAX;
  bool submitted_ = false, over_ = false;
  std::exception_ptr error_;
  std::vector<rt::Completion> waiting_;
};

// The variable-size all-gather and reduce-scatter (mpi_variable_collectives.cpp).
std::shared_ptr<SpanningCollective> make_spanning_all_gather_v(const Collective& c, MpiJob& job,
                                                               std::vector<int> process_of);
std::shared_ptr<SpanningCollective> make_spanning_reduce_scatter_v(const Collective& c, MpiJob& job,
                                                                   std::vector<int> process_of);

}  // namespace weave::devices::detail
