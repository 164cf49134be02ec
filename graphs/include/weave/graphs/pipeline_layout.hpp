// How a training step's pipeline is laid out: the schedule its stages run and the layers each
// model chunk holds.
//
// With p pipeline ranks and v chunks per rank the model is cut into K = p v chunks of
// consecutive layers; chunk k is global stage k of the schedule, so it sits on rank k mod p
// (interleaved) or, for zb-v's V, on rank k for k < p and 2p - 1 - k after. Chunk 0 also holds
// the embedding, chunk K - 1 the final norm and the loss.
#pragma once

#include <vector>

#include "weave/graphs/model_config.hpp"
#include "weave/graphs/model_shard.hpp"
#include "weave/graphs/parallel_plan.hpp"
#include "weave/graphs/pipeline_schedule.hpp"
#include "weave/graphs/pipeline_schedule_generators.hpp"

namespace weave::graphs {

struct PipelineLayout {
  PipelineSchedule schedule;     // per pipeline rank, the actions its stage runs
  std::vector<int> chunk_begin;  // K + 1 entries: chunk k holds [chunk_begin[k], chunk_begin[k+1])

  int chunks() const { return static_cast<int>(chunk_begin.size()) - 1; }
  int first_layer(int chunk) const { return chunk_begin.at(static_cast<std::size_t>(chunk)); }
  int end_layer(int chunk) const { return chunk_begin.at(static_cast<std::size_t>(chunk) + 1); }
  // The pipeline rank that runs model chunk k.
  int rank_of(int chunk) const { return schedule.rank_of(chunk); }
  // What pipeline rank `pp` holds of the model.
  StageContents contents(int pp) const;
};

// The layers [begin, end) whose forward full recomputation runs again together before the
// backward of the last of them (ModelConfig::recompute): with method uniform, the groups of
// recompute.num_layers consecutive layers of each model chunk (the last group of a chunk may be
// shorter); with block, each of a chunk's first recompute.num_layers layers alone. The group
// keeps only its input. Empty (begin == end) for a layer kept whole.
struct RecomputeGroup {
  int begin = 0, end = 0;
  bool empty() const { return begin == end; }
  int size() const { return end - begin; }
};
RecomputeGroup recompute_group(const Recompute& recompute, const PipelineLayout& layout, int layer);

// The schedule the plan names (1f1b by default, interleaved with virtual stages) for its micro-
// batches, and the layer split. Throws ConfigError naming the rule and the flags for a split or
// schedule that cannot be made.
PipelineLayout make_pipeline_layout(const ModelConfig& model, const ParallelPlan& plan);

// The schedule kind the plan asks for.
ScheduleKind pipeline_schedule_kind(const ParallelPlan& plan);

}  // namespace weave::graphs
