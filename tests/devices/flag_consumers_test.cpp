// A flag declared only in the flag table (graphs/config_flags.hpp) reaches every consumer:
// `weave train`'s command line and --config, the run record, the checkpoint's description and
// `weave predict --advise`'s plan flags; one of `weave predict`'s own reaches its command line. A
// binary of its own, as the entry it adds stays in the table for the rest of the process.
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "commands.hpp"
#include "run_record.hpp"
#include "train_command_line.hpp"
#include "train_options.hpp"
#include "weave/graphs/config_flags.hpp"

namespace {

using namespace weave;

// Parses `weave train FLAGS` as the program does, a --config file reading as `config`.
// Built anew for each parse: the tests add flags to the table between parses.
cli::TrainOptions parse(const std::vector<std::string>& flags, const std::string& config = "{}") {
  return cli::TrainCommandLine().parse(flags,
                                       [&](const std::string&) { return std::optional(config); });
}

class FlagConsumers : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    graphs::add_config_flag_for_testing(
        {.name = "--test-only-ffn-width",
         .aliases = "--test-only-mlp-width",
         .group = graphs::FlagGroup::model,
         .help = "A test's flag: the MLPs' width",
         .field = graphs::config_field<&graphs::TrainerConfig::model,
                                       &graphs::ModelConfig::ffn_hidden_size>(),
         .check = {.kind = graphs::ValueCheck::at_least, .minimum = 1},
         .description = {.section = graphs::DescribedSection::model,
                         .key = "test_only_ffn_width",
                         .checkpointed = true},
         .properties = graphs::kChoosesPlan});
    graphs::add_config_flag_for_testing(
        {.name = "--test-only-predicted-width",
         .group = graphs::FlagGroup::prediction,
         .command = graphs::FlagCommand::predict,
         .help = "A test's flag of weave predict: the MLPs' width",
         .field = graphs::config_field<&graphs::TrainerConfig::model,
                                       &graphs::ModelConfig::ffn_hidden_size>(),
         .properties = graphs::kNotRepeatedByAdvice});
  }
};

TEST_F(FlagConsumers, TheCommandLineTakesItWithItsAliasAndCheck) {
  EXPECT_EQ(parse({"--test-only-ffn-width", "96"}).config.model.ffn_hidden_size, 96);
  EXPECT_EQ(parse({"--test-only-mlp-width", "80"}).config.model.ffn_hidden_size, 80);
  EXPECT_THROW(parse({"--test-only-ffn-width", "0"}), CLI::ValidationError);
}

TEST_F(FlagConsumers, ConfigFilesTakeItByItsKey) {
  EXPECT_EQ(parse({"--config", "run.json"}, R"({"test_only_ffn_width": 72})")
                .config.model.ffn_hidden_size,
            72);
  EXPECT_EQ(parse({"--config", "run.json"}, R"({"test-only-ffn-width": 40})")
                .config.model.ffn_hidden_size,
            40);
}

TEST_F(FlagConsumers, TheRunRecordAndTheCheckpointDescribeIt) {
  cli::TrainOptions o = parse({"--test-only-ffn-width", "96"});
  EXPECT_EQ(cli::run_record(o.config, "mock", {})["model"]["test_only_ffn_width"], 96);
  bool checkpointed = false;
  for (const graphs::DescribedSetting& s :
       graphs::describe_configuration(o.config, graphs::DescribedSettings::checkpointed))
    checkpointed |= s.key == "test_only_ffn_width" && s.section == graphs::DescribedSection::model;
  EXPECT_TRUE(checkpointed);
}

TEST_F(FlagConsumers, PredictsAdviceChoosesItAsAPlanFlag) {
  EXPECT_TRUE(cli::left_out_of_advice("--test-only-ffn-width"));
  EXPECT_TRUE(cli::left_out_of_advice("--tensor-model-parallel-size"));
  EXPECT_TRUE(cli::left_out_of_advice("--recompute-granularity"));
  EXPECT_TRUE(cli::left_out_of_advice("--config"));
  EXPECT_FALSE(cli::left_out_of_advice("--num-layers"));
  EXPECT_FALSE(cli::left_out_of_advice("--micro-batch-size"));
}

// weave predict's own flags are left out of the best plan's command by the table's word, as the
// search's settings and the replay of every rank are.
TEST_F(FlagConsumers, PredictsAdviceLeavesOutTheSearchsOwnFlags) {
  EXPECT_TRUE(cli::left_out_of_advice("--test-only-predicted-width"));
  for (const char* flag :
       {"--advise", "--advise-top", "--advise-limit", "--advise-memory-budget", "--every-rank"})
    EXPECT_TRUE(cli::left_out_of_advice(flag)) << flag;
  EXPECT_FALSE(cli::left_out_of_advice("--device-memory"));
  EXPECT_FALSE(cli::left_out_of_advice("--trace-ranks"));
}

TEST_F(FlagConsumers, PredictsOwnFlagIsOnPredictsCommandLineOnly) {
  CLI::App app{"", "weave"};
  cli::add_predict_command(app);
  const CLI::Option* own =
      app.get_subcommand("predict")->get_option_no_throw("--test-only-predicted-width");
  ASSERT_NE(own, nullptr);
  EXPECT_EQ(own->get_group(), "Prediction");
  EXPECT_EQ(own->get_description(), "A test's flag of weave predict: the MLPs' width");
  EXPECT_THROW(parse({"--test-only-predicted-width", "96"}), std::invalid_argument);
}

}  // namespace
