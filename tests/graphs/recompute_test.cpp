// Activation recomputation (--recompute-granularity full with --recompute-method uniform|block,
// and selective with --recompute-modules core_attn and mlp) changes what a step keeps, never what
// it computes: with dropout on, the losses, aux losses, dropped picks and every gradient are
// bitwise those of the step that keeps every activation, under every strategy it runs with; the
// materialised step's activation memory is the prediction's to the byte; and what is not done is
// refused by name.
#include <gtest/gtest.h>

#include <numeric>
#include <string>

#include "step_outcome.hpp"
#include "tiny_model.hpp"
#include "weave/graphs/prediction.hpp"

namespace weave::graphs {
namespace {

// Four layers, every second MoE when `experts` > 0, both dropouts on.
ModelConfig model(int experts, MoeGate gate = MoeGate::megatron) {
  ModelConfig m = tiny(experts);
  m.moe_gate = gate;
  if (gate == MoeGate::deepspeed) m.moe_z_loss_coeff = 0;  // MindSpeed's gate has none
  m.num_layers = 4;
  m.attention_dropout = 0.1;
  return m;
}

Recompute full(RecomputeMethod method, int layers) {
  return {.granularity = RecomputeGranularity::full, .method = method, .num_layers = layers};
}

struct Case {
  const char* name;
  int experts;
  ParallelPlan plan;
  MoeGate gate = MoeGate::megatron;
};

const Case kCases[] = {
    {"one_device", 4, {.micro_batch_size = 2, .global_batch_size = 4}},
    {"tp2_sp",
     0,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .micro_batch_size = 2,
      .global_batch_size = 4}},
    {"cp2", 0, {.context_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}},
    {"ampipe2_tp2_sp_ep2",
     4,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4,
      .ampipe_degree = 2}},
    {"ampipe2_tp2_ep2_split_overlap",
     4,
     {.tensor_parallel = 2,
      .expert_parallel = 2,
      .expert_tensor_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .ampipe_degree = 2,
      .ampipe_tp_sp_comm_overlap = true}},
    // MindSpeed's gate without SP: every tp rank routes the whole chunk, each item all-reduced.
    {"ampipe2_tp2_ep2_deepspeed_gate_overlap",
     4,
     {.tensor_parallel = 2,
      .expert_parallel = 2,
      .moe_model_type = "deepspeed_moe",
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .ampipe_degree = 2,
      .ampipe_tp_sp_comm_overlap = true},
     MoeGate::deepspeed},
    {"ampipe2_cp2_ep2",
     4,
     {.context_parallel = 2,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4,
      .ampipe_degree = 2}},
    {"pp2_1f1b_ep2",
     4,
     {.expert_parallel = 2,
      .data_parallel = 2,
      .pipeline_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 8}},
    {"pp2_interleaved_tp2_sp",
     0,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .pipeline_parallel = 2,
      .virtual_pipeline = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4}},
};

Recompute selective(unsigned modules) {
  return {.granularity = RecomputeGranularity::selective, .modules = modules};
}

// Each full method with groups of one and of two layers (a chunk of one layer under interleaving
// makes the group of two one layer: Megatron-LM's last group is what remains of the chunk); the
// selective modules alone and together (0: Megatron-Core's default, core_attn).
const Recompute kMethods[] = {
    full(RecomputeMethod::uniform, 1), full(RecomputeMethod::uniform, 2),
    full(RecomputeMethod::block, 1),   selective(0),
    selective(kRecomputeMlp),          selective(kRecomputeCoreAttention | kRecomputeMlp)};

std::string method_name(const Recompute& r) {
  if (!r.full()) return "selective " + std::to_string(r.modules);
  return std::string(r.method == RecomputeMethod::uniform ? "uniform " : "block ") +
         std::to_string(r.num_layers);
}

void expect_bitwise_equal(const Outcome& kept, const Outcome& recomputed) {
  EXPECT_EQ(recomputed.losses, kept.losses);
  EXPECT_EQ(recomputed.aux, kept.aux);
  EXPECT_EQ(recomputed.dropped, kept.dropped);
  ASSERT_EQ(recomputed.grads.size(), kept.grads.size());
  for (const auto& [name, want] : kept.grads) {
    const auto& got = recomputed.grads.at(name);
    ASSERT_EQ(got.size(), want.size()) << name;
    for (std::size_t i = 0; i < want.size(); ++i)
      if (got[i] != want[i]) {  // the first differing element names the parameter
        ADD_FAILURE() << name << " element " << i << ": " << got[i] << ", want " << want[i];
        break;
      }
  }
}

class Recomputation : public ::testing::TestWithParam<Case> {};

// Two steps (the second after an update), so the gradients compared are of updated parameters
// and the dropout masks of another iteration.
TEST_P(Recomputation, IsBitwiseTheStepThatKeepsEveryActivation) {
  const Case& c = GetParam();
  ModelConfig m = model(c.experts, c.gate);
  const Outcome kept = run(m, c.plan, 2, true);
  for (const Recompute& r : kMethods) {
    SCOPED_TRACE(method_name(r));
    m.recompute = r;
    expect_bitwise_equal(kept, run(m, c.plan, 2, true));
  }
}

// The materialised step holds, after it ran, the activation memory its prediction counts, device
// by device, and recomputation holds no more than keeping (less where more than one set is in
// flight).
TEST_P(Recomputation, MeasuredActivationMemoryIsThePredictedOne) {
  const Case& c = GetParam();
  auto measured = [&](const ModelConfig& m) {
    ParallelPlan plan = c.plan;
    validate(m, plan);
    devices::DeviceSet set(plan.devices(), {.pin = false});
    devices::SharedMemoryCommunicator comm;
    TrainingStep step(m, plan, {}, set, comm);
    fill_batches(step, m, plan);
    step.prepare(1, 1e-2);
    set.executor().run(step.graph());
    std::vector<std::int64_t> bytes;
    for (int d = 0; d < plan.devices(); ++d)
      bytes.push_back(
          set.memory().peak(static_cast<rt::DeviceId>(d), rt::MemoryCategory::activations));
    return bytes;
  };
  auto predicted = [&](const ModelConfig& m) {
    TrainerConfig config;
    config.model = m;
    config.plan = c.plan;
    const Prediction p = predict_step(config);
    std::vector<std::int64_t> bytes;
    for (const auto& device : p.memory)
      bytes.push_back(device[static_cast<std::size_t>(rt::MemoryCategory::activations)]);
    return bytes;
  };
  ModelConfig m = model(c.experts, c.gate);
  const std::vector<std::int64_t> kept = measured(m);
  EXPECT_EQ(kept, predicted(m));
  for (const Recompute& r : kMethods) {
    SCOPED_TRACE(method_name(r));
    m.recompute = r;
    const std::vector<std::int64_t> recomputed = measured(m);
    EXPECT_EQ(recomputed, predicted(m));
    for (std::size_t d = 0; d < kept.size(); ++d)
      EXPECT_LE(recomputed[d], kept[d]) << "device " << d;
    // core_attn alone frees nothing (the blockwise attention keeps no scores); uniform groups and
    // the MLP free some device's memory (block 1 recomputes one layer a chunk: with one set in
    // flight its working set is what it frees).
    if (r.recomputes(kRecomputeCoreAttention) && !r.recomputes(kRecomputeMlp)) {
      EXPECT_EQ(recomputed, kept);
    } else if (r.method != RecomputeMethod::block) {
      EXPECT_LT(std::accumulate(recomputed.begin(), recomputed.end(), std::int64_t{0}),
                std::accumulate(kept.begin(), kept.end(), std::int64_t{0}));
    }
  }
}

// The zero-bubble schedules' W actions read, after the input gradients, the activations a
// recomputed layer hands to the next: the plan rule refuses them by name.
TEST(FullRecomputationRefusal, NamesTheZeroBubbleSchedules) {
  for (const char* scheduler : {"zb-h1", "zb-v"}) {
    ModelConfig m = model(0);
    m.recompute = full(RecomputeMethod::uniform, 1);
    ParallelPlan plan{.pipeline_parallel = 2,
                      .pipeline_scheduler = scheduler,
                      .micro_batch_size = 1,
                      .global_batch_size = 4};
    if (std::string(scheduler) == "zb-v") plan.virtual_pipeline = 2;
    try {
      validate(m, plan);
      ADD_FAILURE() << scheduler << " accepted";
    } catch (const ConfigError& e) {
      EXPECT_PRED_FORMAT2(::testing::IsSubstring,
                          std::string("is not done with --pipeline-scheduler ") + scheduler,
                          e.what());
      EXPECT_PRED_FORMAT2(::testing::IsSubstring, "--recompute-granularity full", e.what());
    }
  }
}

// Selective recomputation of the MLP under a zero-bubble schedule, and the modules weave does not
// recompute (moe, moe_act, layernorm), are refused by name; core_attn is taken there.
TEST(SelectiveRecomputationRefusal, NamesWhatIsNotDone) {
  auto refusal = [](const Recompute& r, const char* scheduler) -> std::string {
    ModelConfig m = model(4);
    m.recompute = r;
    ParallelPlan plan{.pipeline_parallel = 2,
                      .pipeline_scheduler = scheduler,
                      .micro_batch_size = 1,
                      .global_batch_size = 4};
    try {
      validate(m, plan);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "accepted";
  };
  EXPECT_EQ(refusal(selective(kRecomputeCoreAttention), "zb-h1"), "accepted");
  EXPECT_PRED_FORMAT2(::testing::IsSubstring,
                      "--recompute-modules mlp is not done with --pipeline-scheduler zb-h1",
                      refusal(selective(kRecomputeMlp), "zb-h1"));
  for (const unsigned module : {kRecomputeMoe, kRecomputeMoeActivation, kRecomputeLayerNorm})
    EXPECT_PRED_FORMAT2(::testing::IsSubstring,
                        "--recompute-modules moe, moe_act and layernorm are not done here",
                        refusal(selective(kRecomputeMlp | module), "1f1b"));
  EXPECT_PRED_FORMAT2(::testing::IsSubstring, "--recompute-modules names what",
                      refusal({.modules = kRecomputeMlp}, "1f1b"));
}

INSTANTIATE_TEST_SUITE_P(Plans, Recomputation, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace weave::graphs
