#include "step/gradient_buckets.hpp"

namespace weave::graphs {

void reduce_buckets(RankProgram& P, const std::string& point, TaskId after) {
  const rt::TaskTags tags{.phase = rt::Phase::backward};
  // The gradients are reduced in the precision they are accumulated in (ParameterBytes).
  const auto gradient_bytes =
      static_cast<std::size_t>(parameter_bytes(P.shape.model.precision).gradient);
  const GroupHandle tensor = P.tensor_gradients.with_element_bytes(gradient_bytes);
  const GroupHandle data = P.data.with_element_bytes(gradient_bytes);
  const GroupHandle expert_data = P.expert_data.with_element_bytes(gradient_bytes);
  for (GradientBucket& bucket : P.shard().buckets()) {
    if (bucket.name.rfind(point + "/", 0) != 0) continue;
    TaskId ready = after;
    auto chain = [&ready](TaskId reduced) {
      if (reduced != rt::kNoTask) ready = reduced;
    };
    if (bucket.reduction == GradientReduction::tensor_partial)
      chain(tensor.all_reduce(ready, all_of(bucket.grads), devices::ReduceOp::sum,
                              bucket.name + ".tp", tags));
    const GroupHandle& replicas = bucket.expert ? expert_data : data;
    if (!bucket.sharded) {
      replicas.all_reduce(ready, all_of(bucket.grads), devices::ReduceOp::sum, bucket.name + ".dp",
                          tags);
      continue;
    }
    // Distributed optimizer: each replica receives only its shard, reduced.
    replicas.reduce_scatter(ready, read_of(bucket.grads),
                            all_of(bucket.grads.slice(0, bucket.shard_begin, bucket.shard_size)),
                            bucket.name + ".dp", tags);
  }
}

}  // namespace weave::graphs
