// The variable-size all-gather and reduce-scatter across processes (split experts' rows over a
// tensor-parallel group spanning processes). The all-gather first exchanges each member's row
// count, then the rows; the reduce-scatter sends every process the blocks of its members from
// every local member and reduces them in rank order, as one process would.
#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

#include "collective_kernels.hpp"
#include "mpi_collectives.hpp"

namespace weave::devices::detail {

namespace {

MpiMessage floats(int peer, const float* data, std::size_t elements) {
  return {peer, const_cast<float*>(data), elements * sizeof(float)};
}

std::size_t row_size(const Collective& c) {
  if (c.call.row_elements < 1)
    throw std::invalid_argument(fmt::format(
        "{} over group '{}': a row must hold at least 1 element, got {}; pass the number of "
        "floats per token row",
        to_string(c.call.op), c.group.name(), c.call.row_elements));
  return static_cast<std::size_t>(c.call.row_elements);
}

class SpanningAllGatherV final : public SpanningCollective {
 public:
  SpanningAllGatherV(const Collective& c, MpiJob& job, std::vector<int> process_of)
      : SpanningCollective(c, job, std::move(process_of)), row_(row_size(c)) {
    for (int r : local_) {
      const VariableGatherBuffers& g = c.members[static_cast<std::size_t>(r)].gather;
      if (!g.send_rows)
        throw std::invalid_argument(
            fmt::format("all_gather_v over group '{}': rank {} (device {}) has no send_rows; "
                        "point it at the count an earlier task sets",
                        c.group.name(), r, c.group.device(r)));
      if (g.recv_rows.size() != static_cast<std::size_t>(n_))
        throw std::invalid_argument(
            fmt::format("all_gather_v over group '{}': rank {} (device {}) has room for {} "
                        "receive counts; give it one per rank, {}",
                        c.group.name(), r, c.group.device(r), g.recv_rows.size(), n_));
    }
  }

 private:
  void restart() override { stage_ = 0; }
  const VariableGatherBuffers& buffers(int m) const {
    return c_.members[static_cast<std::size_t>(m)].gather;
  }
  std::size_t other(int process) const {
    return static_cast<std::size_t>(std::lower_bound(others_.begin(), others_.end(), process) -
                                    others_.begin());
  }
  std::size_t local_index(int m) const {
    return static_cast<std::size_t>(std::lower_bound(local_.begin(), local_.end(), m) -
                                    local_.begin());
  }
  std::int64_t rows(int j) const {
    return is_local(j) ? rows_mine_[local_index(j)]
                       : rows_in_[other(process_of_[j])][static_cast<std::size_t>(slot_[j])];
  }

  std::optional<MpiRound> next() override {
    switch (stage_++) {
      case 0: {  // every member's row count
        rows_mine_.clear();
        for (int r : local_) {
          const VariableGatherBuffers& g = buffers(r);
          if (*g.send_rows < 0 || static_cast<std::size_t>(*g.send_rows) * row_ > g.send.size())
            throw std::runtime_error(fmt::format(
                "all_gather_v over group '{}': rank {} sends {} rows of {} elements but its send "
                "buffer holds {} elements",
                c_.group.name(), r, *g.send_rows, row_, g.send.size()));
          rows_mine_.push_back(*g.send_rows);
        }
        MpiRound round;
        rows_in_.resize(others_.size());
        for (std::size_t o = 0; o < others_.size(); ++o) {
          const int q = others_[o];
          round.sends.push_back({q, rows_mine_.data(), rows_mine_.size() * sizeof(std::int64_t)});
          rows_in_[o].assign(members_of_[static_cast<std::size_t>(process_index(q))].size(), 0);
          round.receives.push_back(
              {q, rows_in_[o].data(), rows_in_[o].size() * sizeof(std::int64_t)});
        }
        return round;
      }
      case 1: {  // the rows
        std::size_t mine = 0;
        for (int r : local_)
          mine += static_cast<std::size_t>(rows(r)) * row_;
        packed_.resize(mine);
        std::size_t at = 0;
        for (int r : local_) {
          const std::size_t len = static_cast<std::size_t>(rows(r)) * row_;
          std::copy_n(buffers(r).send.data(), len,
                      packed_.begin() + static_cast<std::ptrdiff_t>(at));
          at += len;
        }
        MpiRound round;
        received_.resize(others_.size());
        for (std::size_t o = 0; o < others_.size(); ++o) {
          const int q = others_[o];
          std::size_t theirs = 0;
          for (int j : members_of_[static_cast<std::size_t>(process_index(q))])
            theirs += static_cast<std::size_t>(rows(j)) * row_;
          received_[o].resize(theirs);
          round.sends.push_back(floats(q, packed_.data(), packed_.size()));
          round.receives.push_back(floats(q, received_[o].data(), received_[o].size()));
        }
        return round;
      }
      default: {  // every block into every local member's buffer, in rank order
        std::size_t total = 0;
        for (int j = 0; j < n_; ++j)
          total += static_cast<std::size_t>(rows(j)) * row_;
        for (int r : local_)
          if (total > buffers(r).recv.size())
            throw std::runtime_error(fmt::format(
                "all_gather_v over group '{}': rank {} receives {} elements but its receive "
                "buffer holds {}; size it for every rank's largest block",
                c_.group.name(), r, total, buffers(r).recv.size()));
        for (int r : local_) {
          const VariableGatherBuffers& g = buffers(r);
          std::size_t at = 0;
          for (int j = 0; j < n_; ++j) {
            const std::size_t len = static_cast<std::size_t>(rows(j)) * row_;
            const float* from;
            if (is_local(j)) {
              from = buffers(j).send.data();
            } else {
              std::size_t skip = 0;
              for (int k : members_of_[static_cast<std::size_t>(process_index(process_of_[j]))]) {
                if (k == j) break;
                skip += static_cast<std::size_t>(rows(k)) * row_;
              }
              from = received_[other(process_of_[j])].data() + skip;
            }
            copy_floats(g.recv.data() + at, from, len, false);
            g.recv_rows[static_cast<std::size_t>(j)] = rows(j);
            at += len;
          }
        }
        return std::nullopt;
      }
    }
  }

  std::size_t row_;
  int stage_ = 0;
  std::vector<std::int64_t> rows_mine_;
  std::vector<std::vector<std::int64_t>> rows_in_;
  std::vector<float> packed_;
  std::vector<std::vector<float>> received_;
};

class SpanningReduceScatterV final : public SpanningCollective {
 public:
  SpanningReduceScatterV(const Collective& c, MpiJob& job, std::vector<int> process_of)
      : SpanningCollective(c, job, std::move(process_of)), row_(row_size(c)) {
    for (int r : local_)
      if (!c.members[static_cast<std::size_t>(r)].scatter.rows)
        throw std::invalid_argument(
            fmt::format("reduce_scatter_v over group '{}': rank {} (device {}) has no block "
                        "rows; point it at the counts an earlier task sets",
                        c.group.name(), r, c.group.device(r)));
  }

 private:
  void restart() override { stage_ = 0; }
  const VariableScatterBuffers& buffers(int m) const {
    return c_.members[static_cast<std::size_t>(m)].scatter;
  }
  std::size_t other(int process) const {
    return static_cast<std::size_t>(std::lower_bound(others_.begin(), others_.end(), process) -
                                    others_.begin());
  }
  // Block r's first element and length in every member's send buffer.
  std::size_t first(int r) const {
    std::size_t at = 0;
    for (int k = 0; k < r; ++k)
      at += static_cast<std::size_t>(rows_[static_cast<std::size_t>(k)]) * row_;
    return at;
  }
  std::size_t length(int r) const {
    return static_cast<std::size_t>(rows_[static_cast<std::size_t>(r)]) * row_;
  }

  std::optional<MpiRound> next() override {
    if (stage_++ == 0) {
      rows_ = *buffers(local_.front()).rows;
      const std::string& g = c_.group.name();
      if (rows_.size() != static_cast<std::size_t>(n_))
        throw std::runtime_error(fmt::format(
            "reduce_scatter_v over group '{}': rank {} has {} block counts, needs one per rank "
            "({})",
            g, local_.front(), rows_.size(), n_));
      std::size_t total = 0;
      for (std::int64_t k : rows_) {
        if (k < 0)
          throw std::runtime_error(
              fmt::format("reduce_scatter_v over group '{}': a negative block count {}", g, k));
        total += static_cast<std::size_t>(k) * row_;
      }
      for (int r : local_) {
        if (*buffers(r).rows != rows_)
          throw std::runtime_error(fmt::format(
              "reduce_scatter_v over group '{}': ranks {} and {} disagree on the blocks' rows; "
              "every member must pass the same counts",
              g, local_.front(), r));
        if (total > buffers(r).send.size() || length(r) > buffers(r).recv.size())
          throw std::runtime_error(fmt::format(
              "reduce_scatter_v over group '{}': rank {}'s buffers ({} to send, {} to receive) "
              "cannot hold the blocks ({} in all, {} its own)",
              g, r, buffers(r).send.size(), buffers(r).recv.size(), total, length(r)));
      }
      // To each process: for each of its members (ascending), the local members' blocks of it.
      MpiRound round;
      packed_.resize(others_.size());
      received_.resize(others_.size());
      for (std::size_t o = 0; o < others_.size(); ++o) {
        const int q = others_[o];
        const auto& theirs = members_of_[static_cast<std::size_t>(process_index(q))];
        packed_[o].clear();
        for (int r : theirs)
          for (int j : local_) {
            const float* block = buffers(j).send.data() + first(r);
            packed_[o].insert(packed_[o].end(), block, block + length(r));
          }
        std::size_t in = 0;
        for (int r : local_)
          in += length(r) * members_of_[static_cast<std::size_t>(process_index(q))].size();
        received_[o].resize(in);
        round.sends.push_back(floats(q, packed_[o].data(), packed_[o].size()));
        round.receives.push_back(floats(q, received_[o].data(), received_[o].size()));
      }
      return round;
    }
    // Each local member's block from every member, summed in rank order.
    for (std::size_t i = 0; i < local_.size(); ++i) {
      const int r = local_[i];
      std::vector<const float*> sources;
      for (int j = 0; j < n_; ++j) {
        if (is_local(j)) {
          sources.push_back(buffers(j).send.data() + first(r));
          continue;
        }
        // From process q: for each local member of ours (ascending), q's members' blocks of it.
        const std::size_t senders =
            members_of_[static_cast<std::size_t>(process_index(process_of_[j]))].size();
        std::size_t at = 0;
        for (std::size_t k = 0; k < i; ++k)
          at += length(local_[k]) * senders;
        sources.push_back(received_[other(process_of_[j])].data() + at +
                          static_cast<std::size_t>(slot_[j]) * length(r));
      }
      // Offsets of the sources are already applied: reduce from offset 0.
      float* const out = buffers(r).recv.data();
      reduce_to_all(c_.call.reduce, sources, 0, std::span<float* const>(&out, 1), 0, length(r),
                    false);
    }
    return std::nullopt;
  }

  std::size_t row_;
  int stage_ = 0;
  std::vector<std::int64_t> rows_;
  std::vector<std::vector<float>> packed_, received_;
};

}  // namespace

std::shared_ptr<SpanningCollective> make_spanning_all_gather_v(const Collective& c, MpiJob& job,
                                                               std::vector<int> process_of) {
  return std::make_shared<SpanningAllGatherV>(c, job, std::move(process_of));
}

std::shared_ptr<SpanningCollective> make_spanning_reduce_scatter_v(const Collective& c, MpiJob& job,
                                                                   std::vector<int> process_of) {
  return std::make_shared<SpanningReduceScatterV>(c, job, std::move(process_of));
}

}  // namespace weave::devices::detail
