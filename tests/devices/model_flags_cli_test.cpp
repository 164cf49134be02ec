// The modern decoder's flags on the command line: taken as Megatron-LM spells them, and every
// value that cannot work refused before anything runs, naming the rule.
#include <gtest/gtest.h>

#include "run_weave.hpp"

namespace weave::cli_test {
namespace {

void expect_refused(const std::string& flags, const std::string& message) {
  const Result r = weave("train --mock-data --train-iters 1 " + flags);
  EXPECT_EQ(r.status, 1) << flags << "\n" << r.out;
  EXPECT_NE(r.out.find(message), std::string::npos) << flags << "\n" << r.out;
  EXPECT_EQ(r.out.find("iteration"), std::string::npos) << "ran before refusing: " << r.out;
}

TEST(ModelFlagsCli, ALlamaStyleModelRuns) {
  const Result r = weave(
      "train --mock-data --train-iters 2 --position-embedding-type rope --rotary-percent 0.5 "
      "--rotary-base 500000 --normalization RMSNorm --norm-epsilon 1e-6 --swiglu "
      "--group-query-attention --num-query-groups 2 --disable-bias-linear "
      "--untie-embeddings-and-output-weights --attention-dropout 0.1 --hidden-dropout 0 "
      "--tensor-model-parallel-size 2");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("done: loss"), std::string::npos) << r.out;
  // Megatron's older spellings.
  const Result old = weave(
      "train --mock-data --train-iters 1 --use-rotary-position-embeddings "
      "--no-position-embedding --layernorm-epsilon 1e-5");
  EXPECT_EQ(old.status, 0) << old.out;
}

TEST(ModelFlagsCli, ValuesThatCannotWorkAreRefusedUpFront) {
  expect_refused("--position-embedding-type alibi",
                 "--position-embedding-type must be learned_absolute, rope or none");
  expect_refused("--normalization rmsnorm", "--normalization must be LayerNorm or RMSNorm");
  expect_refused("--num-query-groups 2", "applies with --group-query-attention");
  expect_refused("--group-query-attention", "--group-query-attention needs --num-query-groups");
  expect_refused("--group-query-attention --num-query-groups 3",
                 "--num-query-groups (3) must divide --num-attention-heads (4)");
  expect_refused("--group-query-attention --num-query-groups 1 --tensor-model-parallel-size 2",
                 "must be divisible by --tensor-model-parallel-size (2)");
  expect_refused("--position-embedding-type rope --rotary-percent 0.01", "RoPE needs at least 2");
  expect_refused("--attention-dropout 1", "--attention-dropout must be in [0, 1)");
}

}  // namespace
}  // namespace weave::cli_test
