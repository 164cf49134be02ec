#include "mpi_collectives.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "collective_kernels.hpp"
#include "collective_ops.hpp"
#include "mpi_job.hpp"

namespace weave::devices::detail {

namespace {

// How long the task that posts a collective's messages polls for them before it returns.
constexpr auto kPollInTask = std::chrono::microseconds(10);

// An all-reduce of at most this many bytes exchanges whole buffers in one round; between 2
// processes, up to the larger bound (the same bytes as the shares in one message each way, but
// twice the folding, which past it costs more than the second round saves).
constexpr std::size_t kWholeExchangeBytes = std::size_t{64} << 10;
constexpr std::size_t kWholeExchangeBytesOfTwo = std::size_t{256} << 10;

// Past those, an all-reduce goes by segments of this many bytes, kPipeline rounds of them in
// flight at once (bench/mpi_collectives_bench between 2 processes: at 2 MiB, segments of 128 or
// 256 KiB took about 400 us where whole shares took 450 and 1 MiB segments no less; with one
// round in flight, 8 MiB took longer than with two).
constexpr std::size_t kSegmentBytes = std::size_t{256} << 10;
constexpr int kPipeline = 2;

constexpr std::size_t bytes_of(std::size_t elements) {
  return elements * sizeof(float);
}

// Shares are whole cache lines, as in shared memory: [first, last) of `count` elements that
// process index i of k reduces.
constexpr std::size_t kLineElements = 64 / sizeof(float);
std::pair<std::size_t, std::size_t> share(std::size_t count, int k, int i) {
  const std::size_t lines = (count + kLineElements - 1) / kLineElements;
  const auto uk = static_cast<std::size_t>(k), ui = static_cast<std::size_t>(i);
  const std::size_t base = lines / uk, extra = lines % uk;
  const std::size_t first = (ui * base + std::min(ui, extra)) * kLineElements;
  const std::size_t last = first + (base + (ui < extra ? 1 : 0)) * kLineElements;
  return {std::min(first, count), std::min(last, count)};
}

MpiMessage message(int peer, const float* data, std::size_t elements) {
  return {peer, const_cast<float*>(data), bytes_of(elements)};
}

}  // namespace

SpanningCollective::SpanningCollective(const Collective& c, MpiJob& job,
                                       std::vector<int> process_of_member)
    : c_(c),
      job_(job),
      n_(c.group.size()),
      me_(job.rank()),
      process_of_(std::move(process_of_member)) {
  comm = job.collectives();
  processes_ = process_of_;
  std::sort(processes_.begin(), processes_.end());
  processes_.erase(std::unique(processes_.begin(), processes_.end()), processes_.end());
  members_of_.resize(processes_.size());
  slot_.resize(static_cast<std::size_t>(n_));
  for (int m = 0; m < n_; ++m) {
    auto& list = members_of_[static_cast<std::size_t>(process_index(process_of_[m]))];
    slot_[m] = static_cast<int>(list.size());
    list.push_back(m);
    if (process_of_[m] == me_) local_.push_back(m);
  }
  for (int p : processes_)
    if (p != me_) others_.push_back(p);
}

int SpanningCollective::process_index(int p) const {
  return static_cast<int>(std::lower_bound(processes_.begin(), processes_.end(), p) -
                          processes_.begin());
}

std::string SpanningCollective::describe() const {
  return fmt::format("{} '{}' over group '{}'", to_string(c_.call.op), c_.name, c_.group.name());
}

void SpanningCollective::commit(std::int64_t collective_id) {
  id = collective_id;
  committed_ = true;
}

MemberWork SpanningCollective::work() {
  auto self = shared_from_this();
  return [self](int, rt::TaskContext& context) { self->arrive(context); };
}

void SpanningCollective::arrive(rt::TaskContext& context) {
  if (context.virtual_time())
    throw std::logic_error(fmt::format(
        "{} spans processes and the virtual clock replays one process's graph: replay the whole "
        "step in one process (the in-process backend) instead",
        describe()));
  if (!committed_)
    throw std::logic_error(fmt::format(
        "{} was planned but never committed: every process must call CollectiveMatcher::finish() "
        "or Communicator::commit() once its graph's collectives are issued, before running it",
        describe()));
  rt::Completion done = context.defer();
  bool submit = false, over = false;
  std::exception_ptr error;
  {
    std::lock_guard lock(mutex_);
    if (run_ != context.run_index()) {
      run_ = context.run_index();
      submitted_ = over_ = false;
      error_ = nullptr;
      waiting_.clear();
    }
    if (over_) {
      over = true;
      error = error_;
    } else {
      waiting_.push_back(std::move(done));
      if (!submitted_) submitted_ = submit = true;
    }
  }
  if (over) {
    if (error)
      done.fail(error);
    else
      done.complete();
    return;
  }
  if (submit) {
    // Every local member has arrived (the rendezvous), so their buffers are ready. This thread
    // posts the process's messages and polls a moment: peers that are ready answer within
    // microseconds, and the collective then completes here without waking any thread. Past
    // that the device's thread goes on with its other work, polling between tasks and while
    // idle, and the engine's thread polls too.
    restart();
    MpiProgress& progress = job_.progress();
    progress.submit(shared_from_this());
    progress.drive(*this, kPollInTask);
  }
}

void SpanningCollective::finished(std::exception_ptr error) {
  std::vector<rt::Completion> waiting;
  {
    std::lock_guard lock(mutex_);
    over_ = true;
    error_ = error;
    waiting.swap(waiting_);
  }
  for (rt::Completion& c : waiting) {
    if (error)
      c.fail(error);
    else
      c.complete();
  }
}

namespace {

// Every local member's buffer chosen by `pick` must hold `expected` elements.
template <typename Pick>
void check_local_sizes(const Collective& c, const std::vector<int>& local, Pick pick,
                       std::size_t expected, const char* what, const std::string& rule) {
  for (int r : local) {
    const std::size_t size = pick(c.members[static_cast<std::size_t>(r)]).size();
    if (size != expected)
      throw std::invalid_argument(fmt::format(
          "{} over group '{}': rank {} (device {}) has an {} of {} elements where {} "
          "are needed ({}); size every rank's buffers alike",
          to_string(c.call.op), c.group.name(), r, c.group.device(r), what, size, expected, rule));
  }
}

// ------------------------------------------------------------------------------- all-reduce
// Each process reduces one share of the elements from every member's buffer, in rank order,
// then the shares are gathered: the ring's volume, with the reduction order of one process.
class SpanningAllReduce final : public SpanningCollective {
 public:
  SpanningAllReduce(const Collective& c, MpiJob& job, std::vector<int> process_of)
      : SpanningCollective(c, job, std::move(process_of)) {
    count_ = c.members[static_cast<std::size_t>(local_.front())].output.size();
    check_local_sizes(
        c, local_, [](const CollectiveMember& m) { return m.output; }, count_,
        "input/output buffer",
        fmt::format("every rank reduces a buffer of the same size, {} elements", count_));
    whole_ = bytes_of(count_) <=
             (processes_.size() == 2 ? kWholeExchangeBytesOfTwo : kWholeExchangeBytes);
    if (!whole_) {
      // Segments of kSegmentBytes, fewer and larger when there would be more than the rounds
      // allow (whole cache lines, so that every share starts on a line).
      const std::size_t most = MpiOperation::kRounds - kPipeline;
      std::size_t elements = std::max(kSegmentBytes / sizeof(float), (count_ + most - 1) / most);
      elements = (elements + kLineElements - 1) / kLineElements * kLineElements;
      segment_elements_ = elements;
      segments_ = static_cast<int>((count_ + elements - 1) / elements);
      pipeline_ = std::min(kPipeline, segments_);
    }
  }

 private:
  void restart() override { stage_ = posted_ = folded_ = spread_ = 0; }
  float* buffer(int member) const {
    return c_.members[static_cast<std::size_t>(member)].output.data();
  }
  std::optional<MpiRound> next() override { return whole_ ? next_whole() : next_segmented(); }

  // One round, every process sending its members' whole buffers to every other and each
  // folding all of them. For 2 processes it moves as many bytes as the shares do, in one
  // message each way instead of two; for more, (P - 1) buffers each, so small ones only.
  std::optional<MpiRound> next_whole() {
    const std::size_t kl = local_.size();
    if (stage_++ > 0) {
      std::vector<const float*> sources;
      for (int r = 0; r < n_; ++r) {
        if (is_local(r)) {
          sources.push_back(buffer(r));
        } else {
          const auto o = static_cast<std::size_t>(
              std::lower_bound(others_.begin(), others_.end(), process_of_[r]) - others_.begin());
          sources.push_back(received_whole_[o].data() +
                            static_cast<std::size_t>(slot_[r]) * count_);
        }
      }
      std::vector<float*> targets;
      for (int r : local_)
        targets.push_back(buffer(r));
      reduce_to_all(c_.call.reduce, sources, 0, targets, 0, count_, false);
      return std::nullopt;
    }
    MpiRound round;
    const float* mine = buffer(local_.front());
    if (kl > 1) {  // the local members' buffers side by side, in rank order
      packed_whole_.resize(1);
      packed_whole_[0].resize(kl * count_);
      for (std::size_t i = 0; i < kl; ++i)
        std::copy_n(buffer(local_[i]), count_,
                    packed_whole_[0].begin() + static_cast<std::ptrdiff_t>(i * count_));
      mine = packed_whole_[0].data();
    }
    received_whole_.resize(others_.size());
    for (std::size_t o = 0; o < others_.size(); ++o) {
      const int q = others_[o];
      round.sends.push_back(message(q, mine, kl * count_));
      received_whole_[o].resize(members_of_[static_cast<std::size_t>(process_index(q))].size() *
                                count_);
      round.receives.push_back(message(q, received_whole_[o].data(), received_whole_[o].size()));
    }
    return round;
  }

  // Larger buffers go by segments, each reduced and gathered like a whole buffer of its
  // size (every process folds its share of the segment over all the members, in rank order,
  // then the shares are gathered), pipelined: round t carries the reduce-scatter messages of
  // segment t and the all-gather messages of segment t - depth, and depth rounds are in flight
  // at once. A process folds a segment as soon as its pieces are in, while the next segments'
  // pieces are on their way, and sends the result while it is still in cache; what it receives
  // per segment fits in the core's cache, where the whole buffer's share does not.
  int depth() const override { return pipeline_; }

  std::optional<MpiRound> next_segmented() {
    const int done = completed_rounds, segments = segments_, lag = pipeline_;
    while (folded_ < segments && folded_ < done)
      fold(folded_++);
    while (spread_ < segments && spread_ + lag < done)
      spread(spread_++);
    if (posted_ == segments + lag || posted_ - lag >= done) return std::nullopt;
    const int t = posted_++;
    MpiRound round;
    if (t < segments) scatter(t, round);
    if (t >= lag && t - lag < segments) gather(t - lag, round);
    return round;
  }

  // Segment s: [first, last) of the buffer.
  std::pair<std::size_t, std::size_t> segment(int s) const {
    const std::size_t first = static_cast<std::size_t>(s) * segment_elements_;
    return {first, std::min(count_, first + segment_elements_)};
  }
  // Process index i's share of segment s, in elements of the buffer.
  std::pair<std::size_t, std::size_t> share_of(int s, int i) const {
    const auto [first, last] = segment(s);
    const auto [f, l] = share(last - first, static_cast<int>(processes_.size()), i);
    return {first + f, first + l};
  }
  std::size_t other_index(int process) const {
    return static_cast<std::size_t>(std::lower_bound(others_.begin(), others_.end(), process) -
                                    others_.begin());
  }

  // Every local member's piece of each other process's share of segment s goes to that
  // process; the members' pieces of this process's share come in.
  void scatter(int s, MpiRound& round) {
    const auto [first, last] = share_of(s, process_index(me_));
    const std::size_t kl = local_.size();
    auto& packed = packed_[static_cast<std::size_t>(s % pipeline_)];
    auto& received = received_[static_cast<std::size_t>(s % pipeline_)];
    packed.resize(others_.size());
    received.resize(others_.size());
    for (std::size_t o = 0; o < others_.size(); ++o) {
      const int q = others_[o], iq = process_index(q);
      const auto [f, l] = share_of(s, iq);
      if (kl == 1) {
        // One member: its piece goes straight from its buffer (until the all-gather of this
        // segment, rounds later, only this process's own share of it is written).
        round.sends.push_back(message(q, buffer(local_.front()) + f, l - f));
      } else {
        packed[o].resize(kl * (l - f));
        for (std::size_t i = 0; i < kl; ++i)
          std::copy(buffer(local_[i]) + f, buffer(local_[i]) + l,
                    packed[o].begin() + static_cast<std::ptrdiff_t>(i * (l - f)));
        round.sends.push_back(message(q, packed[o].data(), packed[o].size()));
      }
      received[o].resize(members_of_[static_cast<std::size_t>(iq)].size() * (last - first));
      round.receives.push_back(message(q, received[o].data(), received[o].size()));
    }
  }

  // This process's share of segment s, folded over the members in rank order into every local
  // member's buffer (its scatter round has completed).
  void fold(int s) {
    const auto [first, last] = share_of(s, process_index(me_));
    const std::size_t len = last - first;
    const auto& received = received_[static_cast<std::size_t>(s % pipeline_)];
    std::vector<const float*> sources;
    for (int r = 0; r < n_; ++r) {
      if (is_local(r))
        sources.push_back(buffer(r) + first);
      else
        sources.push_back(received[other_index(process_of_[r])].data() +
                          static_cast<std::size_t>(slot_[r]) * len);
    }
    std::vector<float*> targets;
    for (int r : local_)
      targets.push_back(buffer(r) + first);
    reduce_to_all(c_.call.reduce, sources, 0, targets, 0, len, false);
  }

  // This process's folded share of segment s to every other process, theirs into the first
  // local member's buffer.
  void gather(int s, MpiRound& round) {
    const auto [first, last] = share_of(s, process_index(me_));
    const int lead = local_.front();
    for (int q : others_) {
      const auto [f, l] = share_of(s, process_index(q));
      round.sends.push_back(message(q, buffer(lead) + first, last - first));
      round.receives.push_back(message(q, buffer(lead) + f, l - f));
    }
  }

  // The other processes' shares of segment s, from the first local member to the rest (its
  // gather round has completed).
  void spread(int s) {
    for (std::size_t i = 1; i < local_.size(); ++i)
      for (int q : others_) {
        const auto [f, l] = share_of(s, process_index(q));
        copy_floats(buffer(local_[i]) + f, buffer(local_.front()) + f, l - f, false);
      }
  }

  std::size_t count_ = 0;
  bool whole_ = true;
  int stage_ = 0;
  std::vector<std::vector<float>> packed_whole_, received_whole_;  // by other process
  // The segmented path: its segments, how many rounds are in flight at once, and by then how
  // many rounds it posted, segments it folded and spread; its buffers, by s % pipeline_ and
  // other process.
  std::size_t segment_elements_ = 0;
  int segments_ = 1, pipeline_ = 1;
  int posted_ = 0, folded_ = 0, spread_ = 0;
  std::array<std::vector<std::vector<float>>, kPipeline> packed_, received_;
};

// Rows exchanged by the block collectives: member j's block for member r, `m` elements.
class BlockExchange : public SpanningCollective {
 protected:
  using SpanningCollective::SpanningCollective;
  std::size_t other_index(int process) const {
    return static_cast<std::size_t>(std::lower_bound(others_.begin(), others_.end(), process) -
                                    others_.begin());
  }
  // Whether ranks `members` (ascending) follow each other: their blocks are then one run.
  static bool consecutive(const std::vector<int>& members) {
    return members.back() - members.front() + 1 == static_cast<int>(members.size());
  }
  // With one member here, the blocks for each other process go straight from its input when
  // that process's members are consecutive ranks, and (with `direct` set) the blocks from it
  // straight to `direct` at its first member's block: no copies around the messages.
  bool sends_direct() const { return local_.size() == 1; }
  bool receives_direct(const float* direct) const {
    if (!direct || local_.size() != 1) return false;
    for (int q : others_)
      if (!consecutive(members_of_[static_cast<std::size_t>(process_index(q))])) return false;
    return true;
  }
  // Sends, to each other process q, block r of every local member j's input for each member r
  // of q (j outer, r inner); receives from q the blocks its members have for the local ones,
  // into `direct` when receives_direct(direct).
  MpiRound exchange_blocks(std::size_t m, float* direct = nullptr) {
    MpiRound round;
    packed_.resize(others_.size());
    received_.resize(others_.size());
    const std::size_t kl = local_.size();
    for (std::size_t o = 0; o < others_.size(); ++o) {
      const int q = others_[o];
      const auto& theirs = members_of_[static_cast<std::size_t>(process_index(q))];
      const auto first = static_cast<std::size_t>(theirs.front()) * m;
      if (sends_direct() && consecutive(theirs)) {
        const float* in = c_.members[static_cast<std::size_t>(local_.front())].input.data();
        round.sends.push_back(message(q, in + first, theirs.size() * m));
      } else {
        packed_[o].resize(kl * theirs.size() * m);
        float* at = packed_[o].data();
        for (int j : local_) {
          const float* in = c_.members[static_cast<std::size_t>(j)].input.data();
          for (int r : theirs) {
            std::copy(in + static_cast<std::size_t>(r) * m,
                      in + static_cast<std::size_t>(r) * m + m, at);
            at += m;
          }
        }
        round.sends.push_back(message(q, packed_[o].data(), packed_[o].size()));
      }
      if (receives_direct(direct)) {
        round.receives.push_back(message(q, direct + first, theirs.size() * m));
      } else {
        received_[o].resize(theirs.size() * kl * m);
        round.receives.push_back(message(q, received_[o].data(), received_[o].size()));
      }
    }
    return round;
  }
  // Where member j's block for local member r is: in j's input if j is here, else received.
  const float* block(int j, int r, std::size_t m) const {
    if (is_local(j))
      return c_.members[static_cast<std::size_t>(j)].input.data() + static_cast<std::size_t>(r) * m;
    const auto& rec = received_[other_index(process_of_[j])];
    return rec.data() + (static_cast<std::size_t>(slot_[j]) * local_.size() +
                         static_cast<std::size_t>(slot_[r])) *
                            m;
  }
  std::vector<std::vector<float>> packed_, received_;  // by other process
};

// ------------------------------------------------------------------------------- reduce-scatter
class SpanningReduceScatter final : public BlockExchange {
 public:
  SpanningReduceScatter(const Collective& c, MpiJob& job, std::vector<int> process_of)
      : BlockExchange(c, job, std::move(process_of)) {
    m_ = c.members[static_cast<std::size_t>(local_.front())].output.size();
    check_local_sizes(
        c, local_, [](const CollectiveMember& x) { return x.output; }, m_, "output",
        fmt::format("every rank receives {} elements", m_));
    check_local_sizes(
        c, local_, [](const CollectiveMember& x) { return x.input; }, m_ * n_, "input",
        fmt::format("each input holds group size x output = {} x {}", n_, m_));
  }

 private:
  void restart() override { stage_ = 0; }
  std::optional<MpiRound> next() override {
    if (stage_++ == 0) return exchange_blocks(m_);
    for (int r : local_) {
      std::vector<const float*> sources;
      for (int j = 0; j < n_; ++j)
        sources.push_back(block(j, r, m_));
      float* const out[] = {c_.members[static_cast<std::size_t>(r)].output.data()};
      reduce_to_all(c_.call.reduce, sources, 0, out, 0, m_, false);
    }
    return std::nullopt;
  }
  std::size_t m_ = 0;
  int stage_ = 0;
};

// ------------------------------------------------------------------------------- all-to-all
class SpanningAllToAll final : public BlockExchange {
 public:
  SpanningAllToAll(const Collective& c, MpiJob& job, std::vector<int> process_of)
      : BlockExchange(c, job, std::move(process_of)) {
    const std::size_t total = c.members[static_cast<std::size_t>(local_.front())].input.size();
    if (total % static_cast<std::size_t>(n_) != 0)
      throw std::invalid_argument(fmt::format(
          "all_to_all over group '{}': rank {}'s {} elements cannot be split into {} equal "
          "blocks, one per rank; pad them to a multiple of {} or use all_to_all_v",
          c.group.name(), local_.front(), total, n_, n_));
    const std::string rule = fmt::format("every rank sends and receives {} blocks of {} elements",
                                         n_, total / static_cast<std::size_t>(n_));
    check_local_sizes(
        c, local_, [](const CollectiveMember& x) { return x.input; }, total, "input", rule);
    check_local_sizes(
        c, local_, [](const CollectiveMember& x) { return std::span<const float>(x.output); },
        total, "output", rule);
    m_ = total / static_cast<std::size_t>(n_);
  }

 private:
  void restart() override { stage_ = 0; }
  // The single local member's output, when the other processes' blocks can land in it
  // directly (it does not overlap the input they are sent from).
  float* direct_output() const {
    const CollectiveMember& x = c_.members[static_cast<std::size_t>(local_.front())];
    const float* in = x.input.data();
    float* out = x.output.data();
    const std::size_t total = x.input.size();
    const bool apart = out + total <= in || in + total <= out;
    return apart && receives_direct(out) ? out : nullptr;
  }
  std::optional<MpiRound> next() override {
    if (stage_++ == 0) return exchange_blocks(m_, direct_output());
    const bool direct = direct_output() != nullptr;
    for (int r : local_) {
      float* out = c_.members[static_cast<std::size_t>(r)].output.data();
      for (int j = 0; j < n_; ++j)
        if (is_local(j) || !direct)
          copy_floats(out + static_cast<std::size_t>(j) * m_, block(j, r, m_), m_, false);
    }
    return std::nullopt;
  }
  std::size_t m_ = 0;
  int stage_ = 0;
};

// ------------------------------------------------------------------------------- all-gather
class SpanningAllGather final : public SpanningCollective {
 public:
  SpanningAllGather(const Collective& c, MpiJob& job, std::vector<int> process_of)
      : SpanningCollective(c, job, std::move(process_of)) {
    m_ = c.members[static_cast<std::size_t>(local_.front())].input.size();
    check_local_sizes(
        c, local_, [](const CollectiveMember& x) { return x.input; }, m_, "input",
        fmt::format("every rank contributes {} elements", m_));
    check_local_sizes(
        c, local_, [](const CollectiveMember& x) { return std::span<const float>(x.output); },
        m_ * n_, "output", fmt::format("each output holds group size x input = {} x {}", n_, m_));
  }

 private:
  void restart() override { stage_ = 0; }
  // With one member here, process q's blocks land straight in its output when q's members are
  // consecutive ranks and their place in the output does not overlap the input sent from.
  bool lands_direct(int q) const {
    if (local_.size() != 1) return false;
    const auto& theirs = members_of_[static_cast<std::size_t>(process_index(q))];
    if (theirs.back() - theirs.front() + 1 != static_cast<int>(theirs.size())) return false;
    const CollectiveMember& x = c_.members[static_cast<std::size_t>(local_.front())];
    const float* in = x.input.data();
    const float* at = x.output.data() + static_cast<std::size_t>(theirs.front()) * m_;
    return at + theirs.size() * m_ <= in || in + m_ <= at;
  }
  std::optional<MpiRound> next() override {
    const bool one = local_.size() == 1;
    if (stage_++ == 0) {
      const float* mine = c_.members[static_cast<std::size_t>(local_.front())].input.data();
      if (!one) {
        packed_.resize(local_.size() * m_);
        for (std::size_t i = 0; i < local_.size(); ++i) {
          // Bytes (an all-gather's elements may be packed 16-bit values, packed_halves.hpp).
          // An empty input's data() may be null, which memcpy must not be given even for 0 bytes.
          if (m_ == 0) break;
          const float* in = c_.members[static_cast<std::size_t>(local_[i])].input.data();
          std::memcpy(packed_.data() + i * m_, in, m_ * sizeof(float));
        }
        mine = packed_.data();
      }
      MpiRound round;
      received_.resize(others_.size());
      for (std::size_t o = 0; o < others_.size(); ++o) {
        const int q = others_[o];
        const auto& theirs = members_of_[static_cast<std::size_t>(process_index(q))];
        round.sends.push_back(message(q, mine, local_.size() * m_));
        if (lands_direct(q)) {
          float* out = c_.members[static_cast<std::size_t>(local_.front())].output.data();
          round.receives.push_back(
              message(q, out + static_cast<std::size_t>(theirs.front()) * m_, theirs.size() * m_));
        } else {
          received_[o].resize(theirs.size() * m_);
          round.receives.push_back(message(q, received_[o].data(), received_[o].size()));
        }
      }
      return round;
    }
    for (int l : local_) {
      float* out = c_.members[static_cast<std::size_t>(l)].output.data();
      for (int j = 0; j < n_; ++j) {
        const float* from;
        if (is_local(j)) {
          from = one ? c_.members[static_cast<std::size_t>(j)].input.data()
                     : packed_.data() +
                           static_cast<std::size_t>(
                               std::lower_bound(local_.begin(), local_.end(), j) - local_.begin()) *
                               m_;
        } else if (lands_direct(process_of_[j])) {
          continue;
        } else {
          const auto o = static_cast<std::size_t>(
              std::lower_bound(others_.begin(), others_.end(), process_of_[j]) - others_.begin());
          from = received_[o].data() + static_cast<std::size_t>(slot_[j]) * m_;
        }
        copy_floats(out + static_cast<std::size_t>(j) * m_, from, m_, false);
      }
    }
    return std::nullopt;
  }
  std::size_t m_ = 0;
  int stage_ = 0;
  std::vector<float> packed_;
  std::vector<std::vector<float>> received_;
};

// ------------------------------------------------------------------------------- broadcast
class SpanningBroadcast final : public SpanningCollective {
 public:
  SpanningBroadcast(const Collective& c, MpiJob& job, std::vector<int> process_of)
      : SpanningCollective(c, job, std::move(process_of)) {
    if (c.call.root < 0 || c.call.root >= n_)
      throw std::invalid_argument(
          fmt::format("broadcast over group '{}': root rank {} is outside [0, {}); name the root "
                      "by its rank in the group, not its device",
                      c.group.name(), c.call.root, n_));
    count_ = c.members[static_cast<std::size_t>(local_.front())].output.size();
    check_local_sizes(
        c, local_, [](const CollectiveMember& x) { return std::span<const float>(x.output); },
        count_, "input/output buffer",
        fmt::format("every rank receives the root's {} elements", count_));
  }

 private:
  void restart() override { stage_ = 0; }
  std::optional<MpiRound> next() override {
    const int root = c_.call.root;
    const int source = is_local(root) ? root : local_.front();
    float* from = c_.members[static_cast<std::size_t>(source)].output.data();
    if (stage_++ == 0) {
      MpiRound round;
      if (is_local(root)) {
        for (int q : others_)
          round.sends.push_back(message(q, from, count_));
      } else {
        round.receives.push_back(message(process_of_[root], from, count_));
      }
      return round;
    }
    for (int l : local_)
      copy_floats(c_.members[static_cast<std::size_t>(l)].output.data(), from, count_, false);
    return std::nullopt;
  }
  std::size_t count_ = 0;
  int stage_ = 0;
};

// ------------------------------------------------------------------------------- send/recv
// The sender's data is copied when its task runs (a buffered send): its buffer is free from
// then on, as in one process once the receiver has copied it, however late MPI moves the bytes.
class SpanningSendRecv final : public SpanningCollective {
 public:
  SpanningSendRecv(const Collective& c, MpiJob& job, std::vector<int> process_of)
      : SpanningCollective(c, job, std::move(process_of)) {}

 private:
  void restart() override {
    stage_ = 0;
    if (is_local(0)) staged_.assign(c_.members[0].input.begin(), c_.members[0].input.end());
  }
  std::optional<MpiRound> next() override {
    if (stage_++ > 0) return std::nullopt;
    MpiRound round;
    if (is_local(0)) {
      round.sends.push_back(message(process_of_[1], staged_.data(), staged_.size()));
    } else {
      const std::span<float> into = c_.members[1].output;
      round.receives.push_back(message(process_of_[0], into.data(), into.size()));
    }
    return round;
  }
  int stage_ = 0;
  std::vector<float> staged_;
};

// ------------------------------------------------------------------------------- barrier
class SpanningBarrier final : public SpanningCollective {
 public:
  SpanningBarrier(const Collective& c, MpiJob& job, std::vector<int> process_of)
      : SpanningCollective(c, job, std::move(process_of)) {}

 private:
  void restart() override { stage_ = 0; }
  std::optional<MpiRound> next() override {
    if (stage_++ > 0) return std::nullopt;
    MpiRound round;
    for (int q : others_) {
      round.sends.push_back({q, nullptr, 0});
      round.receives.push_back({q, nullptr, 0});
    }
    return round;
  }
  int stage_ = 0;
};

// ------------------------------------------------------------------------------- all-to-all v
// Two rounds: every member's counts and capacities go to every process of the group, so that
// each checks all of them alike (a bad count fails every process with the same message), then
// the rows.
class SpanningAllToAllV final : public SpanningCollective {
 public:
  SpanningAllToAllV(const Collective& c, MpiJob& job, std::vector<int> process_of)
      : SpanningCollective(c, job, std::move(process_of)) {
    if (c.call.row_elements < 1)
      throw std::invalid_argument(fmt::format(
          "all_to_all_v over group '{}': a row must hold at least 1 element, got {}; pass the "
          "number of floats per token row",
          c.group.name(), c.call.row_elements));
    for (int r : local_) {
      const VariableAllToAllBuffers& v = c.members[static_cast<std::size_t>(r)].variable;
      if (!v.send_counts)
        throw std::invalid_argument(
            fmt::format("all_to_all_v over group '{}': rank {} (device {}) has no send_counts; "
                        "point it at the vector an earlier task fills",
                        c.group.name(), r, c.group.device(r)));
      if (v.recv_counts.size() != static_cast<std::size_t>(n_))
        throw std::invalid_argument(
            fmt::format("all_to_all_v over group '{}': rank {} (device {}) has room for {} receive "
                        "counts; give it one per rank, {}",
                        c.group.name(), r, c.group.device(r), v.recv_counts.size(), n_));
    }
    row_ = static_cast<std::size_t>(c.call.row_elements);
  }

 private:
  // Per member: [number of counts, counts (n, zero-padded), send capacity, receive capacity].
  std::size_t record() const { return static_cast<std::size_t>(n_) + 3; }
  void restart() override { stage_ = 0; }

  const VariableAllToAllBuffers& buffers(int member) const {
    return c_.members[static_cast<std::size_t>(member)].variable;
  }
  std::size_t other_index(int process) const {
    return static_cast<std::size_t>(std::lower_bound(others_.begin(), others_.end(), process) -
                                    others_.begin());
  }
  // Member j's record: local ones in `mine_`, the others' as received.
  const std::int64_t* info(int j) const {
    if (is_local(j))
      return mine_.data() +
             static_cast<std::size_t>(std::lower_bound(local_.begin(), local_.end(), j) -
                                      local_.begin()) *
                 record();
    return counts_in_[other_index(process_of_[j])].data() +
           static_cast<std::size_t>(slot_[j]) * record();
  }
  std::int64_t count(int j, int r) const { return info(j)[1 + r]; }

  // Every member's counts against its buffers, on every process alike.
  void check_counts() const {
    const std::string& g = c_.group.name();
    for (int j = 0; j < n_; ++j) {
      const std::int64_t* x = info(j);
      if (x[0] != n_)
        throw std::runtime_error(fmt::format(
            "all_to_all_v over group '{}': rank {} has {} send counts, needs one per rank ({})", g,
            j, x[0], n_));
      std::size_t rows = 0;
      for (int k = 0; k < n_; ++k) {
        if (x[1 + k] < 0)
          throw std::runtime_error(fmt::format(
              "all_to_all_v over group '{}': rank {} sends a negative count {}", g, j, x[1 + k]));
        rows += static_cast<std::size_t>(x[1 + k]);
      }
      if (rows * row_ > static_cast<std::size_t>(x[1 + n_]))
        throw std::runtime_error(fmt::format(
            "all_to_all_v over group '{}': rank {} sends {} rows of {} elements but its send "
            "buffer holds {} elements",
            g, j, rows, row_, x[1 + n_]));
    }
    for (int r = 0; r < n_; ++r) {
      std::size_t total = 0;
      for (int j = 0; j < n_; ++j)
        total += static_cast<std::size_t>(count(j, r)) * row_;
      if (total > static_cast<std::size_t>(info(r)[2 + n_]))
        throw std::runtime_error(fmt::format(
            "all_to_all_v over group '{}': rank {} receives {} elements but its receive buffer "
            "holds {}; size it for the largest possible split (dropless MoE: tokens x top-k rows)",
            g, r, total, info(r)[2 + n_]));
    }
  }

  // Where member j's rows for member r start in j's send buffer, in elements.
  std::size_t offset(int j, int r) const {
    std::size_t from = 0;
    for (int k = 0; k < r; ++k)
      from += static_cast<std::size_t>(count(j, k)) * row_;
    return from;
  }

  std::optional<MpiRound> next() override {
    switch (stage_++) {
      case 0: {
        mine_.assign(local_.size() * record(), 0);
        for (std::size_t i = 0; i < local_.size(); ++i) {
          const VariableAllToAllBuffers& v = buffers(local_[i]);
          std::int64_t* x = mine_.data() + i * record();
          x[0] = static_cast<std::int64_t>(v.send_counts->size());
          for (int k = 0; k < n_ && k < static_cast<int>(v.send_counts->size()); ++k)
            x[1 + k] = (*v.send_counts)[static_cast<std::size_t>(k)];
          x[1 + n_] = static_cast<std::int64_t>(v.send.size());
          x[2 + n_] = static_cast<std::int64_t>(v.recv.size());
        }
        MpiRound round;
        counts_in_.resize(others_.size());
        for (std::size_t o = 0; o < others_.size(); ++o) {
          const int q = others_[o];
          round.sends.push_back({q, mine_.data(), mine_.size() * sizeof(std::int64_t)});
          counts_in_[o].resize(members_of_[static_cast<std::size_t>(process_index(q))].size() *
                               record());
          round.receives.push_back(
              {q, counts_in_[o].data(), counts_in_[o].size() * sizeof(std::int64_t)});
        }
        return round;
      }
      case 1: {
        check_counts();
        MpiRound round;
        packed_.resize(others_.size());
        received_.resize(others_.size());
        for (std::size_t o = 0; o < others_.size(); ++o) {
          const int q = others_[o];
          const auto& theirs = members_of_[static_cast<std::size_t>(process_index(q))];
          std::size_t out = 0, in = 0;
          for (int j : local_)
            for (int r : theirs)
              out += static_cast<std::size_t>(count(j, r)) * row_;
          for (int j : theirs)
            for (int r : local_)
              in += static_cast<std::size_t>(count(j, r)) * row_;
          packed_[o].resize(out);
          float* at = packed_[o].data();
          for (int j : local_) {
            const float* send = buffers(j).send.data();
            for (int r : theirs) {
              const std::size_t len = static_cast<std::size_t>(count(j, r)) * row_;
              std::copy(send + offset(j, r), send + offset(j, r) + len, at);
              at += len;
            }
          }
          received_[o].resize(in);
          round.sends.push_back(message(q, packed_[o].data(), packed_[o].size()));
          round.receives.push_back(message(q, received_[o].data(), received_[o].size()));
        }
        return round;
      }
      case 2: {
        // Where each remote member's rows for each local member start in what came from it.
        std::vector<std::size_t> cursor(others_.size(), 0);
        std::vector<std::vector<std::size_t>> from(static_cast<std::size_t>(n_));
        for (std::size_t o = 0; o < others_.size(); ++o)
          for (int j : members_of_[static_cast<std::size_t>(process_index(others_[o]))])
            for (int r : local_) {
              from[static_cast<std::size_t>(j)].push_back(cursor[o]);
              cursor[o] += static_cast<std::size_t>(count(j, r)) * row_;
            }
        for (std::size_t i = 0; i < local_.size(); ++i) {
          const int r = local_[i];
          const VariableAllToAllBuffers& v = buffers(r);
          std::size_t at = 0;
          for (int j = 0; j < n_; ++j) {
            const std::size_t len = static_cast<std::size_t>(count(j, r)) * row_;
            const float* source = is_local(j) ? buffers(j).send.data() + offset(j, r)
                                              : received_[other_index(process_of_[j])].data() +
                                                    from[static_cast<std::size_t>(j)][i];
            copy_floats(v.recv.data() + at, source, len, false);
            v.recv_counts[static_cast<std::size_t>(j)] = count(j, r);
            at += len;
          }
        }
        return std::nullopt;
      }
    }
    return std::nullopt;
  }

  std::size_t row_ = 1;
  int stage_ = 0;
  std::vector<std::int64_t> mine_;
  std::vector<std::vector<std::int64_t>> counts_in_;
  std::vector<std::vector<float>> packed_, received_;
};

template <typename Spanning>
std::shared_ptr<SpanningCollective> make_spanning(const Collective& c, MpiJob& job,
                                                  std::vector<int> process_of) {
  return std::make_shared<Spanning>(c, job, std::move(process_of));
}

// Each op's spanning collective, in CollectiveOp's order.
struct OpSpanning {
  CollectiveOp op;
  std::shared_ptr<SpanningCollective> (*make)(const Collective&, MpiJob&, std::vector<int>);
};
constexpr std::array kSpanning{
    OpSpanning{CollectiveOp::all_reduce, make_spanning<SpanningAllReduce>},
    OpSpanning{CollectiveOp::all_gather, make_spanning<SpanningAllGather>},
    OpSpanning{CollectiveOp::reduce_scatter, make_spanning<SpanningReduceScatter>},
    OpSpanning{CollectiveOp::all_to_all, make_spanning<SpanningAllToAll>},
    OpSpanning{CollectiveOp::all_to_all_v, make_spanning<SpanningAllToAllV>},
    OpSpanning{CollectiveOp::all_gather_v, make_spanning_all_gather_v},
    OpSpanning{CollectiveOp::reduce_scatter_v, make_spanning_reduce_scatter_v},
    OpSpanning{CollectiveOp::broadcast, make_spanning<SpanningBroadcast>},
    OpSpanning{CollectiveOp::send_recv, make_spanning<SpanningSendRecv>},
    OpSpanning{CollectiveOp::barrier, make_spanning<SpanningBarrier>},
};
static_assert(lists_every_op(kSpanning), "an MPI implementation of every collective op");

}  // namespace

std::shared_ptr<SpanningCollective> SpanningCollective::make(const Collective& c, MpiJob& job,
                                                             std::vector<int> process_of) {
  return kSpanning[static_cast<std::size_t>(c.call.op)].make(c, job, std::move(process_of));
}

}  // namespace weave::devices::detail
