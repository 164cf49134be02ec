#include "step/parameter_slots.hpp"

#include <fmt/format.h>

namespace weave::graphs {

namespace {

// The parameter slot layer l's values are gathered into: the stage's layers take the units in
// flight in turn.
int parameter_slot(RankProgram& P, int l) {
  return P.shard().parameter_slot(l);
}

// Issues layer l's gathers into its slot, after the slot's releases; returns them. A slot still
// holding layer l's values (gathered earlier in the step, not gathered over since) is not
// gathered again.
const std::vector<TaskId>& gather_layer(RankProgram& P, int l, const rt::TaskTags& tags) {
  RankProgram::ParameterSlot& S = P.parameter_slots[parameter_slot(P, l)];
  if (S.layer == l) return S.gathers;
  S.layer = l;
  S.gathers.clear();
  const std::string prefix = fmt::format("layers.{}.", l);
  for (GradientBucket& bucket : P.shard().buckets()) {
    if (!bucket.values_staged || bucket.name.rfind(prefix, 0) != 0) continue;
    const GroupHandle& replicas = bucket.expert ? P.expert_data : P.data;
    // A materialized bf16 run gathers the shard as the last update rounded it (or as built or
    // loaded) straight into the 16-bit slot, two values to each 4-byte element the collective
    // moves; predicted, the shard's shape, at the group's 2 bytes an element in a 16-bit run: the
    // same bytes. Nothing at the step's start precedes a gather, in either: the one graph.
    const TaskId gather =
        bucket.values16.has_storage()
            ? replicas.all_gather_halves(rt::kNoTask, bucket.value_shard16, bucket.values16,
                                         bucket.name + ".gather", tags)
            : replicas.all_gather(rt::kNoTask, read_of(bucket.value_shard), all_of(bucket.values),
                                  bucket.name + ".gather", tags);
    for (const TaskId release : S.releases)
      P.after(release, gather);
    S.gathers.push_back(gather);
  }
  S.releases.clear();
  return S.gathers;
}

}  // namespace

void acquire_layer_parameters(RankProgram& P, int layer, int next, const rt::TaskTags& tags) {
  if (!P.shard().parameters_sharded(layer)) return;
  P.await(gather_layer(P, layer, tags));
  // The gathers of the layers the pass reaches next, one fewer than the units in flight, on the
  // replicas' stream now, so that they run under this layer's compute; each into a slot a layer
  // before this one has released (with two units, the next layer into the other slot). One unit
  // in flight prefetches nothing: the next layer's gather waits for this one's release.
  if (next < 0) return;
  const int direction = next - layer;
  const int ahead = P.shape.plan.zero_units_in_flight - 1;
  for (int k = 0, l = next; k < ahead; ++k, l += direction) {
    if (l < 0 || !P.shard().parameters_sharded(l) ||
        parameter_slot(P, l) == parameter_slot(P, layer))
      break;
    gather_layer(P, l, tags);
  }
}

void release_layer_parameters(RankProgram& P, int layer, const rt::TaskTags& tags) {
  if (!P.shard().parameters_sharded(layer)) return;
  // On the compute stream, whose tasks run in the order they were added: after every task of the
  // layer's pass that read its values.
  const TaskId done = P.graph.add({.device = static_cast<rt::DeviceId>(P.rank),
                                   .stream = rt::kComputeStream,
                                   .kind = rt::TaskKind::host,
                                   .name = "param_slot_release",
                                   .tags = tags},
                                  [](rt::TaskContext&) {});
  P.parameter_slots[parameter_slot(P, layer)].releases.push_back(done);
}

}  // namespace weave::graphs
