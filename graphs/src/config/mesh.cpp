#include "weave/graphs/mesh.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <stdexcept>

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
  for (int k = 0; k < kKinds; ++k) {
    const auto kind = static_cast<GroupKind>(k);
    // Ranks with equal keys share a group; ranks join in rank order, so ranks within a group
    // are in mesh order.
    std::map<std::vector<int>, std::vector<rt::DeviceId>> members;
    std::vector<std::vector<int>> key_of(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) {
      const MeshCoordinates c = coordinates(r);
      std::vector<int> key;
      switch (kind) {
        case GroupKind::tensor:
          key = {c.cp, c.dp, c.pp};
          break;
        case GroupKind::context:
          key = {c.tp, c.dp, c.pp};
          break;
        case GroupKind::data:
          key = {c.tp, c.cp, c.pp};
          break;
        case GroupKind::data_context:
          key = {c.tp, c.pp};
          break;
        case GroupKind::expert:
          key = {c.edp, c.pp, experts_split() ? c.tp : 0};
          break;
        case GroupKind::expert_data:
          key = {c.ep, c.pp, experts_split() ? c.tp : 0};
          break;
        case GroupKind::pipeline:
          key = {c.tp, c.cp, c.dp};
          break;
        case GroupKind::tensor_context:
          key = {c.dp, c.pp};
          break;
      }
      members[key].push_back(static_cast<rt::DeviceId>(r));
      key_of[r] = key;
    }
    std::map<std::vector<int>, int> index;
    // Number groups by their first rank, so "tp0" holds rank 0.
    std::vector<std::pair<rt::DeviceId, std::vector<int>>> order;
    for (const auto& [key, devs] : members)
      order.emplace_back(devs.front(), key);
    std::sort(order.begin(), order.end());
    for (const auto& [first, key] : order) {
      index[key] = static_cast<int>(groups_[k].size());
      groups_[k].emplace_back(fmt::format("{}{}", prefix(kind), groups_[k].size()), members[key]);
    }
    for (int r = 0; r < size_; ++r)
      group_of_rank_[k][r] = index[key_of[r]];
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
