#include "weave/graphs/pipeline_layout.hpp"

#include <algorithm>

#include <fmt/format.h>

namespace weave::graphs {

StageContents PipelineLayout::contents(int pp) const {
  StageContents c;
  c.layers.assign(static_cast<std::size_t>(chunk_begin.back()), false);
  c.input_embedding = c.output_layer = false;
  for (int k = 0; k < chunks(); ++k) {
    if (rank_of(k) != pp) continue;
    for (int l = first_layer(k); l < end_layer(k); ++l)
      c.layers[static_cast<std::size_t>(l)] = true;
    if (k == 0) c.input_embedding = true;
    if (k == chunks() - 1) c.output_layer = true;
  }
  return c;
}

ScheduleKind pipeline_schedule_kind(const ParallelPlan& plan) {
  if (plan.pipeline_scheduler.empty())
    return plan.virtual_pipeline > 1 ? ScheduleKind::Interleaved : ScheduleKind::OneFOneB;
  try {
    return schedule_kind(plan.pipeline_scheduler);
  } catch (const ScheduleError& e) {
    throw ConfigError(fmt::format("--pipeline-scheduler: {}", e.what()));
  }
}

RecomputeGroup recompute_group(const Recompute& recompute, const PipelineLayout& layout,
                               int layer) {
  if (!recompute.full()) return {};
  int chunk = 0;
  while (layout.end_layer(chunk) <= layer)
    ++chunk;
  const int first = layout.first_layer(chunk), end = layout.end_layer(chunk);
  const int n = recompute.num_layers;
  if (recompute.method == RecomputeMethod::block)
    return layer - first < n ? RecomputeGroup{layer, layer + 1} : RecomputeGroup{};
  const int begin = first + (layer - first) / n * n;
  return {begin, std::min(begin + n, end)};
}

PipelineLayout make_pipeline_layout(const ModelConfig& m, const ParallelPlan& plan) {
  const int p = plan.pipeline_parallel, v = plan.virtual_pipeline, K = p * v, L = m.num_layers;
  const ScheduleKind kind = pipeline_schedule_kind(plan);
  PipelineLayout out;
  try {
    out.schedule = make_schedule(kind, {.ranks = p,
                                        .micro_batches = plan.micro_batches(),
                                        .chunks = v,
                                        .group_size = plan.microbatch_group_size});
  } catch (const ScheduleError& e) {
    throw ConfigError(fmt::format(
        "the pipeline schedule cannot run this step ({} micro-batches = --global-batch-size / "
        "(--micro-batch-size x data-parallel size)): {}",
        plan.micro_batches(), e.what()));
  }
  const int first = plan.first_stage_layers, last = plan.last_stage_layers;
  if (first < 0 || last < 0)
    throw ConfigError(fmt::format(
        "--decoder-first-pipeline-num-layers ({}) and --decoder-last-pipeline-num-layers ({}) "
        "must be >= 1, or 0 for an even split",
        first, last));
  if ((first > 0 || last > 0) && K == 1)
    throw ConfigError(
        "--decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers need "
        "--pipeline-model-parallel-size > 1");
  std::vector<int> layers(static_cast<std::size_t>(K), 0);
  const int fixed = (first > 0) + (last > 0);
  const int rest = L - first - last, shared = K - fixed;
  if (shared == 0 ? rest != 0 : rest < shared || rest % shared != 0) {
    if (fixed == 0)
      throw ConfigError(fmt::format(
          "--num-layers ({}) must be divisible by --pipeline-model-parallel-size x virtual "
          "stages per rank ({} x {} = {} model chunks{}); or give the first and last chunks their "
          "own counts with --decoder-first-pipeline-num-layers / "
          "--decoder-last-pipeline-num-layers",
          L, p, v, K, kind == ScheduleKind::ZeroBubbleV ? ": zb-v runs 2 chunks per rank" : ""));
    throw ConfigError(fmt::format(
        "--num-layers ({}) minus the first chunk's {} and the last chunk's {} leaves {} layers, "
        "which must split evenly (at least one each) over the other {} model chunks "
        "(--pipeline-model-parallel-size {} x {} virtual stages)",
        L, first, last, rest, shared, p, v));
  }
  for (int k = 0; k < K; ++k)
    layers[static_cast<std::size_t>(k)] = shared > 0 ? rest / shared : 0;
  if (first > 0) layers.front() = first;
  if (last > 0) layers.back() = last;
  out.chunk_begin.assign(1, 0);
  for (int k = 0; k < K; ++k)
    out.chunk_begin.push_back(out.chunk_begin.back() + layers[static_cast<std::size_t>(k)]);
  return out;
}

}  // namespace weave::graphs
