#include "gradient_buckets.hpp"

namespace weave::graphs {

void reduce_buckets(RankProgram& P, const std::string& point, TaskId after) {
  const rt::TaskTags tags{.phase = rt::Phase::backward};
  for (GradientBucket& bucket : P.shard().buckets()) {
    if (bucket.name.rfind(point + "/", 0) != 0) continue;
    TaskId ready = after;
    auto chain = [&ready](TaskId reduced) {
      if (reduced != rt::kNoTask) ready = reduced;
    };
    if (bucket.reduction == GradientReduction::tensor_partial)
      chain(P.tensor_gradients.all_reduce(ready, all_of(bucket.grads), devices::ReduceOp::sum,
                                          bucket.name + ".tp", tags));
    const GroupHandle& replicas = bucket.expert ? P.expert_data : P.data;
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
