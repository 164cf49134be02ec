// The communication streams of a training step, classified by the process group whose
// collectives they carry. The class is the stream's rt::StreamKind, given where the group's
// stream is made, so reports (a prediction's exposed communication per group) group streams by it
// and never by parsing their names; the names stay what people and traces read.
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "weave/runtime/task_table.hpp"
#include "weave/runtime/types.hpp"

namespace weave::graphs {

enum class CommGroup : rt::StreamKind {
  unclassified = rt::kUnclassifiedStream,
  tensor,          // "tp" and the gradient buckets' "tp_grad"
  context,         // "cp"
  data_context,    // "dp_cp"
  expert,          // "ep" and Ampipe's pipe experts' "ep_dispatch", "ep_combine"
  expert_data,     // "edp"
  tensor_context,  // "tp_cp"
  pipeline,        // "pipeline_activations<stage>", "pipeline_gradients<stage>"
  embedding,       // the tied embedding's first and last stage
  world,           // every rank: the gradient norm's sum
};

inline constexpr rt::StreamKind stream_kind(CommGroup group) {
  return static_cast<rt::StreamKind>(group);
}

// How reports name a group's streams, by CommGroup: "" for an unclassified stream.
inline constexpr std::array<std::string_view, 10> kCommGroupNames{
    "", "tp", "cp", "dp_cp", "ep", "edp", "tp_cp", "pipeline", "embedding", "world"};
static_assert(kCommGroupNames.size() == stream_kind(CommGroup::world) + 1u,
              "a name for every CommGroup");

inline std::string_view to_string(CommGroup group) {
  return kCommGroupNames[static_cast<std::size_t>(group)];
}

// The group a stream of `kind` serves: unclassified for a kind that names none.
inline CommGroup comm_group_of(rt::StreamKind kind) {
  return kind <= stream_kind(CommGroup::world) ? static_cast<CommGroup>(kind)
                                               : CommGroup::unclassified;
}

// A trace's communication streams by the process group each was made for (its CommGroup), as
// reports name the groups: tp with its gradient stream, ep with its dispatch and combine streams,
// both directions of every pipeline stage; an unclassified stream stands alone under its own name.
// Groups in the order of their first stream.
std::vector<std::pair<std::string, std::vector<rt::StreamId>>> streams_by_group(
    const rt::TaskTable& tasks);

}  // namespace weave::graphs
