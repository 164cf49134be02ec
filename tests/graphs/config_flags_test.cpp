// The flag table: the rules declared with its entries, and the description a checkpoint's header
// and a run's record take from it.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "weave/graphs/config_flags.hpp"
#include "weave/graphs/plan_search.hpp"

namespace weave::graphs {
namespace {

bool mentions(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// What check_flag_rules says of `flag` given beside --ampipe-degree `degree`.
std::string ampipe_rule(int degree, const std::string& flag) {
  const std::vector<std::string> given{flag};
  try {
    check_flag_rules(ParallelPlan{.ampipe_degree = degree}, given);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "accepted";
}

TEST(ConfigFlags, AmpipeRefusesTheFeaturesMindSpeedRefusesBesideIt) {
  for (const char* flag :
       {"--overlap-grad-reduce", "--overlap-param-gather", "--use-nanopipe",
        "--recompute-in-bubble", "--recompute-in-advance", "--adaptive-recompute-device-swap"}) {
    SCOPED_TRACE(flag);
    const ConfigFlag* f = find_config_flag(flag);
    ASSERT_NE(f, nullptr);
    const bool overlap = std::string_view(flag).rfind("--overlap-", 0) == 0;
    EXPECT_EQ(f->status, overlap ? FlagStatus::implemented : FlagStatus::no_effect);
    EXPECT_TRUE(f->has(kRefusedBesideAmpipe));
    EXPECT_TRUE(mentions(ampipe_rule(2, flag), "cannot run with --")) << ampipe_rule(2, flag);
    EXPECT_TRUE(
        mentions(ampipe_rule(2, flag), std::string("--ampipe-degree (2) cannot run with ") + flag));
    EXPECT_EQ(ampipe_rule(1, flag), "accepted");
  }
  // The overlaps the plan holds are refused beside Ampipe as when given by name.
  for (const bool param_gather : {false, true}) {
    ParallelPlan plan{.ampipe_degree = 2};
    plan.overlap_grad_reduce = true;
    plan.overlap_param_gather = param_gather;
    try {
      check_flag_rules(plan, {});
      ADD_FAILURE() << "Ampipe accepted with the overlaps";
    } catch (const ConfigError& e) {
      EXPECT_TRUE(mentions(e.what(), "--ampipe-degree (2) cannot run with --overlap-grad-reduce"))
          << e.what();
    }
  }
  EXPECT_EQ(find_config_flag("--use-flash-attn")->status, FlagStatus::no_effect);
  EXPECT_EQ(ampipe_rule(2, "--use-flash-attn"), "accepted");
}

TEST(ConfigFlags, EveryNameIsDeclaredOnce) {
  std::set<std::string> seen;
  for (const ConfigFlag& f : config_flags())
    for (const std::string& name : f.names()) {
      EXPECT_EQ(name.rfind("--", 0), 0u) << name;
      EXPECT_TRUE(seen.insert(name).second) << name << " is declared twice";
    }
  EXPECT_EQ(find_config_flag("--layernorm-epsilon"), find_config_flag("--norm-epsilon"));
}

// The keys a checkpoint's header holds, as checkpoints were written before the table existed: a
// checkpoint saved then loads now, and one saved now loads in older builds.
TEST(ConfigFlags, TheCheckpointsDescriptionKeepsItsKeys) {
  std::set<std::string> model, plan;
  for (const DescribedSetting& s :
       describe_configuration(TrainerConfig{}, DescribedSettings::checkpointed)) {
    ASSERT_TRUE(s.checkpointed) << s.key;
    (s.section == DescribedSection::model ? model : plan).insert(s.key);
    EXPECT_TRUE(s.section == DescribedSection::model || s.section == DescribedSection::plan)
        << s.key;
  }
  EXPECT_EQ(model, (std::set<std::string>{"num_layers",
                                          "hidden_size",
                                          "num_attention_heads",
                                          "ffn_hidden_size",
                                          "seq_length",
                                          "max_position_embeddings",
                                          "vocab_size",
                                          "make_vocab_size_divisible_by",
                                          "swiglu",
                                          "num_experts",
                                          "moe_layer_freq",
                                          "moe_ffn_hidden_size",
                                          "position_embedding_type",
                                          "rotary_percent",
                                          "rotary_base",
                                          "normalization",
                                          "num_query_groups",
                                          "kv_channels",
                                          "qk_layernorm",
                                          "untie_embeddings_and_output_weights",
                                          "add_bias_linear",
                                          "moe_router_topk",
                                          "moe_router_score_function",
                                          "moe_router_num_groups",
                                          "moe_router_group_topk",
                                          "moe_router_enable_expert_bias",
                                          "moe_shared_expert_intermediate_size",
                                          "moe_shared_expert_gate",
                                          "norm_epsilon",
                                          "tokenizer_type",
                                          "vocab_file",
                                          "merge_file",
                                          "moe_router_load_balancing_type"}));
  EXPECT_EQ(plan, (std::set<std::string>{
                      "tensor_model_parallel_size", "sequence_parallel", "context_parallel_size",
                      "expert_model_parallel_size", "expert_tensor_parallel_size",
                      "data_parallel_size", "pipeline_model_parallel_size",
                      "virtual_pipeline_model_parallel_size", "decoder_first_pipeline_num_layers",
                      "decoder_last_pipeline_num_layers", "use_distributed_optimizer"}));
}

// The keys checkpoints saved before them lack, which loading reads as their defaults.
TEST(ConfigFlags, CheckpointsSavedEarlierLackTheKeysAddedSince) {
  std::set<std::string> later;
  for (const ConfigFlag& f : config_flags())
    if (f.description.absent_from_older_checkpoints) {
      EXPECT_TRUE(f.description.checkpointed) << f.name;
      later.insert(std::string(f.description.key));
    }
  EXPECT_EQ(later, (std::set<std::string>{"position_embedding_type",
                                          "rotary_percent",
                                          "rotary_base",
                                          "normalization",
                                          "num_query_groups",
                                          "kv_channels",
                                          "qk_layernorm",
                                          "untie_embeddings_and_output_weights",
                                          "add_bias_linear",
                                          "moe_router_topk",
                                          "moe_ffn_hidden_size",
                                          "norm_epsilon",
                                          "virtual_pipeline_model_parallel_size",
                                          "decoder_first_pipeline_num_layers",
                                          "decoder_last_pipeline_num_layers",
                                          "tokenizer_type",
                                          "vocab_file",
                                          "merge_file",
                                          "moe_router_score_function",
                                          "moe_router_num_groups",
                                          "moe_router_group_topk",
                                          "moe_router_enable_expert_bias",
                                          "moe_shared_expert_intermediate_size",
                                          "moe_shared_expert_gate",
                                          "moe_router_load_balancing_type"}));
}

TEST(ConfigFlags, DescriptionsHoldTheValuesTheRunUses) {
  TrainerConfig c;
  c.model.num_query_groups = 0;  // one per head: described as the heads
  c.model.max_position_embeddings = 0;
  c.plan.tensor_parallel = 2;
  auto value = [&](const std::string& key) {
    for (const DescribedSetting& s : describe_configuration(c))
      if (s.key == key) return s.value;
    ADD_FAILURE() << key << " is not described";
    return DescribedValue{};
  };
  EXPECT_EQ(value("num_query_groups"), DescribedValue{std::int64_t{c.model.num_attention_heads}});
  EXPECT_EQ(value("max_position_embeddings"), DescribedValue{std::int64_t{c.model.seq_length}});
  // Unset, the experts are --ffn-hidden-size wide, as Megatron-Core defaults them.
  EXPECT_EQ(value("moe_ffn_hidden_size"), DescribedValue{std::int64_t{c.model.ffn_hidden_size}});
  // Unset, each head is hidden / heads wide, as Megatron-LM defaults kv_channels.
  EXPECT_EQ(value("kv_channels"),
            DescribedValue{std::int64_t{c.model.hidden_size / c.model.num_attention_heads}});
  EXPECT_EQ(value("padded_vocab_size"), DescribedValue{std::int64_t{c.model.padded_vocab_size(2)}});
  EXPECT_EQ(value("tensor_model_parallel_size"), DescribedValue{std::int64_t{2}});
  EXPECT_EQ(value("seed"), DescribedValue{c.model.seed});
  EXPECT_EQ(value("lr_decay_style"), DescribedValue{c.learning_rate.style});
  EXPECT_EQ(value("timing"), DescribedValue{std::string("wall")});
}

// The flags the plan search writes for a candidate are the table's plan flags, which `weave
// predict --advise` leaves out of the command it prints for the best plan and writes anew.
TEST(ConfigFlags, ThePlanSearchWritesOnlyPlanFlags) {
  TrainerConfig c;
  c.model.num_experts = 4;
  c.model.recompute = {.granularity = RecomputeGranularity::full,
                       .method = RecomputeMethod::uniform,
                       .num_layers = 1};
  c.plan = {.tensor_parallel = 2,
            .sequence_parallel = true,
            .expert_parallel = 2,
            .expert_tensor_parallel = 2,
            .pipeline_parallel = 2,
            .virtual_pipeline = 2,
            .pipeline_scheduler = "interleaved",
            .ampipe_degree = 2};
  std::istringstream words(plan_flags(c));
  int flags = 0;
  for (std::string word; words >> word;) {
    if (word.rfind("--", 0) != 0) continue;
    ++flags;
    const ConfigFlag* f = find_config_flag(word);
    ASSERT_NE(f, nullptr) << word;
    EXPECT_TRUE(f->has(kChoosesPlan)) << word;
  }
  EXPECT_GE(flags, 12);
}

// A flag declared only in the table is described by every description, checkpointed or not.
TEST(ConfigFlags, AnEntryAddedToTheTableIsDescribed) {
  add_config_flag_for_testing(
      {.name = "--test-only-width",
       .help = "A test's flag",
       .field = config_field<&TrainerConfig::model, &ModelConfig::ffn_hidden_size>(),
       .description = {
           .section = DescribedSection::model, .key = "test_only_width", .checkpointed = true}});
  TrainerConfig c;
  c.model.ffn_hidden_size = 96;
  for (const DescribedSettings which : {DescribedSettings::checkpointed, DescribedSettings::all}) {
    const std::vector<DescribedSetting> d = describe_configuration(c, which);
    const auto found = std::find_if(
        d.begin(), d.end(), [](const DescribedSetting& s) { return s.key == "test_only_width"; });
    ASSERT_NE(found, d.end());
    EXPECT_EQ(found->value, DescribedValue{std::int64_t{96}});
  }
}

}  // namespace
}  // namespace weave::graphs
