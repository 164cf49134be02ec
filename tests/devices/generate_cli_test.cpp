// `weave generate` end to end: a Llama-style MoE model trained and saved under tp, SP, ep and a
// pipeline, then sampled from under that layout.
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>

#include "run_weave.hpp"

namespace weave::cli_test {
namespace {

TEST(GenerateCli, SamplesFromWhatALlamaStyleRunSaved) {
  const std::string path =
      (std::filesystem::temp_directory_path() / "weave_generate_cli_test.ckpt").string();
  const Result train = weave(
      "train --num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 "
      "--seq-length 64 --num-experts 4 --moe-layer-freq 2 --expert-model-parallel-size 2 "
      "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 "
      "--devices 8 --micro-batch-size 2 --global-batch-size 8 --position-embedding-type rope "
      "--normalization RMSNorm --swiglu --group-query-attention --num-query-groups 2 "
      "--disable-bias-linear --untie-embeddings-and-output-weights --train-iters 40 "
      "--log-interval 20 --save " +
      path);
  ASSERT_EQ(train.status, 0) << train.out;
  std::smatch loss;
  ASSERT_TRUE(std::regex_search(train.out, loss, std::regex("loss ([0-9.]+) -> ([0-9.]+)")))
      << train.out;
  EXPECT_LT(std::stod(loss[2]), std::stod(loss[1]) - 1.0) << train.out;  // it learns

  const Result sample =
      weave("generate --load " + path + " --prompt 'The ' --max-new-tokens 20 --temperature 0");
  std::filesystem::remove(path);
  ASSERT_EQ(sample.status, 0) << sample.out;
  EXPECT_NE(sample.out.find("on 8 devices (tp 2, pp 2, ep 2, cp 1, dp 2)"), std::string::npos)
      << sample.out;
  // The prompt, then 20 sampled bytes.
  const std::size_t at = sample.out.find("The ");
  ASSERT_NE(at, std::string::npos) << sample.out;
  const std::string rest = sample.out.substr(at + 4);
  EXPECT_GE(rest.size(), 20u) << sample.out;
}

TEST(GenerateCli, NamesWhatIsWrong) {
  const Result missing = weave("generate --load no_such.ckpt --prompt x");
  EXPECT_EQ(missing.status, 1);
  EXPECT_NE(missing.out.find("cannot open checkpoint 'no_such.ckpt'"), std::string::npos)
      << missing.out;
  const Result no_prompt = weave("generate --load no_such.ckpt");
  EXPECT_NE(no_prompt.status, 0);
  EXPECT_NE(no_prompt.out.find("--prompt"), std::string::npos) << no_prompt.out;
}

}  // namespace
}  // namespace weave::cli_test
