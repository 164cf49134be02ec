// The parallel plans of a configuration and their ranking (weave predict --advise): the fastest
// is the minimum over the same candidates predicted one by one, a candidate that does not fit
// is discarded, refusals are counted by their rule.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <string>

#include "tiny_model.hpp"
#include "weave/graphs/plan_search.hpp"

namespace weave::graphs {
namespace {

TrainerConfig base_config(int experts, int devices, int global_batch) {
  TrainerConfig c;
  c.model = tiny(experts);
  c.model.num_layers = 4;
  c.plan = {.data_parallel = devices, .micro_batch_size = 1, .global_batch_size = global_batch};
  c.machine = {.device_flops = 1e12, .device_memory_bandwidth = 1e11, .link = "nvlink4"};
  return c;
}

constexpr std::int64_t kUnlimited = std::numeric_limits<std::int64_t>::max();

TEST(PlanSearch, RanksByThePredictionOfEachCandidate) {
  const TrainerConfig base = base_config(0, 4, 8);
  const PlanCandidates candidates = enumerate_plans(base);
  ASSERT_GT(candidates.configs.size(), 8u);
  double fastest = std::numeric_limits<double>::infinity();
  int built = 0;
  for (const TrainerConfig& c : candidates.configs) {
    EXPECT_EQ(c.plan.devices(), 4);
    EXPECT_EQ(c.plan.global_batch_size, 8);
    // Cheapest to predict first: the ranks a folded prediction builds (data-parallel replicas,
    // tensor- and context-parallel peers folded) never decrease.
    const int ranks = c.plan.pipeline_parallel;
    EXPECT_GE(ranks, built);
    built = ranks;
    try {
      fastest = std::min(fastest, predict_step(c).step_ms);
    } catch (const ConfigError&) {
      // refused while building; rank_plans counts it
    }
  }
  const PlanRanking ranking = rank_plans(candidates.configs, {.device_memory_bytes = kUnlimited});
  ASSERT_FALSE(ranking.fitting.empty());
  EXPECT_EQ(ranking.fitting.front().step_ms, fastest);
  EXPECT_TRUE(std::is_sorted(
      ranking.fitting.begin(), ranking.fitting.end(),
      [](const PlanOutcome& a, const PlanOutcome& b) { return a.step_ms < b.step_ms; }));
  int refused = 0;
  for (const RefusalCount& r : ranking.refused)
    refused += r.candidates;
  EXPECT_EQ(ranking.predicted + refused, static_cast<int>(candidates.configs.size()));
  // The plans searched: pipelines with their schedules, recomputation, tensor parallelism with
  // sequence parallelism.
  auto any = [&](auto pred) {
    return std::any_of(candidates.configs.begin(), candidates.configs.end(), pred);
  };
  EXPECT_TRUE(any([](const TrainerConfig& c) { return c.plan.pipeline_scheduler == "zb-h1"; }));
  EXPECT_TRUE(any([](const TrainerConfig& c) {
    return c.plan.pipeline_scheduler == "interleaved" && c.plan.virtual_pipeline == 2;
  }));
  EXPECT_TRUE(any([](const TrainerConfig& c) { return c.model.recompute.full(); }));
  EXPECT_TRUE(any([](const TrainerConfig& c) { return c.plan.context_parallel == 2; }));
  EXPECT_TRUE(any([](const TrainerConfig& c) {
    return c.plan.tensor_parallel == 4 && c.plan.sequence_parallel;
  }));
}

TEST(PlanSearch, DiscardsWhatDoesNotFit) {
  const TrainerConfig base = base_config(0, 4, 8);
  const PlanCandidates candidates = enumerate_plans(base);
  const PlanRanking all = rank_plans(candidates.configs, {.device_memory_bytes = kUnlimited});
  std::int64_t least = kUnlimited, most = 0;
  for (const PlanOutcome& o : all.fitting) {
    least = std::min(least, o.memory_per_device);
    most = std::max(most, o.memory_per_device);
  }
  ASSERT_LT(least, most);
  const std::int64_t capacity = (least + most) / 2;
  const PlanRanking ranking = rank_plans(candidates.configs, {.device_memory_bytes = capacity});
  EXPECT_GT(ranking.too_large, 0);
  ASSERT_FALSE(ranking.fitting.empty());
  double fastest_fitting = std::numeric_limits<double>::infinity();
  for (const PlanOutcome& o : all.fitting)
    if (o.memory_per_device <= capacity) fastest_fitting = std::min(fastest_fitting, o.step_ms);
  EXPECT_EQ(ranking.fitting.front().step_ms, fastest_fitting);
  for (const PlanOutcome& o : ranking.fitting) {
    EXPECT_TRUE(o.fits);
    EXPECT_LE(o.memory_per_device, capacity);
  }
  EXPECT_EQ(ranking.too_large + static_cast<int>(ranking.fitting.size()),
            static_cast<int>(all.fitting.size()));
}

// A flag without effect keeps the rule the flag table declares with it: beside one MindSpeed's
// Ampipe refuses, the Ampipe candidates are refused, as a run given it would be.
TEST(PlanSearch, FlagsWithoutEffectKeepTheirRules) {
  const TrainerConfig moe = base_config(8, 4, 8);
  TrainerConfig overlapped = moe;  // --overlap-grad-reduce, which the plan holds
  overlapped.plan.overlap_grad_reduce = true;
  auto any_ampipe = [](const PlanCandidates& c) {
    return std::any_of(c.configs.begin(), c.configs.end(),
                       [](const TrainerConfig& x) { return x.plan.ampipe_degree == 2; });
  };
  const PlanCandidates overlap = enumerate_plans(overlapped, {});
  EXPECT_FALSE(any_ampipe(overlap));
  EXPECT_TRUE(
      std::any_of(overlap.refused.begin(), overlap.refused.end(), [](const RefusalCount& r) {
        return r.reason.find("cannot run with --overlap-grad-reduce") != std::string::npos;
      }));
  EXPECT_TRUE(any_ampipe(enumerate_plans(moe, {.flags_without_effect = {"--use-flash-attn"}})));
  EXPECT_FALSE(any_ampipe(enumerate_plans(moe, {.flags_without_effect = {"--use-nanopipe"}})));
}

TEST(PlanSearch, CountsRefusalsBySkippedAndLimited) {
  // 8 experts over 4 devices: expert-parallel sizes of 8 cannot be carved out of 4 ranks.
  const TrainerConfig moe = base_config(8, 4, 8);
  const PlanCandidates candidates = enumerate_plans(moe);
  ASSERT_FALSE(candidates.refused.empty());
  const auto ep =
      std::find_if(candidates.refused.begin(), candidates.refused.end(), [](const RefusalCount& r) {
        return r.reason.starts_with("--expert-model-parallel-size (N) must divide");
      });
  ASSERT_NE(ep, candidates.refused.end());
  EXPECT_GT(ep->candidates, 0);
  EXPECT_TRUE(std::any_of(candidates.configs.begin(), candidates.configs.end(),
                          [](const TrainerConfig& c) { return c.plan.ampipe_degree == 2; }));
  // A global batch of 2 over 4 devices: data-parallel sizes of 4 are not tried.
  const PlanCandidates small_batch = enumerate_plans(base_config(0, 4, 2));
  EXPECT_GT(small_batch.skipped_global_batch, 0);
  for (const TrainerConfig& c : small_batch.configs)
    EXPECT_LE(c.plan.data_parallel, 2);
  // A candidate limit predicts the first ones and counts the rest.
  const PlanRanking limited =
      rank_plans(candidates.configs, {.device_memory_bytes = kUnlimited, .max_predictions = 3});
  int refused = 0;
  for (const RefusalCount& r : limited.refused)
    refused += r.candidates;
  EXPECT_EQ(limited.predicted + refused, 3);
  EXPECT_EQ(limited.not_predicted, static_cast<int>(candidates.configs.size()) - 3);
  // A tensor-parallel limit (a node's devices) holds.
  for (const TrainerConfig& c : enumerate_plans(moe, {.max_tensor_parallel = 2}).configs)
    EXPECT_LE(c.plan.tensor_parallel, 2);
}

// What --advise's memory budget counts: each candidate's estimate, made before it is built,
// bounds what its prediction built (counted by prediction_memory_bytes, as the estimate is), and
// stays within a few times it, dense and MoE, under every parallelism and schedule searched.
TEST(PlanSearch, EstimatesBoundWhatEachPredictionBuilds) {
  for (const int experts : {0, 8}) {
    SCOPED_TRACE(experts);
    const PredictionOptions folded{.fold_micro_batches = true};
    const PlanRanking ranking =
        rank_plans(enumerate_plans(base_config(experts, 4, 8)).configs,
                   {.device_memory_bytes = kUnlimited, .prediction = folded});
    ASSERT_GT(ranking.fitting.size(), 20u);
    for (const PlanOutcome& o : ranking.fitting) {
      EXPECT_GT(o.tasks_built, 0);
      EXPECT_LE(prediction_memory_bytes(o.tasks_built, o.config.plan.devices()),
                prediction_memory_bound(o.config, folded))
          << plan_flags(o.config);
      EXPECT_LE(prediction_tasks_bound(o.config, folded), 4 * o.tasks_built)
          << plan_flags(o.config);
    }
  }
}

TEST(PlanSearch, FlagsNameThePlan) {
  TrainerConfig c = base_config(8, 8, 8);
  c.plan = {.tensor_parallel = 2,
            .sequence_parallel = true,
            .expert_parallel = 4,
            .data_parallel = 2,
            .pipeline_parallel = 2,
            .virtual_pipeline = 2,
            .pipeline_scheduler = "interleaved",
            .micro_batch_size = 1,
            .global_batch_size = 8,
            .ampipe_degree = 2};
  c.model.recompute = {.granularity = RecomputeGranularity::full,
                       .method = RecomputeMethod::uniform,
                       .num_layers = 1};
  EXPECT_EQ(plan_flags(c),
            "--devices 8 --tensor-model-parallel-size 2 --sequence-parallel "
            "--context-parallel-size 1 --pipeline-model-parallel-size 2 "
            "--expert-model-parallel-size 4 --pipeline-scheduler interleaved "
            "--virtual-pipeline-model-parallel-size 2 --ampipe-degree 2 --recompute-granularity "
            "full --recompute-method uniform --recompute-num-layers 1 --global-batch-size 8");
}

}  // namespace
}  // namespace weave::graphs
