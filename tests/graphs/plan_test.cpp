// Parallel plans: every size rule refused with its numbers; the mesh's rank order and groups
// as Megatron-LM builds them.
#include <gtest/gtest.h>

#include <set>

#include "weave/graphs/mesh.hpp"
#include "weave/graphs/parallel_plan.hpp"
#include "weave/graphs/pipeline_layout.hpp"

namespace weave::graphs {
namespace {

std::string refusal(ModelConfig m, ParallelPlan p) {
  try {
    validate(m, p);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "accepted";
}

// A MoE model with 48 positions, for the Ampipe and pipe-experts rules.
ModelConfig small_moe() {
  return {.num_layers = 2,
          .hidden_size = 64,
          .num_attention_heads = 4,
          .ffn_hidden_size = 128,
          .seq_length = 48,
          .num_experts = 4};
}

bool mentions(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The warnings beside the note on what MindSpeed's Ampipe refuses (AmpipeNamesWhereMindSpeedStops
// tests the note).
std::vector<std::string> validate_beside_mindspeed_note(const ModelConfig& m, ParallelPlan& p) {
  std::vector<std::string> warnings = validate(m, p);
  std::erase_if(warnings,
                [](const std::string& w) { return mentions(w, "where MindSpeed's Ampipe stops"); });
  return warnings;
}

TEST(ParallelPlan, EverySizeRuleIsRefusedWithItsNumbers) {
  const ModelConfig m{.num_layers = 4,
                      .hidden_size = 64,
                      .num_attention_heads = 4,
                      .ffn_hidden_size = 192,
                      .seq_length = 48,
                      .num_experts = 4};
  EXPECT_EQ(refusal(m, {}), "accepted");
  EXPECT_TRUE(mentions(refusal(m, {.tensor_parallel = 8, .data_parallel = 1}),
                       "--num-attention-heads (4) must be divisible by "
                       "--tensor-model-parallel-size (8)"));
  ModelConfig odd_hidden = m;
  odd_hidden.hidden_size = 66;
  EXPECT_TRUE(mentions(refusal(odd_hidden, {}), "--hidden-size (66)"));
  ModelConfig ffn = m;
  ffn.ffn_hidden_size = 190;
  EXPECT_TRUE(mentions(refusal(ffn, {.tensor_parallel = 4}), "--ffn-hidden-size (190)"));
  ModelConfig seq = m;
  seq.seq_length = 50;
  EXPECT_TRUE(mentions(refusal(seq, {.tensor_parallel = 4, .sequence_parallel = true}),
                       "--seq-length (50) must be divisible by --tensor-model-parallel-size (4)"));
  EXPECT_TRUE(mentions(refusal(m, {.context_parallel = 5}), "2 x --context-parallel-size (10)"));
  // 48 positions split into 2 x cp chunks, each over 2 sequence-parallel ranks: 48 % 8 == 0.
  EXPECT_EQ(refusal(m, {.tensor_parallel = 2, .sequence_parallel = true, .context_parallel = 2}),
            "accepted");
  EXPECT_TRUE(
      mentions(refusal(m, {.expert_parallel = 3, .data_parallel = 3, .global_batch_size = 3}),
               "--num-experts (4) must be divisible by --expert-model-parallel-size (3)"));
  EXPECT_TRUE(
      mentions(refusal(m, {.expert_parallel = 4, .data_parallel = 2, .global_batch_size = 2}),
               "must divide tensor x context x data parallel"));
  ModelConfig dense = m;
  dense.num_experts = 0;
  EXPECT_TRUE(
      mentions(refusal(dense, {.expert_parallel = 2, .data_parallel = 2, .global_batch_size = 2}),
               "needs --num-experts > 0"));
  ModelConfig topk = m;
  topk.moe_router_topk = 5;
  EXPECT_TRUE(mentions(refusal(topk, {}), "--moe-router-topk (5)"));
  // Megatron-Core's group-limited routing rules, each naming its values (m has 4 experts, top-2).
  ModelConfig groups = m;
  groups.moe_router_group_topk = 1;
  EXPECT_TRUE(mentions(refusal(groups, {}), "needs --moe-router-num-groups"));
  groups.moe_router_num_groups = 3;
  EXPECT_TRUE(mentions(refusal(groups, {}),
                       "--num-experts (4) must be divisible by --moe-router-num-groups (3)"));
  groups.moe_router_num_groups = 2;
  EXPECT_EQ(refusal(groups, {}), "accepted");
  groups.moe_router_group_topk = 3;
  EXPECT_TRUE(mentions(refusal(groups, {}),
                       "--moe-router-group-topk (3) must be at most "
                       "--moe-router-num-groups (2)"));
  groups.moe_router_num_groups = 4;
  EXPECT_TRUE(mentions(refusal(groups, {}),
                       "--moe-router-group-topk (3) must be at most --moe-router-topk (2)"));
  groups.moe_router_group_topk = 1;
  EXPECT_TRUE(mentions(refusal(groups, {}), "--moe-router-topk (2) needs at least"));
  ModelConfig score = m;
  score.moe_router_score_function = "tanh";
  EXPECT_TRUE(mentions(refusal(score, {}), "must be softmax, sigmoid or sqrtsoftplus, got 'tanh'"));
  score.moe_router_score_function = "sqrtsoftplus";
  EXPECT_EQ(refusal(score, {}), "accepted");
  ModelConfig dtype = m;
  dtype.moe_router_dtype = "fp64";
  EXPECT_TRUE(mentions(refusal(dtype, {}), "--moe-router-dtype fp64: weave's router computes"));
  ModelConfig bias = m;
  bias.moe_router_enable_expert_bias = true;
  EXPECT_TRUE(mentions(refusal(bias, {}),
                       "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid "
                       "or sqrtsoftplus (Megatron-Core's rule), got softmax"));
  bias.moe_router_score_function = "sigmoid";
  EXPECT_EQ(refusal(bias, {}), "accepted");
  bias.moe_router_score_function = "sqrtsoftplus";
  EXPECT_EQ(refusal(bias, {}), "accepted");
  EXPECT_TRUE(
      mentions(refusal(m, {.data_parallel = 2, .micro_batch_size = 2, .global_batch_size = 6}),
               "--global-batch-size (6) must be divisible by --micro-batch-size x "
               "data-parallel size (2 x 2 = 4)"));
  EXPECT_TRUE(
      mentions(refusal(m, {.pipeline_parallel = 3, .global_batch_size = 3}), "--num-layers (4)"));
  EXPECT_TRUE(
      mentions(refusal(m, {.tensor_parallel = 0}), "--tensor-model-parallel-size must be >= 1"));
}

TEST(ParallelPlan, PipelineRules) {
  ModelConfig m{.num_layers = 8,
                .hidden_size = 64,
                .num_attention_heads = 4,
                .ffn_hidden_size = 128,
                .seq_length = 48};
  auto pp = [](int p, int m_batches) {
    return ParallelPlan{
        .pipeline_parallel = p, .micro_batch_size = 1, .global_batch_size = m_batches};
  };
  EXPECT_EQ(refusal(m, pp(4, 8)), "accepted");
  EXPECT_TRUE(mentions(refusal(m, pp(3, 3)),
                       "--num-layers (8) must be divisible by --pipeline-model-parallel-size x "
                       "virtual stages per rank (3 x 1 = 3 model chunks)"));
  ParallelPlan v = pp(2, 4);
  v.virtual_pipeline = 8;
  EXPECT_TRUE(mentions(refusal(m, v), "(2 x 8 = 16 model chunks)"));
  // --num-layers-per-virtual-pipeline-stage sets the chunks per rank: 8 / (2 x 2) = 2.
  ParallelPlan per_stage = pp(2, 4);
  per_stage.layers_per_virtual_stage = 2;
  validate(m, per_stage);
  EXPECT_EQ(per_stage.virtual_pipeline, 2);
  per_stage = pp(2, 4);
  per_stage.layers_per_virtual_stage = 3;
  EXPECT_TRUE(mentions(refusal(m, per_stage),
                       "--num-layers-per-virtual-pipeline-stage (3) must divide the layers of "
                       "each pipeline rank"));
  per_stage.layers_per_virtual_stage = 2;
  per_stage.virtual_pipeline = 4;
  EXPECT_TRUE(mentions(refusal(m, per_stage), "give one of them"));
  // Schedules: their rules come back with the micro-batch count and where it comes from.
  ParallelPlan zb = pp(4, 2);
  zb.pipeline_scheduler = "zb-h1";
  EXPECT_TRUE(mentions(refusal(m, zb), "zb-h1 needs at least p micro-batches"));
  EXPECT_TRUE(mentions(refusal(m, zb), "--global-batch-size / (--micro-batch-size x"));
  ParallelPlan typo = pp(2, 4);
  typo.pipeline_scheduler = "1f1c";
  EXPECT_TRUE(mentions(refusal(m, typo), "--pipeline-scheduler"));
  ParallelPlan zbv = pp(2, 4);
  zbv.pipeline_scheduler = "zb-v";
  validate(m, zbv);
  EXPECT_EQ(zbv.virtual_pipeline, 2);  // the V's two chunks per rank
  // Uneven first and last chunks: the rest must split evenly.
  ParallelPlan uneven = pp(4, 4);
  uneven.first_stage_layers = 1;
  uneven.last_stage_layers = 1;
  EXPECT_EQ(refusal(m, uneven), "accepted");
  const PipelineLayout layout = make_pipeline_layout(m, uneven);
  EXPECT_EQ(layout.chunk_begin, (std::vector<int>{0, 1, 4, 7, 8}));
  uneven.last_stage_layers = 2;
  EXPECT_TRUE(mentions(refusal(m, uneven),
                       "minus the first chunk's 1 and the last chunk's 2 leaves 5 layers"));
  ParallelPlan single = pp(1, 4);
  single.first_stage_layers = 2;
  EXPECT_TRUE(mentions(refusal(m, single), "need --pipeline-model-parallel-size > 1"));
  // A scheduler without a pipeline is dropped with a warning.
  ParallelPlan alone = pp(1, 4);
  alone.pipeline_scheduler = "gpipe";
  const auto warnings = validate(m, alone);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_TRUE(mentions(warnings[0], "--pipeline-scheduler gpipe has no effect"));
  EXPECT_TRUE(alone.pipeline_scheduler.empty());
}

TEST(ParallelPlan, AmpipeRules) {
  const ModelConfig moe = small_moe();
  EXPECT_EQ(refusal(moe, {.ampipe_degree = 4}), "accepted");
  ModelConfig dense = moe;
  dense.num_experts = 0;
  EXPECT_TRUE(mentions(refusal(dense, {.ampipe_degree = 2}), "needs MoE layers"));
  EXPECT_TRUE(
      mentions(refusal(moe, {.ampipe_degree = 5}), "--seq-length (48) must be divisible by 5"));
  EXPECT_TRUE(mentions(refusal(moe, {.context_parallel = 2, .ampipe_degree = 4}),
                       "--ampipe-degree must be 2 with --context-parallel-size 2"));
  EXPECT_TRUE(mentions(refusal(moe, {.ampipe_degree = 0}), "--ampipe-degree must be >= 1"));
  // Without SP (MindSpeed allows it) each tp rank routes its slice of every chunk: S % (N tp);
  // under CP weave splits the ring's chunks as sequence-parallel pieces only.
  EXPECT_EQ(refusal(moe, {.tensor_parallel = 2, .ampipe_degree = 2}), "accepted");
  EXPECT_TRUE(mentions(refusal(moe, {.tensor_parallel = 2, .ampipe_degree = 16}),
                       "--seq-length (48) must be divisible by 32"));
  EXPECT_TRUE(
      mentions(refusal(moe, {.tensor_parallel = 2, .context_parallel = 2, .ampipe_degree = 2}),
               "--context-parallel-size 2 needs --sequence-parallel"));
  EXPECT_EQ(refusal(moe, {.tensor_parallel = 2, .sequence_parallel = true, .ampipe_degree = 4}),
            "accepted");
  EXPECT_EQ(refusal(moe, {.context_parallel = 2, .ampipe_degree = 2}), "accepted");
  // CP with tp > 1 under Ampipe (MindSpeed allows it): S divisible by 4 cp tp.
  EXPECT_EQ(refusal(moe, {.tensor_parallel = 2,
                          .sequence_parallel = true,
                          .context_parallel = 2,
                          .ampipe_degree = 2}),
            "accepted");
  ModelConfig uneven = moe;
  uneven.seq_length = 40;
  EXPECT_TRUE(mentions(refusal(uneven, {.tensor_parallel = 2,
                                        .sequence_parallel = true,
                                        .context_parallel = 2,
                                        .ampipe_degree = 2}),
                       "--seq-length (40) must be divisible by 16 under --ampipe-degree 2"));
  EXPECT_TRUE(
      mentions(refusal(moe, {.tensor_parallel = 4, .sequence_parallel = true, .ampipe_degree = 8}),
               "--seq-length (48) must be divisible by 32"));
  EXPECT_TRUE(mentions(refusal(moe, {.ampipe_degree = 2'000'000'000}),
                       "--ampipe-degree (2000000000) must not exceed --seq-length (48)"));
}

// Sizes are refused before they are multiplied: none of these may overflow an int.
TEST(ParallelPlan, SizesTooLargeToMultiplyAreRefused) {
  const ModelConfig m = small_moe();
  EXPECT_TRUE(mentions(refusal(m, {.tensor_parallel = 4, .context_parallel = 1 << 19}),
                       "exceeds 1048576 devices"));
  EXPECT_TRUE(mentions(refusal(m, {.data_parallel = 65536, .pipeline_parallel = 65536}),
                       "(1 x 1 x 65536 x 65536) exceeds 1048576 devices"));
  EXPECT_TRUE(mentions(
      refusal(
          m, {.data_parallel = 1 << 20, .micro_batch_size = 1 << 20, .global_batch_size = 1 << 20}),
      "--micro-batch-size x data-parallel size (1048576 x 1048576 = 1099511627776)"));
  ModelConfig wide = m;
  wide.make_vocab_size_divisible_by = 1 << 30;
  EXPECT_TRUE(mentions(refusal(wide, {.tensor_parallel = 4}), "must stay below 2^30 rows"));
  EXPECT_EQ(
      refusal(m, {.data_parallel = 1 << 20, .micro_batch_size = 1, .global_batch_size = 1 << 20}),
      "accepted");
}

TEST(ParallelPlan, AmpipeFollowsMindSpeedsSequenceRulesAndConflicts) {
  ModelConfig moe = small_moe();
  moe.seq_length = 20;  // 2 x cp = 4 divides it, 2 x degree x cp = 8 does not
  EXPECT_TRUE(mentions(refusal(moe, {.context_parallel = 2, .ampipe_degree = 2}),
                       "--seq-length (20) must be divisible by 8 under --ampipe-degree 2"));
  // The features MindSpeed's Ampipe refuses beside it are flags without effect here, and their
  // rule is declared with them in the flag table (config_flags_test.cpp).
  const ModelConfig m = small_moe();
  ParallelPlan flash{.ampipe_degree = 2};
  const auto warnings = validate(m, flash);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_TRUE(mentions(warnings[0], "MindSpeed refuses it (EP > 1), weave runs it"));
}

// MindSpeed's arguments.py asserts EP > 1, deepspeed_moe and no linear biases beside Ampipe;
// weave runs such a plan and names each difference in one warning.
TEST(ParallelPlan, AmpipeNamesWhereMindSpeedStops) {
  ModelConfig unbiased = small_moe();
  unbiased.add_bias_linear = false;
  ParallelPlan mindspeeds{.expert_parallel = 2,
                          .moe_model_type = "deepspeed_moe",
                          .data_parallel = 2,
                          .global_batch_size = 2,
                          .ampipe_degree = 2};
  EXPECT_TRUE(validate(unbiased, mindspeeds).empty());
  ParallelPlan megatrons{.expert_parallel = 2,
                         .moe_model_type = "megatron_moe",
                         .data_parallel = 2,
                         .global_batch_size = 2,
                         .ampipe_degree = 2};
  const auto router = validate(unbiased, megatrons);
  ASSERT_EQ(router.size(), 1u);
  EXPECT_TRUE(mentions(router[0], "needs --moe-model-type deepspeed_moe")) << router[0];
  EXPECT_FALSE(mentions(router[0], "--disable-bias-linear")) << router[0];
  const auto biased = validate(small_moe(), mindspeeds);
  ASSERT_EQ(biased.size(), 1u);
  EXPECT_TRUE(mentions(biased[0], "refuses biased linear layers (add --disable-bias-linear)"))
      << biased[0];
  EXPECT_FALSE(mentions(biased[0], "--moe-model-type")) << biased[0];
  // Without Ampipe, nothing to say.
  ParallelPlan plain = megatrons;
  plain.ampipe_degree = 1;
  EXPECT_TRUE(validate(small_moe(), plain).empty());
}

// Pipe experts beside Ampipe with whole experts (MindSpeed's deepspeed_moe at tp 1): MindSpeed
// splits Ampipe's all-to-alls into PipeExpert's (expert, slice) items only under
// --ampipe-tp-sp-comm-overlap; without it its PipeExpert indexes the chunks' whole all-to-alls as
// items and fails, and the note names that and weave's chunk-major order.
TEST(ParallelPlan, AmpipeNamesMindSpeedsFailureWithWholePipeExperts) {
  ModelConfig unbiased = small_moe();
  unbiased.add_bias_linear = false;
  ParallelPlan whole{.expert_parallel = 2,
                     .moe_model_type = "deepspeed_moe",
                     .data_parallel = 2,
                     .global_batch_size = 2,
                     .ampipe_degree = 2,
                     .pipe_experts = true,
                     .pipe_experts_multi_data = 4};
  const auto warnings = validate(unbiased, whole);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_TRUE(mentions(warnings[0], "where MindSpeed's Ampipe stops")) << warnings[0];
  EXPECT_TRUE(mentions(warnings[0],
                       "--use-pipe-experts with whole experts (tp 1 under MindSpeed's "
                       "deepspeed_moe): MindSpeed's PipeExpert runs them expert-major only under "
                       "--ampipe-tp-sp-comm-overlap"))
      << warnings[0];
  EXPECT_TRUE(mentions(warnings[0], "stops with an IndexError after 2 of its 4 slices"))
      << warnings[0];
  EXPECT_TRUE(mentions(warnings[0], "weave runs each chunk's items in turn, chunk-major"))
      << warnings[0];
  EXPECT_TRUE(whole.pipe_experts);
  // The overlap flag does not keep the note away: weave switches it off for whole experts.
  ParallelPlan overlap = whole;
  overlap.ampipe_tp_sp_comm_overlap = true;
  const auto with_overlap = validate(unbiased, overlap);
  ASSERT_EQ(with_overlap.size(), 2u);
  EXPECT_TRUE(mentions(with_overlap[0], "stops with an IndexError")) << with_overlap[0];
  EXPECT_TRUE(mentions(with_overlap[1], "--ampipe-tp-sp-comm-overlap is switched off"))
      << with_overlap[1];
  // Pipe experts switched off (multi-data = the degree without multi-stream): nothing to say.
  ParallelPlan off = whole;
  off.pipe_experts_multi_data = 2;
  const auto switched_off = validate(unbiased, off);
  ASSERT_EQ(switched_off.size(), 1u);
  EXPECT_TRUE(mentions(switched_off[0], "--use-pipe-experts is switched off")) << switched_off[0];
  // Split experts (tp 2 with SP): MindSpeed's items, expert-major as weave runs them.
  ParallelPlan split{.tensor_parallel = 2,
                     .sequence_parallel = true,
                     .expert_parallel = 2,
                     .moe_model_type = "deepspeed_moe",
                     .data_parallel = 2,
                     .global_batch_size = 2,
                     .ampipe_degree = 2,
                     .pipe_experts = true,
                     .pipe_experts_multi_data = 4};
  EXPECT_TRUE(validate(unbiased, split).empty());
}

TEST(ParallelPlan, ResendingKeyValueBlocksNeedsAmpipeUnderContextParallelism) {
  const ModelConfig moe = small_moe();
  ParallelPlan without_cp{.expert_parallel = 2,
                          .data_parallel = 2,
                          .global_batch_size = 2,
                          .ampipe_degree = 2,
                          .ampipe_cp_resend_kv = true};
  const auto warnings = validate_beside_mindspeed_note(moe, without_cp);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_TRUE(mentions(warnings[0], "--ampipe-cp-resend-kv has no effect")) << warnings[0];
  EXPECT_FALSE(without_cp.ampipe_cp_resend_kv);
  ParallelPlan with_cp{
      .context_parallel = 2, .expert_parallel = 2, .ampipe_degree = 2, .ampipe_cp_resend_kv = true};
  // Two MoE layers: what the layers free, the rings' workspaces take.
  const auto two = validate_beside_mindspeed_note(moe, with_cp);
  ASSERT_EQ(two.size(), 1u);
  EXPECT_TRUE(mentions(two[0], "saves no memory with 2 MoE layers")) << two[0];
  EXPECT_TRUE(with_cp.ampipe_cp_resend_kv);
  ModelConfig deeper = moe;
  deeper.num_layers = 3;
  EXPECT_TRUE(validate_beside_mindspeed_note(deeper, with_cp).empty());
}

TEST(ParallelPlan, PipeExpertsFollowMindSpeedsRules) {
  const ModelConfig moe = small_moe();
  auto check = [&](ParallelPlan p) {
    p.data_parallel = p.expert_parallel;
    p.global_batch_size = p.data_parallel;
    const auto warnings = validate_beside_mindspeed_note(moe, p);
    return std::pair{p, warnings.empty() ? std::string("on") : warnings.front()};
  };
  // Multi-data divisible by the degree and above it (or equal with multi-stream) stays on.
  EXPECT_EQ(check({.expert_parallel = 2,
                   .ampipe_degree = 2,
                   .pipe_experts = true,
                   .pipe_experts_multi_data = 4})
                .second,
            "on");
  // (= the degree with multi-stream, which needs SP and split experts.)
  EXPECT_EQ(check({.tensor_parallel = 2,
                   .sequence_parallel = true,
                   .expert_parallel = 2,
                   .moe_model_type = "deepspeed_moe",
                   .ampipe_degree = 2,
                   .pipe_experts = true,
                   .pipe_experts_multi_stream = true,
                   .pipe_experts_multi_data = 2})
                .second,
            "on");
  EXPECT_TRUE(mentions(check({.expert_parallel = 2,
                              .ampipe_degree = 2,
                              .pipe_experts = true,
                              .pipe_experts_multi_stream = true,
                              .pipe_experts_multi_data = 4})
                           .second,
                       "--pipe-experts-multi-stream is switched off: it chains"));
  // Otherwise it is switched off, every pipe-experts setting reset, the rule named.
  auto [off, why] = check({.tensor_parallel = 2,
                           .sequence_parallel = true,
                           .expert_parallel = 2,
                           .moe_model_type = "deepspeed_moe",
                           .ampipe_degree = 2,
                           .pipe_experts = true,
                           .pipe_experts_multi_stream = true,
                           .pipe_experts_multi_data = 3});
  EXPECT_FALSE(off.pipe_experts || off.pipe_experts_multi_stream);
  EXPECT_EQ(off.pipe_experts_multi_data, 1);
  EXPECT_TRUE(
      mentions(why, "--pipe-experts-multi-data (3) must be divisible by --ampipe-degree (2)"));
  EXPECT_TRUE(mentions(check({.expert_parallel = 2,
                              .ampipe_degree = 2,
                              .pipe_experts = true,
                              .pipe_experts_multi_data = 2})
                           .second,
                       "needs --pipe-experts-multi-data > 2 (or = 2 with"));
  EXPECT_TRUE(mentions(check({.expert_parallel = 4, .pipe_experts = true}).second,
                       "one local expert (4 experts over 4 expert-parallel ranks)"));
  EXPECT_TRUE(mentions(check({.pipe_experts = true}).second, "no all-to-all to overlap"));
  EXPECT_TRUE(mentions(check({.expert_parallel = 2, .pipe_experts_multi_data = 2}).second,
                       "ignored without it"));
  // --ampipe-tp-sp-comm-overlap pipelines split experts' tensor-parallel collectives over
  // Ampipe's chunks: whole experts or no chunks switch it off naming what is missing.
  EXPECT_TRUE(mentions(check({.expert_parallel = 2, .ampipe_tp_sp_comm_overlap = true}).second,
                       "set --ampipe-degree >= 2"));
  EXPECT_TRUE(mentions(
      check({.expert_parallel = 2, .ampipe_degree = 2, .ampipe_tp_sp_comm_overlap = true}).second,
      "the experts are whole: set --moe-model-type deepspeed_moe"));
  ParallelPlan overlap{.tensor_parallel = 2,
                       .sequence_parallel = true,
                       .expert_parallel = 2,
                       .moe_model_type = "deepspeed_moe",
                       .data_parallel = 2,
                       .global_batch_size = 2,
                       .ampipe_degree = 2,
                       .ampipe_tp_sp_comm_overlap = true};
  EXPECT_TRUE(validate_beside_mindspeed_note(moe, overlap).empty());
  EXPECT_TRUE(overlap.ampipe_tp_sp_comm_overlap);
  // Without SP it stays on too (MindSpeed overlaps each item's all-reduce there).
  ParallelPlan without_sp = overlap;
  without_sp.sequence_parallel = false;
  EXPECT_TRUE(validate_beside_mindspeed_note(moe, without_sp).empty());
  EXPECT_TRUE(without_sp.ampipe_tp_sp_comm_overlap);
  ModelConfig capped = moe;
  capped.moe_expert_capacity_factor = 0.1;  // ceil(0.1 x 48 x 2 / 4) = 3 picks per expert
  ParallelPlan too_many{.expert_parallel = 2,
                        .data_parallel = 2,
                        .global_batch_size = 2,
                        .pipe_experts = true,
                        .pipe_experts_multi_data = 4};
  EXPECT_TRUE(mentions(refusal(capped, too_many), "must not exceed an expert's capacity (3"));
  EXPECT_TRUE(mentions(refusal(moe, {.pipe_experts_multi_data = 0}),
                       "--pipe-experts-multi-data must be >= 1"));
}

// Each rule's refusal at least once, with its numbers.
TEST(ParallelPlan, ModelRulesAreRefusedWithTheirNumbers) {
  const ModelConfig moe = small_moe();
  auto with = [&](auto change) {
    ModelConfig m = moe;
    change(m);
    return refusal(m, {});
  };
  EXPECT_EQ(with([](ModelConfig& m) { m.max_position_embeddings = 32; }),
            "--max-position-embeddings (32) must be >= --seq-length (48)");
  EXPECT_EQ(with([](ModelConfig& m) { m.num_experts = -1; }), "--num-experts must be >= 0, got -1");
  EXPECT_EQ(with([](ModelConfig& m) { m.moe_layer_freq = 0; }),
            "--moe-layer-freq must be >= 1, got 0");
  EXPECT_EQ(with([](ModelConfig& m) { m.moe_expert_capacity_factor = -1; }),
            "--moe-expert-capacity-factor must be >= 0 (0: dropless), got -1");
  EXPECT_EQ(with([](ModelConfig& m) { m.hidden_dropout = 1; }),
            "--hidden-dropout must be in [0, 1), got 1");
  EXPECT_EQ(with([](ModelConfig& m) { m.attention_dropout = -0.5; }),
            "--attention-dropout must be in [0, 1), got -0.5");
  EXPECT_EQ(with([](ModelConfig& m) { m.layernorm_epsilon = 0; }),
            "--norm-epsilon must be > 0, got 0");
  EXPECT_EQ(with([](ModelConfig& m) { m.vocab_size = 0; }), "--vocab-size must be >= 1, got 0");
  EXPECT_EQ(with([](ModelConfig& m) {
              m.recompute = {.granularity = RecomputeGranularity::selective,
                             .method = RecomputeMethod::uniform};
            }),
            "--recompute-granularity selective recomputes the core attention of every layer and "
            "takes no --recompute-method or --recompute-num-layers (Megatron-LM's rule): drop "
            "them, or use --recompute-granularity full");
  EXPECT_EQ(with([](ModelConfig& m) {
              m.recompute = {.granularity = RecomputeGranularity::full,
                             .method = RecomputeMethod::uniform,
                             .num_layers = 3};
            }),
            "--recompute-num-layers must be between 1 and the layers of a pipeline rank (2 = "
            "--num-layers 2 / --pipeline-model-parallel-size 1) with --recompute-granularity full "
            "(Megatron-LM's rule), got 3");
  EXPECT_EQ(with([](ModelConfig& m) {
              m.position_embedding = PositionEmbedding::rope;
              m.rotary_percent = 0;
            }),
            "--rotary-percent must be in (0, 1], got 0");
  EXPECT_EQ(with([](ModelConfig& m) {
              m.position_embedding = PositionEmbedding::rope;
              m.rotary_base = 0;
            }),
            "--rotary-base must be > 0, got 0");
}

TEST(ParallelPlan, PlanRulesAreRefusedWithTheirNumbers) {
  const ModelConfig moe = small_moe();
  EXPECT_EQ(refusal(moe, {.tensor_parallel = 2,
                          .expert_tensor_parallel = 4,
                          .moe_model_type = "deepspeed_moe"}),
            "--moe-model-type deepspeed_moe splits every expert over the tensor-parallel group: "
            "--expert-tensor-parallel-size (4) must be --tensor-model-parallel-size (2) or unset");
  EXPECT_EQ(refusal(moe, {.expert_tensor_parallel = 0}),
            "--expert-tensor-parallel-size must be >= 1, got 0");
  EXPECT_EQ(refusal(moe, {.virtual_pipeline = 0}),
            "--virtual-pipeline-model-parallel-size must be >= 1, got 0");
  EXPECT_EQ(refusal(moe, {.layers_per_virtual_stage = -1}),
            "--num-layers-per-virtual-pipeline-stage must be >= 1, got -1");
  ModelConfig dense = moe;
  dense.num_experts = 0;
  EXPECT_EQ(refusal(dense, {.pipe_experts = true}),
            "--use-pipe-experts pipelines MoE experts: set --num-experts");
}

// The flags without effect (--use-nanopipe and the like) are the flag table's and named in its
// "no effect here" line (config_flags_test.cpp); what the plan switches off is named here.
TEST(ParallelPlan, SwitchedOffFeaturesAreNamedInWarnings) {
  const ModelConfig moe = small_moe();
  // Split experts, SP and chunks, but no expert parallelism: nothing to pipeline the
  // tensor-parallel collectives with.
  ParallelPlan overlap{.tensor_parallel = 2,
                       .sequence_parallel = true,
                       .moe_model_type = "deepspeed_moe",
                       .ampipe_degree = 2,
                       .ampipe_tp_sp_comm_overlap = true};
  const auto warnings = validate(moe, overlap);
  ASSERT_EQ(warnings.size(), 2u);
  EXPECT_TRUE(mentions(warnings[0], "has no all-to-all to hide")) << warnings[0];
  EXPECT_EQ(warnings[1],
            "--ampipe-tp-sp-comm-overlap is switched off: with --expert-model-parallel-size 1 "
            "there are no all-to-alls to pipeline with");
  EXPECT_FALSE(overlap.ampipe_tp_sp_comm_overlap);
}

// The derived values (virtual stages, split experts, a dropped scheduler, pipe experts switched
// off) never hide a refusal of the flags as given.
TEST(ParallelPlan, RulesJudgeTheFlagsAsGiven) {
  const ModelConfig m{.num_layers = 8,
                      .hidden_size = 64,
                      .num_attention_heads = 4,
                      .ffn_hidden_size = 128,
                      .seq_length = 48,
                      .num_experts = 4};
  // One chunk per rank from --num-layers-per-virtual-pipeline-stage, then zb-v's two.
  ParallelPlan v{.pipeline_parallel = 2,
                 .layers_per_virtual_stage = 4,
                 .pipeline_scheduler = "zb-v",
                 .global_batch_size = 4};
  EXPECT_TRUE(validate(m, v).empty());
  EXPECT_EQ(v.virtual_pipeline, 2);
  EXPECT_EQ(
      refusal(m, {.pipeline_parallel = 2, .virtual_pipeline = 0, .layers_per_virtual_stage = 1}),
      "--virtual-pipeline-model-parallel-size must be >= 1, got 0");
  EXPECT_TRUE(mentions(refusal(m, {.pipeline_scheduler = "1f1c"}),
                       "--pipeline-scheduler: unknown pipeline schedule '1f1c'"));
  EXPECT_EQ(refusal(m, {.pipe_experts = true, .pipe_experts_multi_data = 0}),
            "--pipe-experts-multi-data must be >= 1, got 0");
  // A refused plan is left as given.
  ParallelPlan refused{.sequence_parallel = true, .ampipe_degree = 0};
  EXPECT_THROW(validate(m, refused), ConfigError);
  EXPECT_TRUE(refused.sequence_parallel);
}

TEST(ParallelPlan, SequenceParallelIsSwitchedOffAtTensorParallelOne) {
  ParallelPlan p{.sequence_parallel = true};
  const auto warnings = validate(ModelConfig{}, p);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_TRUE(mentions(warnings[0], "switched off"));
  EXPECT_FALSE(p.sequence_parallel);
}

TEST(ParallelPlan, VocabularyIsPaddedForTensorParallelShards) {
  const ModelConfig m{.vocab_size = 256, .make_vocab_size_divisible_by = 128};
  EXPECT_EQ(m.padded_vocab_size(1), 256);
  EXPECT_EQ(m.padded_vocab_size(4), 512);
  const ModelConfig odd{.vocab_size = 300, .make_vocab_size_divisible_by = 8};
  EXPECT_EQ(odd.padded_vocab_size(2), 304);
}

TEST(Mesh, RankOrderIsTensorThenContextThenDataThenPipeline) {
  const Mesh mesh(
      {.tensor_parallel = 2, .context_parallel = 2, .data_parallel = 2, .pipeline_parallel = 2});
  EXPECT_EQ(mesh.size(), 16);
  const MeshCoordinates c = mesh.coordinates(13);  // 13 = 1 + 2 (0 + 2 (1 + 2 * 1))
  EXPECT_EQ(c.tp, 1);
  EXPECT_EQ(c.cp, 0);
  EXPECT_EQ(c.dp, 1);
  EXPECT_EQ(c.pp, 1);
  EXPECT_EQ(mesh.rank_of(1, 0, 1, 1), 13);
  const auto tp = mesh.group(GroupKind::tensor, 13).devices();
  EXPECT_EQ(std::vector<rt::DeviceId>(tp.begin(), tp.end()), (std::vector<rt::DeviceId>{12, 13}));
  const auto cp = mesh.group(GroupKind::context, 13).devices();
  EXPECT_EQ(std::vector<rt::DeviceId>(cp.begin(), cp.end()), (std::vector<rt::DeviceId>{13, 15}));
  const auto dp = mesh.group(GroupKind::data, 13).devices();
  EXPECT_EQ(std::vector<rt::DeviceId>(dp.begin(), dp.end()), (std::vector<rt::DeviceId>{9, 13}));
  const auto dpcp = mesh.group(GroupKind::data_context, 13).devices();
  EXPECT_EQ(std::vector<rt::DeviceId>(dpcp.begin(), dpcp.end()),
            (std::vector<rt::DeviceId>{9, 11, 13, 15}));
  const auto pp = mesh.group(GroupKind::pipeline, 13).devices();
  EXPECT_EQ(std::vector<rt::DeviceId>(pp.begin(), pp.end()), (std::vector<rt::DeviceId>{5, 13}));
  EXPECT_EQ(mesh.group(GroupKind::tensor, 0).name(), "tp0");
}

TEST(Mesh, GroupsOfEachKindPartitionTheDevices) {
  const Mesh mesh({.tensor_parallel = 2, .expert_parallel = 4, .data_parallel = 4});
  for (int k = 0; k <= static_cast<int>(GroupKind::tensor_context); ++k) {
    std::multiset<rt::DeviceId> seen;
    for (const auto& g : mesh.groups(static_cast<GroupKind>(k)))
      for (rt::DeviceId d : g.devices())
        seen.insert(d);
    EXPECT_EQ(seen.size(), 8u) << "kind " << k;
    for (rt::DeviceId d = 0; d < 8; ++d)
      EXPECT_EQ(seen.count(d), 1u) << "kind " << k << " device " << d;
  }
  // Expert parallelism folds over tp x dp: groups of 4 consecutive ranks, replicas 4 apart.
  const auto ep = mesh.group(GroupKind::expert, 5).devices();
  EXPECT_EQ(std::vector<rt::DeviceId>(ep.begin(), ep.end()),
            (std::vector<rt::DeviceId>{4, 5, 6, 7}));
  const auto edp = mesh.group(GroupKind::expert_data, 5).devices();
  EXPECT_EQ(std::vector<rt::DeviceId>(edp.begin(), edp.end()), (std::vector<rt::DeviceId>{1, 5}));
  EXPECT_EQ(mesh.coordinates(6).ep, 2);
  EXPECT_EQ(mesh.coordinates(6).edp, 1);
}

TEST(Mesh, SplitExpertsFoldExpertParallelismOverTheRanksOfOneTensorParallelRank) {
  const Mesh mesh({.tensor_parallel = 2,
                   .expert_parallel = 2,
                   .expert_tensor_parallel = 2,
                   .data_parallel = 4});
  // Expert-parallel groups: ranks with the same tp rank, 2 consecutive data-parallel ranks.
  const auto ep = mesh.group(GroupKind::expert, 5).devices();
  EXPECT_EQ(std::vector<rt::DeviceId>(ep.begin(), ep.end()), (std::vector<rt::DeviceId>{5, 7}));
  // Replicas of one expert shard: same tp rank, same ep rank.
  const auto edp = mesh.group(GroupKind::expert_data, 5).devices();
  EXPECT_EQ(std::vector<rt::DeviceId>(edp.begin(), edp.end()), (std::vector<rt::DeviceId>{1, 5}));
  EXPECT_EQ(mesh.coordinates(7).ep, 1);
  EXPECT_EQ(mesh.coordinates(7).edp, 1);
  EXPECT_TRUE(mesh.experts_split());
}

TEST(ParallelPlan, ExpertTensorParallelRules) {
  const ModelConfig moe = small_moe();
  ParallelPlan deepspeed{.tensor_parallel = 2,
                         .expert_parallel = 2,
                         .moe_model_type = "deepspeed_moe",
                         .data_parallel = 2,
                         .global_batch_size = 2};
  EXPECT_EQ(refusal(moe, deepspeed), "accepted");
  validate(moe, deepspeed);
  EXPECT_EQ(deepspeed.expert_tensor_parallel, 2);
  EXPECT_TRUE(mentions(refusal(moe, {.tensor_parallel = 2, .expert_tensor_parallel = 4}),
                       "--expert-tensor-parallel-size (4) must be 1"));
  EXPECT_TRUE(mentions(
      refusal(moe, {.tensor_parallel = 2, .expert_parallel = 2, .expert_tensor_parallel = 2}),
      "must divide context x data parallel (1 x 1 = 1) when experts are split"));
  EXPECT_TRUE(mentions(
      refusal(moe, {.tensor_parallel = 2, .expert_tensor_parallel = 1, .moe_model_type = "tutel"}),
      "--moe-model-type must be megatron or deepspeed_moe (or megatron_moe, MindSpeed's name for "
      "megatron), got 'tutel'"));
  EXPECT_EQ(refusal(moe, {.tensor_parallel = 2, .moe_model_type = "megatron_moe"}), "accepted");
  ModelConfig dense = moe;
  dense.num_experts = 0;
  EXPECT_TRUE(mentions(refusal(dense, {.tensor_parallel = 2, .expert_tensor_parallel = 2}),
                       "splits experts: set --num-experts"));
}

}  // namespace
}  // namespace weave::graphs
