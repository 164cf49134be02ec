#include "mpi_progress.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <stdexcept>

#include "mpi_job.hpp"
#include "weave/runtime/idle_poll.hpp"

namespace weave::devices::detail {

namespace {

using Clock = std::chrono::steady_clock;

// A message larger than MPI's int count goes as pieces of this size, in order, under one tag.
constexpr std::size_t kPiece = std::size_t{1} << 30;

// While operations are in flight the engine's thread keeps polling, yielding the core between
// polls to any device thread that wants it: MPI moves a large message's fragments only when it
// is polled, so a thread that slept between polls would cut its bandwidth to a fragment per
// nap. With nothing in flight it polls on a little (the next operation is often a few
// microseconds away), then sleeps until a submitter hands an operation over.
constexpr auto kIdleSpin = std::chrono::microseconds(50);
// How often the peers a waiting operation needs are checked for having ended.
constexpr auto kPeerCheck = std::chrono::milliseconds(100);
// How long a shutdown waits for operations still in flight.
constexpr auto kGiveUp = std::chrono::seconds(2);

}  // namespace

// One round's messages as posted.
struct Posted {
  std::vector<MPI_Request> requests;
  std::vector<MPI_Status> statuses;
  std::vector<std::size_t> expected;  // bytes, per request; receives only (sends: SIZE_MAX)
  std::vector<int> peers;             // per request
};

struct MpiProgress::Active {
  std::shared_ptr<MpiOperation> op;
  int round = -1;  // the last round posted
  // The rounds in flight, oldest first (a vector: at most depth() of them, and unlike a deque
  // it allocates nothing until a round is posted).
  std::vector<Posted> posted;
  Posted spare;  // the last one completed, its vectors kept for the next round
  bool over = false;
};

MpiProgress::MpiProgress(MpiJob& job) : job_(job), thread_([this] { loop(); }) {
  rt::set_idle_poll(this);
}

MpiProgress::~MpiProgress() {
  rt::set_idle_poll(nullptr);  // no executor thread polls this engine from here on
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void MpiProgress::submit(std::shared_ptr<MpiOperation> op) {
  op->in_flight.store(true, std::memory_order_seq_cst);
  in_flight_.fetch_add(1, std::memory_order_seq_cst);
  Finished done;
  {
    std::lock_guard lock(job_.lock());
    op->completed_rounds = 0;
    active_.push_back(Active{.op = std::move(op)});
    start_rounds(active_.back(), done);
    if (active_.back().over) active_.pop_back();
  }
  tell(done);
}

bool MpiProgress::drive(const MpiOperation& op, std::chrono::nanoseconds budget) {
  const auto until = Clock::now() + budget;
  for (;;) {
    if (!op.in_flight.load(std::memory_order_acquire)) return true;
    poll();
    if (!op.in_flight.load(std::memory_order_acquire)) return true;
    if (Clock::now() >= until) break;
  }
  wake();
  return false;
}

void MpiProgress::wake() {
  if (!sleeping_.load(std::memory_order_seq_cst)) return;
  std::lock_guard lock(mutex_);
  wake_.notify_one();
}

void MpiProgress::poll() noexcept {
  if (!busy()) return;
  Finished done;
  {
    std::unique_lock lock(job_.lock(), std::try_to_lock);
    if (!lock.owns_lock()) return;  // another thread is polling
    pass(done);
  }
  tell(done);
}

void MpiProgress::tell(Finished& done) {
  for (auto& [op, error] : done) {
    // Over before it is told: what finished() releases may submit the same operation again
    // (the next run of a graph), which must find it no longer in flight.
    op->in_flight.store(false, std::memory_order_release);
    in_flight_.fetch_sub(1, std::memory_order_seq_cst);
    try {
      op->finished(error);
    } catch (...) {
      // Completing a task cannot fail but by running out of memory; the run's watchdog ends
      // a run that lost a completion.
    }
  }
  done.clear();
}

void MpiProgress::pass(Finished& done) {
  // start_rounds may not add operations, so the references stay valid.
  for (Active& a : active_)
    if (!a.over) test(a, done);
  std::erase_if(active_, [](const Active& a) { return a.over; });
}

void MpiProgress::fail(Active& a, std::exception_ptr error, Finished& done) {
  a.over = true;
  // Requests still posted are left to MPI: the job cannot go on after a failed collective.
  a.posted.clear();
  done.emplace_back(a.op, std::move(error));
}

void MpiProgress::start_rounds(Active& a, Finished& done) {
  while (!a.over && static_cast<int>(a.posted.size()) < a.op->depth()) {
    std::optional<MpiRound> round;
    try {
      round = a.op->next();
    } catch (...) {
      fail(a, std::current_exception(), done);
      return;
    }
    if (!round) {
      if (a.posted.empty()) {
        a.over = true;
        done.emplace_back(a.op, nullptr);
      }
      return;  // over, or waiting for a round in flight
    }
    ++a.round;
    if (a.round >= MpiOperation::kRounds) {
      fail(a,
           std::make_exception_ptr(
               std::logic_error(fmt::format("{} needs more than {} rounds of messages",
                                            a.op->describe(), MpiOperation::kRounds))),
           done);
      return;
    }
    // Peers already found gone (check_peers finds the others while the round waits).
    for (const MpiMessage& m : round->receives)
      if (ended_.count(m.peer)) {
        fail(a,
             std::make_exception_ptr(std::runtime_error(
                 fmt::format("{} needs {}, which has ended; the job cannot go on without it",
                             a.op->describe(), job_.describe(m.peer)))),
             done);
        return;
      }
    const long long bound = job_.tag_bound();
    const long long sequence = a.op->id * MpiOperation::kRounds + a.round;
    const int tag = static_cast<int>((sequence % bound + bound) % bound);
    Posted p = std::move(a.spare);
    p.requests.clear();
    p.expected.clear();
    p.peers.clear();
    try {
      // Receives first, so that a peer's message finds its buffer posted.
      for (const MpiMessage& m : round->receives) {
        for (std::size_t at = 0; at == 0 || at < m.bytes; at += kPiece) {
          const std::size_t n = std::min(kPiece, m.bytes - at);
          MPI_Request r;
          MpiJob::check(MPI_Irecv(static_cast<char*>(m.data) + at, static_cast<int>(n), MPI_BYTE,
                                  m.peer, tag, a.op->comm, &r),
                        "MPI_Irecv");
          p.requests.push_back(r);
          p.expected.push_back(n);
          p.peers.push_back(m.peer);
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
          p.requests.push_back(r);
          p.expected.push_back(SIZE_MAX);
          p.peers.push_back(m.peer);
          if (m.bytes == 0) break;
        }
      }
    } catch (...) {
      fail(a, std::current_exception(), done);
      return;
    }
    if (p.requests.empty() && a.posted.empty()) {
      // A round with no messages (a process with nothing to exchange) is over at once; after
      // rounds still in flight, once they are (test() finds it complete then).
      ++a.op->completed_rounds;
      continue;
    }
    p.statuses.resize(p.requests.size());
    a.posted.push_back(std::move(p));
  }
}

void MpiProgress::test(Active& a, Finished& done) {
  // The oldest round first: rounds complete in the order they were posted.
  while (!a.over && !a.posted.empty()) {
    Posted& p = a.posted.front();
    int complete = 0;
    std::vector<MPI_Status>& statuses = p.statuses;
    const int code = MPI_Testall(static_cast<int>(p.requests.size()), p.requests.data(), &complete,
                                 statuses.data());
    if (code != MPI_SUCCESS) {
      // Name the peer whose request failed, when MPI says which.
      std::string peer = "a peer";
      int error = code;
      for (std::size_t i = 0; i < statuses.size(); ++i)
        if (code == MPI_ERR_IN_STATUS && statuses[i].MPI_ERROR != MPI_SUCCESS &&
            statuses[i].MPI_ERROR != MPI_ERR_PENDING) {
          peer = job_.describe(p.peers[i]);
          error = statuses[i].MPI_ERROR;
          break;
        }
      char text[MPI_MAX_ERROR_STRING];
      int length = 0;
      MPI_Error_string(error, text, &length);
      fail(a,
           std::make_exception_ptr(std::runtime_error(
               fmt::format("{}: the transfer with {} failed: {}", a.op->describe(), peer,
                           std::string(text, static_cast<std::size_t>(length))))),
           done);
      return;
    }
    if (!complete) return;
    for (std::size_t i = 0; i < statuses.size(); ++i) {
      if (p.expected[i] == SIZE_MAX) continue;
      int count = 0;
      MPI_Get_count(&statuses[i], MPI_BYTE, &count);
      if (static_cast<std::size_t>(count) != p.expected[i]) {
        fail(a,
             std::make_exception_ptr(std::runtime_error(fmt::format(
                 "{}: {} sent {} bytes where this process expected {}; every process must "
                 "issue the collective with the same sizes",
                 a.op->describe(), job_.describe(p.peers[i]), count, p.expected[i]))),
             done);
        return;
      }
    }
    a.spare = std::move(a.posted.front());
    a.posted.erase(a.posted.begin());
    ++a.op->completed_rounds;
    start_rounds(a, done);
  }
}

void MpiProgress::check_peers(Finished& done) {
  for (Active& a : active_) {
    if (a.over) continue;
    std::optional<int> gone;
    for (const Posted& p : a.posted)
      for (int peer : p.peers)
        if (!gone && (ended_.count(peer) || job_.has_ended(peer))) gone = peer;
    if (!gone) continue;
    ended_.insert(*gone);
    job_.mark_failed();
    fail(a,
         std::make_exception_ptr(std::runtime_error(
             fmt::format("{} has ended while this process waited for it in {}; stopping: the job "
                         "cannot go on without it",
                         job_.describe(*gone), a.op->describe()))),
         done);
  }
  std::erase_if(active_, [](const Active& a) { return a.over; });
}

void MpiProgress::loop() {
  auto last_check = Clock::now();
  std::optional<Clock::time_point> stopping;
  Finished done;
  for (;;) {
    if (busy()) {
      poll();
      const auto now = Clock::now();
      if (now - last_check > kPeerCheck) {
        last_check = now;
        {
          std::lock_guard lock(job_.lock());
          check_peers(done);
          if (!stopping) {
            std::lock_guard guard(mutex_);
            if (stop_) stopping = now;
          }
          if (stopping && now - *stopping > kGiveUp) {
            // Destroyed with operations whose peers never answered: fail them rather than hang.
            for (Active& a : active_)
              if (!a.over)
                fail(a,
                     std::make_exception_ptr(std::runtime_error(
                         fmt::format("{} was still waiting for its peers when MPI was shut down",
                                     a.op->describe()))),
                     done);
            active_.clear();
          }
        }
        tell(done);
      }
      std::this_thread::yield();
      continue;
    }
    // Nothing in flight: poll on a little for the next operation, then sleep.
    const auto idle_since = Clock::now();
    while (!busy() && Clock::now() - idle_since < kIdleSpin)
      std::this_thread::yield();
    if (busy()) continue;
    std::unique_lock lock(mutex_);
    sleeping_.store(true, std::memory_order_seq_cst);
    wake_.wait(lock, [&] { return stop_ || busy(); });
    sleeping_.store(false, std::memory_order_seq_cst);
    if (stop_ && !busy()) return;
    last_check = Clock::now();
  }
}

}  // namespace weave::devices::detail
