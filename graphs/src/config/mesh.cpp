#include "weave/graphs/mesh.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <unordered_map>
#include <vector>

namespace weave::graphs {

namespace {
constexpr int kKinds = 8;

const char* prefix(GroupKind kind) {
  switch (kind) {
    case GroupKind::tensor:
      return "tp";
    case GroupKind::context:
      return "cp";
    case GroupKind::data:
      return "dp";
    case GroupKind::data_context:
      return "dp_cp";
    case GroupKind::expert:
      return "ep";
    case GroupKind::expert_data:
      return "edp";
    case GroupKind::pipeline:
      return "pp";
    case GroupKind::tensor_context:
      return "tp_cp";
  }
  return "?";
}
}  // namespace

Mesh::Mesh(const ParallelPlan& plan) : plan_(plan), size_(plan.devices()) {
  // The ranks an expert-parallel group is carved from: a stage's, or with experts split over tp
  // the stage's ranks of one tensor-parallel rank.
  const int stage =
      plan.context_parallel * plan.data_parallel * (experts_split() ? 1 : plan.tensor_parallel);
  if (size_ < 1 || stage % plan.expert_parallel != 0)
    throw ConfigError(
        fmt::format("a mesh needs positive sizes and an expert-parallel size ({}) dividing {} ({})",
                    plan.expert_parallel, experts_split() ? "cp x dp" : "tp x cp x dp", stage));
  expert_data_ = stage / plan.expert_parallel;
  groups_.resize(kKinds);
  group_of_rank_.assign(kKinds, std::vector<int>(static_cast<std::size_t>(size_), -1));
  // A key's coordinates, each below size_ + 1, as one number: a mesh of thousands of ranks
  // is built for every prediction, and a key allocated per rank and kind was most of its time.
  const std::int64_t base = std::int64_t{size_} + 1;
  const auto encode = [base](int a, int b, int c) { return (a * base + b) * base + c; };
  for (int k = 0; k < kKinds; ++k) {
    const auto kind = static_cast<GroupKind>(k);
    // Ranks with equal keys share a group; ranks join in rank order, so ranks within a group
    // are in mesh order, and groups are numbered by their first rank ("tp0" holds rank 0).
    std::unordered_map<std::int64_t, int> index;
    std::vector<std::vector<rt::DeviceId>> members;
    for (int r = 0; r < size_; ++r) {
      const MeshCoordinates c = coordinates(r);
      std::int64_t key = 0;
      switch (kind) {
        case GroupKind::tensor:
          key = encode(c.cp, c.dp, c.pp);
          break;
        case GroupKind::context:
          key = encode(c.tp, c.dp, c.pp);
          break;
        case GroupKind::data:
          key = encode(c.tp, c.cp, c.pp);
          break;
        case GroupKind::data_context:
          key = encode(0, c.tp, c.pp);
          break;
        case GroupKind::expert:
          key = encode(c.edp, c.pp, experts_split() ? c.tp : 0);
          break;
        case GroupKind::expert_data:
          key = encode(c.ep, c.pp, experts_split() ? c.tp : 0);
          break;
        case GroupKind::pipeline:
          key = encode(c.tp, c.cp, c.dp);
          break;
        case GroupKind::tensor_context:
          key = encode(0, c.dp, c.pp);
          break;
      }
      const auto [at, fresh] = index.try_emplace(key, static_cast<int>(members.size()));
      if (fresh) members.emplace_back();
      members[static_cast<std::size_t>(at->second)].push_back(static_cast<rt::DeviceId>(r));
      group_of_rank_[k][static_cast<std::size_t>(r)] = at->second;
    }
    groups_[k].reserve(members.size());
    for (std::size_t g = 0; g < members.size(); ++g)
      groups_[k].emplace_back(fmt::format("{}{}", prefix(kind), g), std::move(members[g]));
  }
}

MeshCoordinates Mesh::coordinates(int rank) const {
  if (rank < 0 || rank >= size_)
    throw std::out_of_range(fmt::format("rank {} is outside the mesh of {} devices", rank, size_));
  MeshCoordinates c;
  int rest = rank;
  c.tp = rest % plan_.tensor_parallel;
  rest /= plan_.tensor_parallel;
  c.cp = rest % plan_.context_parallel;
  rest /= plan_.context_parallel;
  c.dp = rest % plan_.data_parallel;
  c.pp = rest / plan_.data_parallel;
  const int in_stage =
      experts_split()
          ? (rank / plan_.tensor_parallel) % (plan_.context_parallel * plan_.data_parallel)
          : rank % (plan_.tensor_parallel * plan_.context_parallel * plan_.data_parallel);
  c.ep = in_stage % plan_.expert_parallel;
  c.edp = in_stage / plan_.expert_parallel;
  return c;
}

int Mesh::rank_of(int tp, int cp, int dp, int pp) const {
  return tp +
         plan_.tensor_parallel * (cp + plan_.context_parallel * (dp + plan_.data_parallel * pp));
}

const devices::ProcessGroup& Mesh::group(GroupKind kind, int rank) const {
  const auto k = static_cast<int>(kind);
  return groups_[k][group_of_rank_[k].at(static_cast<std::size_t>(rank))];
}

const std::vector<devices::ProcessGroup>& Mesh::groups(GroupKind kind) const {
  return groups_[static_cast<int>(kind)];
}

}  // namespace weave::graphs
