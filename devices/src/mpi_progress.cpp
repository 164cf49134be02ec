#include "mpi_progress.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <stdexcept>

#include "mpi_job.hpp"

namespace weave::devices::detail {

namespace {

using Clock = std::chrono::steady_clock;

// A message larger than MPI's int count goes as pieces of this size, in order, under one tag.
constexpr std::size_t kPiece = std::size_t{1} << 30;

// While operations are in flight the thread keeps polling, yielding the core between polls to
// any device thread that wants it: MPI moves a large message's fragments only when it is
// polled, so a thread that slept between polls would cut its bandwidth to a fragment per nap.
// With nothing in flight it sleeps until an operation is submitted.
// How often the peers a waiting operation needs are checked for having ended.
constexpr auto kPeerCheck = std::chrono::milliseconds(100);
// How long a shutdown waits for operations still in flight.
constexpr auto kGiveUp = std::chrono::seconds(2);

}  // namespace

struct MpiProgress::Active {
  std::shared_ptr<MpiOperation> op;
  int round = -1;
  std::vector<MPI_Request> requests;
  std::vector<std::size_t> expected;  // bytes, per request; receives only (sends: SIZE_MAX)
  std::vector<int> peers;             // per request
  bool over = false;
};

MpiProgress::MpiProgress(MpiJob& job) : job_(job), thread_([this] { loop(); }) {}

MpiProgress::~MpiProgress() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void MpiProgress::submit(std::shared_ptr<MpiOperation> op) {
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(op));
  }
  wake_.notify_all();
}

void MpiProgress::fail(Active& a, std::exception_ptr error) {
  a.over = true;
  // Requests still posted are left to MPI: the job cannot go on after a failed collective.
  a.requests.clear();
  a.op->finished(std::move(error));
}

bool MpiProgress::start_round(Active& a) {
  for (;;) {
    std::optional<MpiRound> round;
    try {
      round = a.op->next();
    } catch (...) {
      fail(a, std::current_exception());
      return true;
    }
    if (!round) {
      a.over = true;
      a.op->finished(nullptr);
      return true;
    }
    ++a.round;
    if (a.round >= MpiOperation::kRounds) {
      fail(a, std::make_exception_ptr(
                  std::logic_error(fmt::format("{} needs more than {} rounds of messages",
                                               a.op->describe(), MpiOperation::kRounds))));
      return true;
    }
    a.requests.clear();
    a.expected.clear();
    a.peers.clear();
    for (const MpiMessage& m : round->receives)
      if (ended_.count(m.peer) || job_.has_ended(m.peer)) {
        ended_.insert(m.peer);
        fail(a, std::make_exception_ptr(std::runtime_error(
                    fmt::format("{} needs {}, which has ended; the job cannot go on without it",
                                a.op->describe(), job_.describe(m.peer)))));
        return true;
      }
    const long long bound = job_.tag_bound();
    const long long sequence = a.op->id * MpiOperation::kRounds + a.round;
    const int tag = static_cast<int>((sequence % bound + bound) % bound);
    std::lock_guard lock(job_.lock());
    try {
      // Receives first, so that a peer's message finds its buffer posted.
      for (const MpiMessage& m : round->receives) {
        for (std::size_t at = 0; at == 0 || at < m.bytes; at += kPiece) {
          const std::size_t n = std::min(kPiece, m.bytes - at);
          MPI_Request r;
          MpiJob::check(MPI_Irecv(static_cast<char*>(m.data) + at, static_cast<int>(n), MPI_BYTE,
                                  m.peer, tag, a.op->comm, &r),
                        "MPI_Irecv");
          a.requests.push_back(r);
          a.expected.push_back(n);
          a.peers.push_back(m.peer);
          if (m.bytes == 0) break;
        }
      }
      for (const MpiMessage& m : round->sends) {
        for (std::size_t at = 0; at == 0 || at < m.bytes; at += kPiece) {
          const std::size_t n = std::min(kPiece, m.bytes - at);
          MPI_Request r;
          MpiJob::check(MPI_Isend(static_cast<char*>(m.data) + at, static_cast<int>(n), MPI_BYTE,
                                  m.peer, tag, a.op->comm, &r),
                        "MPI_Isend");
          a.requests.push_back(r);
          a.expected.push_back(SIZE_MAX);
          a.peers.push_back(m.peer);
          if (m.bytes == 0) break;
        }
      }
    } catch (...) {
      fail(a, std::current_exception());
      return true;
    }
    if (!a.requests.empty()) return false;
    // A round with no messages (a process with nothing to exchange): go straight on.
  }
}

bool MpiProgress::poll(Active& a) {
  int done = 0;
  std::vector<MPI_Status> statuses(a.requests.size());
  int code;
  {
    std::lock_guard lock(job_.lock());
    code =
        MPI_Testall(static_cast<int>(a.requests.size()), a.requests.data(), &done, statuses.data());
  }
  if (code != MPI_SUCCESS) {
    // Name the peer whose request failed, when MPI says which.
    std::string peer = "a peer";
    int error = code;
    for (std::size_t i = 0; i < statuses.size(); ++i)
      if (code == MPI_ERR_IN_STATUS && statuses[i].MPI_ERROR != MPI_SUCCESS &&
          statuses[i].MPI_ERROR != MPI_ERR_PENDING) {
        peer = job_.describe(a.peers[i]);
        error = statuses[i].MPI_ERROR;
        break;
      }
    char text[MPI_MAX_ERROR_STRING];
    int length = 0;
    MPI_Error_string(error, text, &length);
    fail(a, std::make_exception_ptr(std::runtime_error(
                fmt::format("{}: the transfer with {} failed: {}", a.op->describe(), peer,
                            std::string(text, static_cast<std::size_t>(length))))));
    return true;
  }
  if (!done) return false;
  for (std::size_t i = 0; i < statuses.size(); ++i) {
    if (a.expected[i] == SIZE_MAX) continue;
    int count = 0;
    MPI_Get_count(&statuses[i], MPI_BYTE, &count);
    if (static_cast<std::size_t>(count) != a.expected[i]) {
      fail(a, std::make_exception_ptr(std::runtime_error(fmt::format(
                  "{}: {} sent {} bytes where this process expected {}; every process must "
                  "issue the collective with the same sizes",
                  a.op->describe(), job_.describe(a.peers[i]), count, a.expected[i]))));
      return true;
    }
  }
  start_round(a);
  return true;
}

void MpiProgress::check_peers(std::vector<Active>& active) {
  for (Active& a : active) {
    if (a.over) continue;
    for (int peer : a.peers) {
      if (!ended_.count(peer) && !job_.has_ended(peer)) continue;
      ended_.insert(peer);
      job_.mark_failed();
      fail(a, std::make_exception_ptr(std::runtime_error(fmt::format(
                  "{} has ended while this process waited for it in {}; stopping: the job "
                  "cannot go on without it",
                  job_.describe(peer), a.op->describe()))));
      break;
    }
  }
}

void MpiProgress::loop() {
  std::vector<Active> active;
  auto last_check = Clock::now();
  std::optional<Clock::time_point> stopping;
  for (;;) {
    std::deque<std::shared_ptr<MpiOperation>> incoming;
    {
      std::unique_lock lock(mutex_);
      if (stop_ && !stopping) stopping = Clock::now();
      if (active.empty()) {
        wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopped with nothing left
      }
      incoming.swap(queue_);
    }
    bool moved = !incoming.empty();
    for (auto& op : incoming) {
      active.push_back(Active{.op = std::move(op)});
      start_round(active.back());
    }
    for (Active& a : active)
      if (!a.over && poll(a)) moved = true;
    std::erase_if(active, [](const Active& a) { return a.over; });
    const auto now = Clock::now();
    if (moved) {
      last_check = now;
      continue;
    }
    if (stopping && now - *stopping > kGiveUp) {
      // Destroyed with operations whose peers never answered: fail them rather than hang.
      for (Active& a : active)
        if (!a.over)
          fail(
              a,
              std::make_exception_ptr(std::runtime_error(fmt::format(
                  "{} was still waiting for its peers when MPI was shut down", a.op->describe()))));
      return;
    }
    if (now - last_check > kPeerCheck) {
      last_check = now;
      check_peers(active);
      std::erase_if(active, [](const Active& a) { return a.over; });
    }
    std::this_thread::yield();
  }
}

}  // namespace weave::devices::detail
