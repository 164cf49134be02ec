#include "mpi_job.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <limits>
#include <stdexcept>

#include "mpi_progress.hpp"

namespace weave::devices::detail {

namespace {

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE:
      return "MPI_THREAD_MULTIPLE";
  }
  return fmt::format("thread level {}", level);
}

// A process on this host has ended once its pid is gone or left as a zombie for its parent
// (mpirun's daemon) to reap.
bool pid_ended(long pid) {
  std::ifstream stat(fmt::format("/proc/{}/stat", pid));
  if (!stat) return true;
  std::string line;
  std::getline(stat, line);
  const auto close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return false;
  const char state = line[close + 2];
  return state == 'Z' || state == 'X';
}

}  // namespace

void MpiJob::check(int code, std::string_view what) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw std::runtime_error(
      fmt::format("{} failed: {}", what, std::string(text, static_cast<std::size_t>(length))));
}

std::shared_ptr<MpiJob> MpiJob::join() {
  // One per process, until exit: MPI can be initialised only once.
  static std::shared_ptr<MpiJob> job(new MpiJob());
  return job;
}

MpiJob::MpiJob() {
  int initialised = 0, provided = MPI_THREAD_SINGLE;
  MPI_Initialized(&initialised);
  if (!initialised) {
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS)
      throw std::runtime_error("MPI_Init_thread failed: this process could not join the MPI job");
    initialised_here_ = true;
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_SERIALIZED)
    throw std::runtime_error(fmt::format(
        "MPI gives {} and weave needs MPI_THREAD_SERIALIZED at least: its progress thread makes "
        "the MPI calls while the devices compute. Use an MPI built with thread support (Debian's "
        "Open MPI is), or initialise MPI with MPI_Init_thread asking MPI_THREAD_MULTIPLE",
        level_name(provided)));
  // Errors come back as codes that become weave's exceptions, naming the collective and peer,
  // instead of MPI's default handler aborting the job with its own message.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
  check(MPI_Comm_dup(MPI_COMM_WORLD, &collectives_), "MPI_Comm_dup");
  check(MPI_Comm_dup(MPI_COMM_WORLD, &host_), "MPI_Comm_dup");
  MPI_Comm_set_errhandler(collectives_, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(host_, MPI_ERRORS_RETURN);
  void* bound = nullptr;
  int found = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &bound, &found);
  if (found && bound) tag_bound_ = *static_cast<int*>(bound);

  // Every process's host and pid.
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int length = 0;
  MPI_Get_processor_name(name, &length);
  std::vector<char> names(static_cast<std::size_t>(size_) * MPI_MAX_PROCESSOR_NAME);
  check(MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, names.data(), MPI_MAX_PROCESSOR_NAME,
                      MPI_CHAR, host_),
        "MPI_Allgather of host names");
  long pid = static_cast<long>(getpid());
  std::vector<long> pids(static_cast<std::size_t>(size_));
  check(MPI_Allgather(&pid, 1, MPI_LONG, pids.data(), 1, MPI_LONG, host_),
        "MPI_Allgather of process ids");
  for (int p = 0; p < size_; ++p) {
    const char* n = names.data() + static_cast<std::size_t>(p) * MPI_MAX_PROCESSOR_NAME;
    peers_.push_back({std::string(n, strnlen(n, MPI_MAX_PROCESSOR_NAME)), pids[p]});
  }
  local_index_ = 0;
  local_count_ = 0;
  for (int p = 0; p < size_; ++p) {
    if (peers_[p].host != peers_[rank_].host) continue;
    if (p < rank_) ++local_index_;
    ++local_count_;
  }

  // Clock offsets against process 0: each process in turn exchanges a few pings with it and
  // keeps the estimate of the fastest round trip (its error is at most half that trip).
  constexpr int kPings = 8;
  for (int p = 1; p < size_; ++p) {
    if (rank_ == 0) {
      for (int i = 0; i < kPings; ++i) {
        char ping = 0;
        check(MPI_Recv(&ping, 1, MPI_CHAR, p, 0, host_, MPI_STATUS_IGNORE), "clock ping");
        const std::int64_t t = now_ns();
        check(MPI_Send(&t, 1, MPI_INT64_T, p, 0, host_), "clock reply");
      }
    } else if (rank_ == p) {
      std::int64_t best_trip = std::numeric_limits<std::int64_t>::max();
      for (int i = 0; i < kPings; ++i) {
        char ping = 0;
        const std::int64_t sent = now_ns();
        check(MPI_Send(&ping, 1, MPI_CHAR, 0, 0, host_), "clock ping");
        std::int64_t remote = 0;
        check(MPI_Recv(&remote, 1, MPI_INT64_T, 0, 0, host_, MPI_STATUS_IGNORE), "clock reply");
        const std::int64_t back = now_ns();
        if (back - sent < best_trip) {
          best_trip = back - sent;
          clock_offset_ = (sent + back) / 2 - remote;
        }
      }
    }
  }
  progress_ = std::make_unique<MpiProgress>(*this);
}

MpiJob::~MpiJob() {
  progress_.reset();
  if (failed_) return;  // finalising would wait for processes that are gone
  int finalised = 0;
  MPI_Finalized(&finalised);
  if (finalised) return;
  MPI_Comm_free(&collectives_);
  MPI_Comm_free(&host_);
  if (initialised_here_) MPI_Finalize();
}

std::string MpiJob::describe(int process) const {
  if (process < 0 || process >= size_) return fmt::format("process {}", process);
  const MpiPeer& p = peers_[static_cast<std::size_t>(process)];
  return fmt::format("process {} (pid {} on {})", process, p.pid, p.host);
}

bool MpiJob::has_ended(int process) const {
  if (process < 0 || process >= size_ || process == rank_) return false;
  const MpiPeer& p = peers_[static_cast<std::size_t>(process)];
  if (p.host != peers_[static_cast<std::size_t>(rank_)].host) return false;
  return pid_ended(p.pid);
}

}  // namespace weave::devices::detail
