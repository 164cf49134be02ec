// This process's membership in an MPI job (mpirun -np P): MPI initialised once with the thread
// level the progress thread needs, MPI's error handler replaced by error codes that become
// weave's exceptions, and what the processes know of each other (host, pid, which ones share a
// host, the clocks' offsets). One per process, kept until exit.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace weave::devices::detail {

class MpiProgress;

struct MpiPeer {
  std::string host;
  long pid = 0;
};

class MpiJob {
 public:
  // Initialises MPI the first time (MPI_Init_thread asking MPI_THREAD_MULTIPLE; at least
  // MPI_THREAD_SERIALIZED is needed, or std::runtime_error names the level MPI gives). A program
  // that initialised MPI itself keeps it (then it must have asked for that level too).
  static std::shared_ptr<MpiJob> join();
  ~MpiJob();
  MpiJob(const MpiJob&) = delete;
  MpiJob& operator=(const MpiJob&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // This process among those on its host (by rank), and how many share the host.
  int local_index() const { return local_index_; }
  int local_count() const { return local_count_; }
  const std::vector<MpiPeer>& peers() const { return peers_; }
  // "process 3 (pid 1234 on node7)"
  std::string describe(int process) const;
  std::int64_t clock_offset() const { return clock_offset_; }
  int tag_bound() const { return tag_bound_; }  // tags are in [0, tag_bound())

  // The communicators: collectives of graphs, and the host threads' exchanges between steps.
  MPI_Comm collectives() const { return collectives_; }
  MPI_Comm host() const { return host_; }
  // Every MPI call is made under this lock (MPI_THREAD_SERIALIZED is enough).
  std::mutex& lock() { return lock_; }
  MpiProgress& progress() { return *progress_; }

  // Throws std::runtime_error "<what> failed: <MPI's error text>" unless code is MPI_SUCCESS.
  static void check(int code, std::string_view what);
  // Whether process p is known to have ended: it shares this host and its pid is gone (a
  // process on another host is reported by MPI itself when its connection breaks).
  bool has_ended(int process) const;
  // A failure after which MPI_Finalize would wait for processes that are gone: the job is left
  // without finalising.
  void mark_failed() { failed_ = true; }

 private:
  MpiJob();
  int rank_ = 0, size_ = 1, local_index_ = 0, local_count_ = 1, tag_bound_ = 32768;
  bool initialised_here_ = false;
  bool failed_ = false;
  std::vector<MpiPeer> peers_;
  std::int64_t clock_offset_ = 0;
  MPI_Comm collectives_ = MPI_COMM_NULL, host_ = MPI_COMM_NULL;
  std::mutex lock_;
  std::unique_ptr<MpiProgress> progress_;
};

}  // namespace weave::devices::detail
