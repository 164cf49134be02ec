// Activation recomputation (--recompute-granularity full with --recompute-method uniform|block,
// and selective with --recompute-modules core_attn, mlp, layernorm and moe_act) changes what a
// step keeps, never what it computes: with dropout on, the losses, aux losses, dropped picks and
// every gradient are bitwise those of the step that keeps every activation, under every strategy it
// runs with; the materialised step's activation memory is the prediction's to the byte; and what is
// not done is refused by name.
#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <tuple>
#include <vector>

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
    // Zero bubble: the experts' W actions compute their activation again (moe_act); the rest
    // of selective recomputation and full recomputation are refused there.
    {"pp2_zb_h1_ep2",
     4,
     {.expert_parallel = 2,
      .data_parallel = 2,
      .pipeline_parallel = 2,
      .pipeline_scheduler = "zb-h1",
      .micro_batch_size = 1,
      .global_batch_size = 4}},
    // Experts split over tp (--expert-tensor-parallel-size 2): every tp rank's rows gathered.
    {"tp2_sp_ep2_etp2",
     4,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .expert_tensor_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4}},
    // MindSpeed's deepspeed_moe experts split over tp, routed replicated: their weight half runs
    // apart, under fc1's input-gradient all-reduce, and computes the activation again (moe_act).
    {"tp2_ep2_deepspeed_moe",
     4,
     {.tensor_parallel = 2,
      .expert_parallel = 2,
      .moe_model_type = "deepspeed_moe",
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4},
     MoeGate::deepspeed},
    // --use-pipe-experts without Ampipe: the MoE layer's items recomputed with it (moe).
    {"ep2_pipe_experts",
     4,
     {.expert_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .pipe_experts = true,
      .pipe_experts_multi_data = 2}},
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

constexpr unsigned kEveryModule = kRecomputeCoreAttention | kRecomputeMlp | kRecomputeLayerNorm |
                                  kRecomputeMoeActivation | kRecomputeMoe;

// Each full method with groups of one and of two layers (a chunk of one layer under interleaving
// makes the group of two one layer: Megatron-LM's last group is what remains of the chunk); the
// selective modules alone and together (0: Megatron-Core's default, core_attn).
const Recompute kMethods[] = {
    full(RecomputeMethod::uniform, 1), full(RecomputeMethod::uniform, 2),
    full(RecomputeMethod::block, 1),   selective(0),
    selective(kRecomputeMlp),          selective(kRecomputeCoreAttention | kRecomputeMlp),
    selective(kRecomputeLayerNorm),    selective(kRecomputeMoeActivation),
    selective(kRecomputeMoe),          selective(kEveryModule)};

// Whether the plan rules take `m` with `plan` (a module refused with a plan is tested by its
// refusal below).
bool accepted(const ModelConfig& m, ParallelPlan plan) {
  try {
    validate(m, plan);
  } catch (const ConfigError&) {
    return false;
  }
  return true;
}

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

// The activation memory each device of the materialised step held at its peak, after one step.
std::vector<std::int64_t> measured_activations(const ModelConfig& m, ParallelPlan plan) {
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
}

// What `weave predict` counts for each device's activations.
std::vector<std::int64_t> predicted_activations(const ModelConfig& m, const ParallelPlan& plan) {
  TrainerConfig config;
  config.model = m;
  config.plan = plan;
  const Prediction p = predict_step(config);
  std::vector<std::int64_t> bytes;
  for (const auto& device : p.memory)
    bytes.push_back(device[static_cast<std::size_t>(rt::MemoryCategory::activations)]);
  return bytes;
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
    if (!accepted(m, c.plan)) continue;
    expect_bitwise_equal(kept, run(m, c.plan, 2, true));
  }
}

// The materialised step holds, after it ran, the activation memory its prediction counts, device
// by device, and recomputation holds no more than keeping (less where more than one set is in
// flight).
TEST_P(Recomputation, MeasuredActivationMemoryIsThePredictedOne) {
  const Case& c = GetParam();
  auto measured = [&](const ModelConfig& m) { return measured_activations(m, c.plan); };
  auto predicted = [&](const ModelConfig& m) { return predicted_activations(m, c.plan); };
  ModelConfig m = model(c.experts, c.gate);
  const std::vector<std::int64_t> kept = measured(m);
  EXPECT_EQ(kept, predicted(m));
  for (const Recompute& r : kMethods) {
    SCOPED_TRACE(method_name(r));
    m.recompute = r;
    if (!accepted(m, c.plan)) continue;
    const std::vector<std::int64_t> recomputed = measured(m);
    EXPECT_EQ(recomputed, predicted(m));
    for (std::size_t d = 0; d < kept.size(); ++d)
      EXPECT_LE(recomputed[d], kept[d]) << "device " << d;
    // core_attn alone frees nothing (the blockwise attention keeps no scores), nor moe_act
    // without MoE layers; uniform groups, the MLP, the norms and the experts' activation free
    // some device's memory (block 1 recomputes one layer a chunk: with one set in flight its
    // working set is what it frees).
    if ((r.recomputes(kRecomputeCoreAttention) && r.modules == 0) ||
        r.modules == kRecomputeCoreAttention ||
        ((r.modules == kRecomputeMoeActivation || r.modules == kRecomputeMoe) && c.experts == 0)) {
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

// Selective recomputation frees exactly what it recomputes, measured and predicted alike. The
// norms (layernorm): each layer's two norms keep their output (under SP its gather too) and their
// statistics, which recomputed are one working set per norm for the rank: L - 1 layers' worth
// freed on one device, one set in flight. The experts' activation (moe_act): each MoE layer's
// hidden layer after the activation [capacity, f], one for the rank when recomputed.
TEST(SelectiveRecomputation, FreesExactlyTheRecomputedTensors) {
  const ModelConfig dense = model(0), moe = model(4);
  const std::int64_t S = dense.seq_length, h = dense.hidden_size, L = dense.num_layers, a = 4;
  const std::int64_t B = 2;
  auto freed = [](ModelConfig m, const ParallelPlan& plan, unsigned modules) {
    const std::vector<std::int64_t> kept = measured_activations(m, plan);
    EXPECT_EQ(kept, predicted_activations(m, plan));
    m.recompute = selective(modules);
    const std::vector<std::int64_t> recomputed = measured_activations(m, plan);
    EXPECT_EQ(recomputed, predicted_activations(m, plan));
    std::vector<std::int64_t> difference;
    for (std::size_t d = 0; d < kept.size(); ++d)
      difference.push_back(kept[d] - recomputed[d]);
    return difference;
  };
  const ParallelPlan one{.micro_batch_size = B, .global_batch_size = 2 * B};
  const std::int64_t norm = S * B * h + 2 * S * B;  // output, mean and rstd
  EXPECT_EQ(freed(dense, one, kRecomputeLayerNorm),
            std::vector<std::int64_t>{(L - 1) * 2 * norm * a});
  // tp2 + SP: a rank's output [S / 2, B, h], its gather [S, B, h] and the statistics of its rows.
  const ParallelPlan tp2_sp{.tensor_parallel = 2,
                            .sequence_parallel = true,
                            .micro_batch_size = B,
                            .global_batch_size = 2 * B};
  const std::int64_t sp_norm = S / 2 * B * h + S * B * h + 2 * (S / 2) * B;
  EXPECT_EQ(freed(dense, tp2_sp, kRecomputeLayerNorm),
            std::vector<std::int64_t>(2, (L - 1) * 2 * sp_norm * a));
  // Two MoE layers of four, no capacity factor: every token's top-k picks are the capacity.
  const std::int64_t capacity = S * B * moe.moe_router_topk, f = moe.ffn_hidden_size;
  EXPECT_EQ(freed(moe, one, kRecomputeMoeActivation),
            std::vector<std::int64_t>{(2 - 1) * capacity * f * a});
  // moe: each MoE layer's whole MoE state (router, dispatch and experts rows, statistics,
  // output) but its input, the norm's output; one for the rank when recomputed. Two MoE layers of
  // four free one layer's state; four of four free three times as much.
  ModelConfig every = moe;
  every.moe_layer_freq = 1;
  const std::vector<std::int64_t> two = freed(moe, one, kRecomputeMoe),
                                  four = freed(every, one, kRecomputeMoe);
  EXPECT_GT(two[0], capacity * f * a);  // more than the experts' activation alone
  EXPECT_EQ(four, std::vector<std::int64_t>{3 * two[0]});
  // Both on the MoE model: the norms of its dense and MoE layers alike, and the activation.
  EXPECT_EQ(freed(moe, one, kRecomputeLayerNorm | kRecomputeMoeActivation),
            std::vector<std::int64_t>{(L - 1) * 2 * norm * a + capacity * f * a});
}

// The recomputed forwards are priced as the tasks the step runs, on the virtual clock as in the
// prediction (the prediction replays the same graph without tensors): one device, two
// micro-batches, each layer's two norms again (read the input, write the output: 2 S B h values
// each) and each MoE layer's experts' activation again (read fc1's output, write the hidden
// layer: top-k S B rows of f1 + f). No product runs again: the FLOPs are unchanged. A MoE
// layer recomputed whole (moe) adds its forward's every task once more.
TEST(SelectiveRecomputation, PricesTheRecomputedNormsAndActivation) {
  const ModelConfig base = model(4);
  const ParallelPlan plan{.micro_batch_size = 2, .global_batch_size = 4};
  const double S = base.seq_length, B = 2, h = base.hidden_size, L = base.num_layers, a = 4;
  const double M = 2, moe_layers = 2, f = base.ffn_hidden_size, k = base.moe_router_topk;
  auto totals = [&](unsigned modules) {
    ModelConfig m = base;
    if (modules != 0) m.recompute = selective(modules);
    ParallelPlan p = plan;
    validate(m, p);
    devices::DeviceSet set(p.devices(), {.pin = false});
    devices::SharedMemoryCommunicator comm;
    const TrainingStep step(m, p, {}, set, comm, {.materialize = false});
    double flops = 0, bytes = 0;
    int again = 0;
    const rt::TaskTable& tasks = step.graph().tasks();
    for (rt::TaskId t = 0; t < tasks.size(); ++t) {
      flops += tasks[t].cost.flops;
      bytes += tasks[t].cost.bytes;
      const std::string name(tasks.name(t));
      again += name.find("norm_again") != std::string::npos;
    }
    return std::tuple{flops, bytes, again};
  };
  const auto [flops, bytes, none] = totals(0);
  EXPECT_EQ(none, 0);
  const auto [norm_flops, norm_bytes, norms] = totals(kRecomputeLayerNorm);
  EXPECT_EQ(norms, static_cast<int>(M * L * 2));
  EXPECT_DOUBLE_EQ(norm_flops, flops);
  EXPECT_DOUBLE_EQ(norm_bytes - bytes, M * L * 2 * (2 * S * B * h) * a);
  const auto [act_flops, act_bytes, act_norms] = totals(kRecomputeMoeActivation);
  EXPECT_EQ(act_norms, 0);
  EXPECT_DOUBLE_EQ(act_flops, flops);
  EXPECT_DOUBLE_EQ(act_bytes - bytes, M * moe_layers * (k * S * B) * (f + f) * a);
  // moe: the MoE layer's forward again, its every task priced as in the forward (the tasks
  // between the attention's residual and the MLP's, collectives included).
  const auto [moe_flops, moe_bytes, moe_norms] = totals(kRecomputeMoe);
  EXPECT_EQ(moe_norms, 0);
  double forward_flops = 0, forward_bytes = 0;
  {
    ParallelPlan p = plan;
    validate(base, p);
    devices::DeviceSet set(p.devices(), {.pin = false});
    devices::SharedMemoryCommunicator comm;
    const TrainingStep step(base, p, {}, set, comm, {.materialize = false});
    const rt::TaskTable& tasks = step.graph().tasks();
    bool inside = false;
    for (rt::TaskId t = 0; t < tasks.size(); ++t) {
      const std::string name(tasks.name(t));
      const bool moe_layer = name.rfind("L0.", 0) == 0 || name.rfind("L2.", 0) == 0;
      if (moe_layer && name.ends_with(".mlp_residual")) inside = false;
      if (inside) {
        forward_flops += tasks[t].cost.flops;
        forward_bytes += tasks[t].cost.bytes;
      }
      if (moe_layer && name.ends_with(".attention_residual")) inside = true;
    }
  }
  EXPECT_GT(forward_flops, 0);
  EXPECT_DOUBLE_EQ(moe_flops - flops, forward_flops);
  EXPECT_DOUBLE_EQ(moe_bytes - bytes, forward_bytes);
  // The prediction's recomputed model FLOPs, as Megatron-LM counts them: per token of the batch,
  // a MoE layer's router logits (2 h E) and its top-k experts' two products (2 x 2 h f each);
  // the norms and the activation run no product.
  auto recomputed_flops = [&](unsigned modules) {
    TrainerConfig config;
    config.model = base;
    config.model.recompute = selective(modules);
    config.plan = plan;
    return predict_step(config).flops_recomputed;
  };
  const double E = base.num_experts, tokens = plan.global_batch_size * S;
  EXPECT_EQ(recomputed_flops(kRecomputeLayerNorm | kRecomputeMoeActivation), 0);
  EXPECT_DOUBLE_EQ(recomputed_flops(kRecomputeMoe),
                   tokens * moe_layers * (2 * h * E + k * 2 * 2 * h * f));
}

// What selective recomputation does not do is refused by name, with the rule's reason and its
// fix: the MLP's, the norms' and the MoE layer's under a zero-bubble schedule (their W actions
// read a working set the next recomputation writes), the norms' and the MoE layer's under
// Ampipe, the experts' activation with expert items; core_attn and moe_act are taken under zero
// bubble, every module together under 1F1B, and modules without selective granularity are
// refused as before.
TEST(SelectiveRecomputationRefusal, NamesWhatIsNotDone) {
  auto refusal = [](const Recompute& r, ParallelPlan plan) -> std::string {
    ModelConfig m = model(4);
    m.recompute = r;
    try {
      validate(m, plan);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "accepted";
  };
  const ParallelPlan zb{.pipeline_parallel = 2,
                        .pipeline_scheduler = "zb-h1",
                        .micro_batch_size = 1,
                        .global_batch_size = 4};
  const ParallelPlan one_f_one_b{.pipeline_parallel = 2,
                                 .pipeline_scheduler = "1f1b",
                                 .micro_batch_size = 1,
                                 .global_batch_size = 4};
  const ParallelPlan ampipe{.expert_parallel = 2,
                            .data_parallel = 2,
                            .micro_batch_size = 2,
                            .global_batch_size = 4,
                            .ampipe_degree = 2};
  ParallelPlan pipe_experts = ampipe;
  pipe_experts.pipe_experts = true;
  pipe_experts.pipe_experts_multi_data = 4;  // more slices than the degree: MindSpeed's rule
  EXPECT_EQ(refusal(selective(kRecomputeCoreAttention), zb), "accepted");
  EXPECT_EQ(refusal(selective(kRecomputeMoeActivation), zb), "accepted");
  EXPECT_EQ(refusal(selective(kRecomputeMoeActivation), ampipe), "accepted");
  EXPECT_EQ(refusal(selective(kEveryModule), one_f_one_b), "accepted");
  EXPECT_PRED_FORMAT2(::testing::IsSubstring,
                      "--recompute-modules mlp is not done with --pipeline-scheduler zb-h1",
                      refusal(selective(kRecomputeMlp), zb));
  const std::string norms_zb = refusal(selective(kRecomputeLayerNorm), zb);
  EXPECT_PRED_FORMAT2(::testing::IsSubstring,
                      "--recompute-modules layernorm is not done with --pipeline-scheduler zb-h1",
                      norms_zb);
  EXPECT_PRED_FORMAT2(::testing::IsSubstring, "Choose --pipeline-scheduler 1f1b", norms_zb);
  const std::string norms_ampipe = refusal(selective(kRecomputeLayerNorm), ampipe);
  EXPECT_PRED_FORMAT2(::testing::IsSubstring,
                      "--recompute-modules layernorm is not done with --ampipe-degree 2",
                      norms_ampipe);
  EXPECT_PRED_FORMAT2(::testing::IsSubstring, "set --ampipe-degree 1", norms_ampipe);
  const std::string act_items = refusal(selective(kRecomputeMoeActivation), pipe_experts);
  EXPECT_PRED_FORMAT2(::testing::IsSubstring,
                      "--recompute-modules moe_act is not done with --use-pipe-experts", act_items);
  EXPECT_PRED_FORMAT2(::testing::IsSubstring, "leave out --use-pipe-experts", act_items);
  const std::string moe_zb = refusal(selective(kRecomputeMoe), zb);
  EXPECT_PRED_FORMAT2(::testing::IsSubstring,
                      "--recompute-modules moe is not done with --pipeline-scheduler zb-h1",
                      moe_zb);
  EXPECT_PRED_FORMAT2(::testing::IsSubstring, "or drop moe", moe_zb);
  const std::string moe_ampipe = refusal(selective(kRecomputeMoe), ampipe);
  EXPECT_PRED_FORMAT2(::testing::IsSubstring,
                      "--recompute-modules moe is not done with --ampipe-degree 2", moe_ampipe);
  EXPECT_PRED_FORMAT2(::testing::IsSubstring, "--recompute-granularity full", moe_ampipe);
  EXPECT_PRED_FORMAT2(::testing::IsSubstring, "--recompute-modules names what",
                      refusal({.modules = kRecomputeMlp}, one_f_one_b));
}

INSTANTIATE_TEST_SUITE_P(Plans, Recomputation, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace weave::graphs
