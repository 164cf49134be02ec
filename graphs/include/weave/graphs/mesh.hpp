// The device mesh: which device holds which coordinate of each parallel dimension, and the
// process groups between them. The one owner of ranks and groups; everything else asks it.
//
// Rank order follows Megatron-LM: tensor-parallel fastest, then context-parallel, then
// data-parallel, then pipeline: rank = tp + TP (cp + CP (dp + DP pp)). Device d holds rank d.
// Expert parallelism folds over the tp x cp x dp ranks of a pipeline stage when experts are whole
// (expert tensor parallelism 1): in the stage's rank order, ep is fastest and the
// expert-data-parallel index next, so each expert-parallel group is `ep` consecutive ranks. When
// experts are split over the tensor-parallel group (expert tensor parallelism = tp), the
// expert-parallel groups fold over cp x dp among the ranks of one tensor-parallel rank.
#pragma once

#include <vector>

#include "weave/devices/process_group.hpp"
#include "weave/graphs/parallel_plan.hpp"

namespace weave::graphs {

struct MeshCoordinates {
  int tp = 0, cp = 0, dp = 0, pp = 0;
  int ep = 0;   // rank within its expert-parallel group
  int edp = 0;  // rank within its expert-data-parallel group (replicas of the same experts)
};

enum class GroupKind {
  tensor,          // same cp, dp, pp
  context,         // same tp, dp, pp
  data,            // same tp, cp, pp
  data_context,    // same tp, pp: dense gradients are reduced over dp x cp
  expert,          // an expert-parallel group
  expert_data,     // replicas of the same experts: their gradients are reduced here
  pipeline,        // same tp, cp, dp
  tensor_context,  // same dp, pp: the ranks that share one micro-batch's sequences
};

class Mesh {
 public:
  explicit Mesh(const ParallelPlan& plan);

  int size() const { return size_; }
  const ParallelPlan& plan() const { return plan_; }
  MeshCoordinates coordinates(int rank) const;
  int rank_of(int tp, int cp, int dp, int pp) const;
  // Whether every expert is split over the tensor-parallel group (expert tensor parallelism).
  bool experts_split() const {
    return plan_.expert_tensor_parallel > 1 && plan_.tensor_parallel > 1;
  }

  // The group of `kind` that `rank` belongs to.
  const devices::ProcessGroup& group(GroupKind kind, int rank) const;
  // Every group of `kind`, each once.
  const std::vector<devices::ProcessGroup>& groups(GroupKind kind) const;

 private:
  ParallelPlan plan_;
  int size_;
  int expert_data_;
  std::vector<std::vector<devices::ProcessGroup>> groups_;  // by kind
  std::vector<std::vector<int>> group_of_rank_;             // by kind, by rank
};

}  // namespace weave::graphs
