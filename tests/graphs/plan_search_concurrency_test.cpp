// weave predict --advise predicts its candidates side by side (PlanRankingOptions::
// concurrent_predictions): the ranking is the one a prediction at a time makes. Run under
// ThreadSanitizer in CI, as the predictions share nothing but the progress callback.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <vector>

#include "tiny_model.hpp"
#include "weave/graphs/plan_search.hpp"
#include "weave/graphs/prediction.hpp"

namespace weave::graphs {
namespace {

constexpr std::int64_t kUnlimited = std::numeric_limits<std::int64_t>::max();
constexpr int kPredicted = 8;  // the cheapest candidates: enough to rank, quick under sanitizers

TrainerConfig dense_on_four_devices() {
  TrainerConfig c;
  c.model = tiny(0);
  c.model.num_layers = 4;
  c.plan = {.data_parallel = 4, .micro_batch_size = 1, .global_batch_size = 8};
  c.machine = {.device_flops = 1e12, .device_memory_bandwidth = 1e11, .link = "nvlink4"};
  return c;
}

// Predictions side by side rank the candidates as one at a time does: the same outcomes in the
// same order, the same refusals, progress reported once per candidate up to the count.
TEST(PlanSearch, ConcurrentPredictionsRankAsOneAtATime) {
  const PlanCandidates candidates = enumerate_plans(dense_on_four_devices());
  ASSERT_GT(candidates.configs.size(), std::size_t{kPredicted});
  std::vector<int> reported;
  auto rank = [&](int concurrent) {
    reported.clear();
    return rank_plans(candidates.configs, {.device_memory_bytes = kUnlimited,
                                           .max_predictions = kPredicted,
                                           .concurrent_predictions = concurrent,
                                           .progress = [&](int done, int total) {
                                             EXPECT_EQ(total, kPredicted);
                                             reported.push_back(done);
                                           }});
  };
  const PlanRanking alone = rank(1), side_by_side = rank(3);
  std::vector<int> counts(kPredicted);
  std::iota(counts.begin(), counts.end(), 1);
  EXPECT_EQ(reported, counts);
  ASSERT_EQ(alone.fitting.size(), side_by_side.fitting.size());
  ASSERT_GE(alone.fitting.size(), 4u);
  for (std::size_t i = 0; i < alone.fitting.size(); ++i) {
    EXPECT_EQ(plan_flags(alone.fitting[i].config), plan_flags(side_by_side.fitting[i].config));
    EXPECT_EQ(alone.fitting[i].step_ms, side_by_side.fitting[i].step_ms);
    EXPECT_EQ(alone.fitting[i].memory_per_device, side_by_side.fitting[i].memory_per_device);
  }
  EXPECT_EQ(alone.predicted, side_by_side.predicted);
  ASSERT_EQ(alone.refused.size(), side_by_side.refused.size());
  for (std::size_t i = 0; i < alone.refused.size(); ++i) {
    EXPECT_EQ(alone.refused[i].reason, side_by_side.refused[i].reason);
    EXPECT_EQ(alone.refused[i].candidates, side_by_side.refused[i].candidates);
  }
}

// A memory budget admits predictions side by side while their estimates fit beside those
// running: smaller than any estimate, one at a time, ranked as with no budget; two estimates'
// worth, never their estimates past it.
TEST(PlanSearch, AMemoryBudgetAdmitsPredictionsWhileTheyFit) {
  const PlanCandidates candidates = enumerate_plans(dense_on_four_devices());
  const PlanRankingOptions unlimited{.device_memory_bytes = kUnlimited,
                                     .max_predictions = kPredicted,
                                     .concurrent_predictions = 3};
  const PlanRanking free = rank_plans(candidates.configs, unlimited);
  PlanRankingOptions tiny_budget = unlimited;
  tiny_budget.memory_budget_bytes = 1;
  const PlanRanking alone = rank_plans(candidates.configs, tiny_budget);
  EXPECT_EQ(alone.most_side_by_side, 1);
  ASSERT_EQ(alone.fitting.size(), free.fitting.size());
  ASSERT_GE(alone.fitting.size(), 4u);
  for (std::size_t i = 0; i < alone.fitting.size(); ++i) {
    EXPECT_EQ(plan_flags(alone.fitting[i].config), plan_flags(free.fitting[i].config));
    EXPECT_EQ(alone.fitting[i].step_ms, free.fitting[i].step_ms);
    EXPECT_EQ(alone.fitting[i].memory_per_device, free.fitting[i].memory_per_device);
  }
  EXPECT_EQ(alone.predicted, free.predicted);
  EXPECT_EQ(alone.too_large, free.too_large);
  ASSERT_EQ(alone.refused.size(), free.refused.size());
  for (std::size_t i = 0; i < alone.refused.size(); ++i) {
    EXPECT_EQ(alone.refused[i].reason, free.refused[i].reason);
    EXPECT_EQ(alone.refused[i].candidates, free.refused[i].candidates);
  }
  std::int64_t largest = 0;  // of the candidates predicted
  for (int i = 0; i < kPredicted; ++i)
    largest =
        std::max(largest, prediction_memory_bound(candidates.configs[static_cast<std::size_t>(i)]));
  PlanRankingOptions two = unlimited;
  two.memory_budget_bytes = 2 * largest;
  const PlanRanking pairs = rank_plans(candidates.configs, two);
  EXPECT_GE(pairs.most_side_by_side, 1);
  EXPECT_LE(pairs.most_estimated_bytes, two.memory_budget_bytes);
  EXPECT_EQ(pairs.predicted, free.predicted);
  ASSERT_EQ(pairs.fitting.size(), free.fitting.size());
  for (std::size_t i = 0; i < pairs.fitting.size(); ++i)
    EXPECT_EQ(pairs.fitting[i].step_ms, free.fitting[i].step_ms);
}

}  // namespace
}  // namespace weave::graphs
