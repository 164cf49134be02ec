// ZeRO stages 2 and 3. Stage 2: every micro-batch's layer gradients reduce-scattered into the
// replica's shard as the backward completes them, the full buckets held in two shared slots only;
// stage 3: each layer's parameters kept as shards and gathered into one of two slots before each
// use. Losses and gradient shards against plain data parallelism, alone and beside tp+sp, cp, ep,
// pp (zero-bubble schedules included), Ampipe, bf16 and full recomputation; each device's gradient
// and parameter memory against the closed forms, predicted and materialised; the next layer's
// gather under the current layer's compute on the virtual clock, and more of the gathers hidden
// with more units in flight (--zero-units-in-flight); --advise weighing the stages.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "materialised_step.hpp"
#include "tiny_model.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/plan_search.hpp"
#include "weave/graphs/prediction.hpp"
#include "weave/graphs/training_step.hpp"

namespace weave::graphs {
namespace {

struct Trained {
  std::vector<double> losses;
  // By rank and bucket: the gradient elements the stage-2 replica keeps, taken from this run's
  // buckets over the same range.
  std::vector<std::vector<std::vector<float>>> shards;
};

// `steps` steps of the same batch with AdamW; the gradients of the last step, over the ranges
// `ranges` gives by rank and bucket (begin, size), or this run's own shards when empty.
Trained train(const ModelConfig& m, ParallelPlan plan, int steps,
              const std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>>& ranges,
              std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>>* own = nullptr) {
  validate(m, plan);
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  const OptimizerConfig opt{
      .adamw = {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1}, .clip_grad = 1.0};
  TrainingStep step(m, plan, opt, set, comm);
  Trained out;
  for (int it = 1; it <= steps; ++it) {
    fill_batches(step, m, plan);
    step.prepare(it, 1e-2);
    set.executor().run(step.graph());
    out.losses.push_back(step.result().loss);
  }
  out.shards.resize(static_cast<std::size_t>(plan.devices()));
  if (own) own->assign(out.shards.size(), {});
  for (int r = 0; r < plan.devices(); ++r) {
    const std::vector<GradientBucket>& buckets = step.shard(r).buckets();
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      const GradientBucket& bucket = buckets[b];
      std::vector<float> kept;
      if (own) {
        const ops::Tensor g = bucket.shard_grads();
        kept.assign(g.data(), g.data() + g.numel());
        (*own)[static_cast<std::size_t>(r)].emplace_back(bucket.shard_begin, bucket.shard_size);
      } else {
        const auto [begin, size] = ranges[static_cast<std::size_t>(r)][b];
        kept.assign(bucket.grads.data() + begin, bucket.grads.data() + begin + size);
      }
      out.shards[static_cast<std::size_t>(r)].push_back(std::move(kept));
    }
  }
  return out;
}

struct Case {
  const char* name;
  int experts;
  ParallelPlan plan;
  bool full_recompute = false;  // each layer's forward again in the backward, gathers included
  bool bf16 = false;  // fp32 main values and gradients, bf16 copies (stage 3 gathers them)
  int layers = 4;
};

class ZeroStages : public ::testing::TestWithParam<Case> {};

void expect_equals_plain_data_parallelism(const Case& c, int stage);

// Four layers, so that the two gradient slots are taken in turn, and several micro-batches per
// replica, each reduced on its own.
ModelConfig four_layers(int experts) {
  ModelConfig m = tiny(experts);
  m.num_layers = 4;
  return m;
}

// Stage 3 (parameters sharded too, gathered per layer before each use) as well: a gather that
// did not move the owners' shards into the slot would show in the losses.
TEST_P(ZeroStages, LossesAndGradientShardsEqualPlainDataParallelism) {
  for (const int stage : {2, 3}) {
    SCOPED_TRACE(::testing::Message() << "stage " << stage);
    expect_equals_plain_data_parallelism(GetParam(), stage);
  }
}

void expect_equals_plain_data_parallelism(const Case& c, int stage) {
  ModelConfig m = four_layers(c.experts);
  m.num_layers = c.layers;
  if (c.bf16) m.precision = Precision::bf16;
  if (c.full_recompute)
    m.recompute = {.granularity = RecomputeGranularity::full,
                   .method = RecomputeMethod::uniform,
                   .num_layers = 1};
  ParallelPlan sharded_plan = c.plan;
  sharded_plan.distributed_optimizer = true;
  sharded_plan.shard_gradients = true;
  sharded_plan.shard_parameters = stage == 3;
  std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> ranges;
  const Trained sharded = train(m, sharded_plan, 4, {}, &ranges);
  const Trained plain = train(m, c.plan, 4, ranges);
  // fp32: the shards' reductions and the gradient norm sum in another order, which moves the
  // values by a few fp32 units (1e-9 of the loss seen). bf16 starts the same, but the fp32 main
  // values that differ by those units round to bf16 copies one bf16 unit (2^-8) apart wherever a
  // value lies that close to a rounding tie; from the first update on, the losses may differ by
  // what a few such weights move (2e-5 of the loss seen on an AVX2 host by step 4), so the bound
  // after the first update is a quarter of a bf16 unit. The first step's loss, before any
  // update, keeps the fp32 bound.
  constexpr double kBf16Unit = 1.0 / 256;
  for (std::size_t i = 0; i < plain.losses.size(); ++i) {
    const double bound = c.bf16 && i >= 1 ? kBf16Unit / 4 : 1e-5;
    EXPECT_NEAR(sharded.losses[i], plain.losses[i], bound * plain.losses[i]) << "step " << i + 1;
  }
  // The gradients, within 1e-4 of the bucket's largest: fp32's after the last step. bf16's after
  // the first step, while both runs still hold the same bf16 copies: once a copy sits a bf16 unit
  // apart, a token whose two best experts score that close may go to the other one, which moves
  // gradients by far more than any rounding bound (10 % of an element, seen at step 4 in a build
  // at another optimisation level), so later gradients are not comparable element by element.
  std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> first_ranges;
  const Trained sharded_grads = c.bf16 ? train(m, sharded_plan, 1, {}, &first_ranges) : sharded;
  const Trained plain_grads = c.bf16 ? train(m, c.plan, 1, first_ranges) : plain;
  const float grad_bound = 1e-4f;
  bool any_sharded = false;
  for (std::size_t r = 0; r < plain_grads.shards.size(); ++r)
    for (std::size_t b = 0; b < plain_grads.shards[r].size(); ++b) {
      const std::vector<float>& want = plain_grads.shards[r][b];
      const std::vector<float>& got = sharded_grads.shards[r][b];
      ASSERT_EQ(got.size(), want.size());
      any_sharded |= ranges[r][b].first > 0;
      float scale = 0;
      for (const float v : want)
        scale = std::max(scale, std::abs(v));
      for (std::size_t i = 0; i < want.size(); ++i)
        if (!(std::abs(got[i] - want[i]) <= grad_bound * scale + 1e-9f)) {
          ADD_FAILURE() << "rank " << r << " bucket " << b << " element " << i << ": " << got[i]
                        << ", want " << want[i];
          break;
        }
    }
  EXPECT_TRUE(any_sharded);  // some replica kept a shard other than the first
}

const Case kCases[] = {
    {"dp2", 0, {.data_parallel = 2, .micro_batch_size = 1, .global_batch_size = 8}},
    {"tp2_sp_dp2",
     0,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4}},
    {"cp2_dp2",
     0,
     {.context_parallel = 2, .data_parallel = 2, .micro_batch_size = 1, .global_batch_size = 4}},
    {"moe_dp4_ep2",
     4,
     {.expert_parallel = 2, .data_parallel = 4, .micro_batch_size = 1, .global_batch_size = 8}},
    {"pp2_dp2",
     0,
     {.data_parallel = 2, .pipeline_parallel = 2, .micro_batch_size = 1, .global_batch_size = 8}},
    // The weight passes: each micro-batch's layer buckets reduced after its W action.
    {"pp2_dp2_zb_h1",
     4,
     {.data_parallel = 2,
      .pipeline_parallel = 2,
      .pipeline_scheduler = "zb-h1",
      .micro_batch_size = 1,
      .global_batch_size = 8}},
    {"pp2_dp2_zb_v",
     0,
     {.data_parallel = 2,
      .pipeline_parallel = 2,
      .virtual_pipeline = 2,
      .pipeline_scheduler = "zb-v",
      .micro_batch_size = 1,
      .global_batch_size = 8}},
    // More layers a stage than gradient slots: the gradients the I actions write held aside
    // until their layer's W action takes a slot.
    {"pp2_dp2_zb_h1_8_layers",
     4,
     {.data_parallel = 2,
      .pipeline_parallel = 2,
      .pipeline_scheduler = "zb-h1",
      .micro_batch_size = 1,
      .global_batch_size = 8},
     false,
     false,
     8},
    {"pp2_dp2_zb_v_8_layers",
     0,
     {.data_parallel = 2,
      .pipeline_parallel = 2,
      .virtual_pipeline = 2,
      .pipeline_scheduler = "zb-v",
      .micro_batch_size = 1,
      .global_batch_size = 8},
     false,
     false,
     8},
    // Ampipe's chunks: the MoE layers' buckets reduced after the chunks' backward, the QKV
    // weight half kept inside it.
    {"moe_dp2_ep2_ampipe2",
     4,
     {.expert_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .ampipe_degree = 2}},
    {"dp2_full_recompute",
     0,
     {.data_parallel = 2, .micro_batch_size = 1, .global_batch_size = 4},
     true},
    {"moe_dp2_bf16",
     4,
     {.data_parallel = 2, .micro_batch_size = 1, .global_batch_size = 4},
     false,
     true},
};

INSTANTIATE_TEST_SUITE_P(Plans, ZeroStages, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// The memory tests' configuration: four_layers(4) under `plan` on 1 TFLOP/s devices with
// NVLink 4, validated.
TrainerConfig memory_config(const ParallelPlan& plan) {
  TrainerConfig c;
  c.model = four_layers(4);
  c.plan = plan;
  c.machine = {.device_flops = 1e12, .device_memory_bandwidth = 1e11, .link = "nvlink4"};
  validate(c.model, c.plan);
  return c;
}

// Rank 0's buckets in the step c builds, in elements: each layer's (the buckets `in_layer`
// picks, by the layer their name starts with), the others' (the embeddings', the model end's),
// and rank 0's shards of the layers'; and a layer bucket not sharded, if any.
struct Rank0Buckets {
  std::map<int, std::int64_t> layers;
  std::int64_t rest = 0, shards = 0;
  std::string unsharded;
};

bool named_for_a_layer(const GradientBucket& b) {
  return b.name.rfind("layers.", 0) == 0;
}

bool staged(const GradientBucket& b) {
  return b.staged;
}

Rank0Buckets rank0_buckets(const TrainerConfig& c, bool (*in_layer)(const GradientBucket&)) {
  Rank0Buckets out;
  devices::DeviceSet set(c.plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  TrainingStep step(c.model, c.plan, {}, set, comm);
  for (const GradientBucket& b : step.shard(0).buckets()) {
    if (!in_layer(b)) {
      out.rest += b.values.numel();
      continue;
    }
    if (!b.sharded && out.unsharded.empty()) out.unsharded = b.name;
    out.layers[std::stoi(b.name.substr(7))] += b.values.numel();
    out.shards += b.shard_size;
  }
  return out;
}

// weave predict gives the materialised step's memory and length.
void expect_predicted_as_materialised(const TrainerConfig& c, const MaterialisedStep& r) {
  const Prediction p = predict_step(c);
  EXPECT_EQ(p.memory, r.memory);
  EXPECT_DOUBLE_EQ(p.step_ms, static_cast<double>(r.replay.makespan) * 1e-6);
}

// Each device holds the embeddings' and the model end's buckets whole, its shard of every layer
// bucket, and two slots each as large as a layer's buckets: predicted and materialised alike.
TEST(ZeroStage2Memory, GradientsAreTheShardsAndTwoLayerSlots) {
  TrainerConfig c = memory_config(ParallelPlan{.expert_parallel = 2,
                                               .data_parallel = 4,
                                               .micro_batch_size = 1,
                                               .global_batch_size = 8,
                                               .distributed_optimizer = true});
  // The buckets of stage 1, whose layout stage 2 keeps: elements by layer, and the rest (a
  // gradient bucket is as large as its values, a sharded one's shard 1 / replicas of it).
  const Rank0Buckets buckets = rank0_buckets(c, named_for_a_layer);
  ASSERT_TRUE(buckets.unsharded.empty()) << buckets.unsharded;
  std::map<int, std::int64_t> layer_elements = buckets.layers;
  const std::int64_t rest = buckets.rest, sharded_layers = buckets.shards;
  // Layers 0 and 2 take slot 0, layers 1 and 3 slot 1.
  const std::int64_t slots = std::max(layer_elements[0], layer_elements[2]) +
                             std::max(layer_elements[1], layer_elements[3]);
  const auto stage1_peak =
      materialised_step(c).memory[0][static_cast<std::size_t>(rt::MemoryCategory::gradients)];
  c.plan.shard_gradients = true;
  const MaterialisedStep r = materialised_step(c);
  const std::int64_t peak = r.memory[0][static_cast<std::size_t>(rt::MemoryCategory::gradients)];
  EXPECT_EQ(peak, static_cast<std::int64_t>(sizeof(float)) * (rest + sharded_layers + slots));
  EXPECT_EQ(stage1_peak, static_cast<std::int64_t>(sizeof(float)) *
                             (rest + layer_elements[0] + layer_elements[1] + layer_elements[2] +
                              layer_elements[3]));
  EXPECT_LT(peak, stage1_peak);
  expect_predicted_as_materialised(c, r);
}

// Stage 3: each device holds the embeddings' and the model end's values whole, its shard of every
// layer's, and two parameter slots laid out as the gradient slots: parameters / dp plus the two
// units in flight.
TEST(ZeroStage3Memory, ParametersAreTheShardsAndTwoUnitsInFlight) {
  TrainerConfig c = memory_config(ParallelPlan{.expert_parallel = 2,
                                               .data_parallel = 4,
                                               .micro_batch_size = 1,
                                               .global_batch_size = 8,
                                               .distributed_optimizer = true,
                                               .shard_gradients = true});
  const MaterialisedStep stage2 = materialised_step(c);
  const Rank0Buckets buckets = rank0_buckets(c, named_for_a_layer);
  std::map<int, std::int64_t> layer_elements = buckets.layers;
  const std::int64_t rest = buckets.rest, shards = buckets.shards;
  const std::int64_t in_flight = std::max(layer_elements[0], layer_elements[2]) +
                                 std::max(layer_elements[1], layer_elements[3]);
  c.plan.shard_parameters = true;
  const MaterialisedStep r = materialised_step(c);
  const auto parameters = static_cast<std::size_t>(rt::MemoryCategory::parameters);
  const auto gradients = static_cast<std::size_t>(rt::MemoryCategory::gradients);
  EXPECT_EQ(r.memory[0][parameters],
            static_cast<std::int64_t>(sizeof(float)) * (rest + shards + in_flight));
  EXPECT_LT(r.memory[0][parameters], stage2.memory[0][parameters]);
  EXPECT_EQ(r.memory[0][gradients], stage2.memory[0][gradients]);
  expect_predicted_as_materialised(c, r);
}

// Stage 3 in bf16: the parameters a device holds are 2 bytes a value, as weave predict counts
// them: the embeddings' and the model end's bf16 copies whole, the bf16 shard of every layer's
// values the gathers send, and the two bf16 parameter slots they land in (each tensor padded to
// whole 64-byte lines); nothing of the gathered values in fp32. The optimizer state is the fp32
// main values of the replica's shard of every bucket, as Megatron-LM's distributed optimizer
// keeps them, and the two moments: 3 fp32 tensors of the shard's size a bucket, as predicted.
// Below stage 0's parameters, the whole model's bf16 copy. The step's length is the prediction's.
TEST(ZeroStage3Memory, Bf16ParametersAreTwoBytesAValueAsPredicted) {
  TrainerConfig c = memory_config(ParallelPlan{.expert_parallel = 2,
                                               .data_parallel = 4,
                                               .micro_batch_size = 1,
                                               .global_batch_size = 8,
                                               .distributed_optimizer = true,
                                               .shard_gradients = true,
                                               .shard_parameters = true});
  c.model.precision = Precision::bf16;
  const auto lines = [](std::int64_t values) { return (2 * values + 63) / 64 * 64; };
  const auto fp32_lines = [](std::int64_t values) { return (4 * values + 63) / 64 * 64; };
  std::int64_t whole = 0, shards = 0, main_and_moments = 0;
  std::map<int, std::int64_t> layer_elements;
  {
    devices::DeviceSet set(c.plan.devices(), {.pin = false});
    devices::SharedMemoryCommunicator comm;
    TrainingStep step(c.model, c.plan, {}, set, comm);
    for (const GradientBucket& b : step.shard(0).buckets()) {
      ASSERT_TRUE(b.sharded) << b.name;
      main_and_moments += 3 * fp32_lines(b.shard_size);
      if (b.values_staged) {
        shards += lines(b.shard_size);
        layer_elements[std::stoi(b.name.substr(7))] += b.values.numel();
      } else {
        whole += lines(b.values.numel());
      }
    }
  }
  ASSERT_EQ(layer_elements.size(), 4u);
  // Layers 0 and 2 take slot 0, layers 1 and 3 slot 1.
  const std::int64_t slots = lines(std::max(layer_elements[0], layer_elements[2])) +
                             lines(std::max(layer_elements[1], layer_elements[3]));
  const auto parameters = static_cast<std::size_t>(rt::MemoryCategory::parameters);
  const auto optimizer_state = static_cast<std::size_t>(rt::MemoryCategory::optimizer_state);
  const MaterialisedStep r = materialised_step(c);
  EXPECT_EQ(r.memory[0][parameters], whole + shards + slots);
  const Prediction p = predict_step(c);
  EXPECT_EQ(p.memory[0][parameters], r.memory[0][parameters]);
  // The same graph, gathers and all (MoE layers' expert buckets over their own replicas): the
  // same step time.
  EXPECT_DOUBLE_EQ(p.step_ms, static_cast<double>(r.replay.makespan) * 1e-6);
  EXPECT_EQ(r.memory[0][optimizer_state], main_and_moments);
  EXPECT_EQ(p.memory[0][optimizer_state], r.memory[0][optimizer_state]);
  TrainerConfig stage0 = c;
  stage0.plan.distributed_optimizer = stage0.plan.shard_gradients = false;
  stage0.plan.shard_parameters = false;
  EXPECT_LT(r.memory[0][parameters], materialised_step(stage0).memory[0][parameters]);
}

// Under a zero-bubble schedule with no more layers a stage than gradient slots each layer keeps a
// slot of its own (its W action writes after the I actions of the layers below, nothing held
// aside) and stage 3 two parameter slots: the
// gradients are the stage's layers whole plus the shards, the parameters the shards plus two
// layers; predicted and materialised alike, the step's length too.
TEST(ZeroStageMemory, ZeroBubbleKeepsASlotALayerAndPredictsAsMaterialised) {
  TrainerConfig c = memory_config(ParallelPlan{.data_parallel = 2,
                                               .pipeline_parallel = 2,
                                               .pipeline_scheduler = "zb-h1",
                                               .micro_batch_size = 1,
                                               .global_batch_size = 4,
                                               .distributed_optimizer = true,
                                               .shard_gradients = true});
  // Rank 0 holds layers 0 and 1 (stage 0).
  const Rank0Buckets buckets = rank0_buckets(c, staged);
  std::map<int, std::int64_t> layer_elements = buckets.layers;
  const std::int64_t rest = buckets.rest, shards = buckets.shards;
  ASSERT_EQ(layer_elements.size(), 2u);
  const auto parameters = static_cast<std::size_t>(rt::MemoryCategory::parameters);
  const auto gradients = static_cast<std::size_t>(rt::MemoryCategory::gradients);
  for (const bool stage3 : {false, true}) {
    SCOPED_TRACE(stage3 ? "stage 3" : "stage 2");
    c.plan.shard_parameters = stage3;
    const MaterialisedStep r = materialised_step(c);
    EXPECT_EQ(r.memory[0][gradients], static_cast<std::int64_t>(sizeof(float)) *
                                          (rest + shards + layer_elements[0] + layer_elements[1]));
    if (stage3) {
      EXPECT_EQ(r.memory[0][parameters],
                static_cast<std::int64_t>(sizeof(float)) *
                    (rest + shards + layer_elements[0] + layer_elements[1]));
    }
    expect_predicted_as_materialised(c, r);
  }
}

// Whether a zero-bubble I action writes parameter `name`'s gradient: the norms, the biases added
// to the residual, the router and the shared experts; the W action writes the products'
// weights (and the biases computed with them).
bool written_by_input_pass(const std::string& name) {
  const auto ends_with = [&name](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  return name.find("norm.") != std::string::npos || ends_with("attention.proj.bias") ||
         ends_with("mlp.fc2.bias") || name.find("router.") != std::string::npos ||
         ends_with("shared_experts.gate_weight");
}

// Under zb-h1 with more layers a stage than gradient slots, stage 2 holds what it holds under
// 1F1B (the shards and two slots, one as large as the even layers' buckets, one as the odd
// ones') and the gradients the I actions write, held until each layer's W action: far below
// stage 1's stage of layers whole; predicted and materialised alike.
TEST(ZeroStageMemory, ZeroBubbleStage2HoldsTwoSlotsAndTheInputPassGradients) {
  TrainerConfig c = memory_config(ParallelPlan{.data_parallel = 2,
                                               .pipeline_parallel = 2,
                                               .pipeline_scheduler = "zb-h1",
                                               .micro_batch_size = 1,
                                               .global_batch_size = 4,
                                               .distributed_optimizer = true,
                                               .shard_gradients = true});
  // Megatron-Core's shared experts in the MoE layers too (their gate's gradient the I action's,
  // their fc1's and fc2's the W action's, as the dense MLP's).
  const bool biases = c.model.add_bias_linear;
  for (const int shared : {0, 48}) {
    SCOPED_TRACE(::testing::Message() << "shared experts " << shared);
    c.model.moe_shared_expert_intermediate_size = shared;
    c.model.moe_shared_expert_gate = shared > 0;
    c.model.add_bias_linear = biases && shared == 0;  // they have none
    c.plan.shard_gradients = true;
    c.model.num_layers = 12;  // rank 0: layers 0 to 5, MoE and dense in turn
    validate(c.model, c.plan);
    const Rank0Buckets buckets = rank0_buckets(c, staged);
    std::map<int, std::int64_t> layer_elements = buckets.layers;
    ASSERT_EQ(layer_elements.size(), 6u);
    std::int64_t held = 0;
    {
      devices::DeviceSet set(c.plan.devices(), {.pin = false});
      devices::SharedMemoryCommunicator comm;
      TrainingStep step(c.model, c.plan, {}, set, comm);
      for (const GradientBucket& b : step.shard(0).buckets())
        if (b.staged)
          for (const Parameter* p : b.params)
            if (written_by_input_pass(p->name)) held += p->value.numel();
    }
    ASSERT_GT(held, 0);
    const std::int64_t slots = std::max({layer_elements[0], layer_elements[2], layer_elements[4]}) +
                               std::max({layer_elements[1], layer_elements[3], layer_elements[5]});
    std::int64_t all_layers = 0;
    for (const auto& [l, elements] : layer_elements)
      all_layers += elements;
    const auto gradients = static_cast<std::size_t>(rt::MemoryCategory::gradients);
    const auto bytes = static_cast<std::int64_t>(sizeof(float));
    const MaterialisedStep r = materialised_step(c);
    EXPECT_EQ(r.memory[0][gradients], bytes * (buckets.rest + buckets.shards + slots + held));
    expect_predicted_as_materialised(c, r);
    // 1F1B's stage 2: the same but the held gradients, which its backward writes into the slot.
    TrainerConfig one_f_one_b = c;
    one_f_one_b.plan.pipeline_scheduler = "1f1b";
    EXPECT_EQ(predict_step(one_f_one_b).memory[0][gradients],
              r.memory[0][gradients] - bytes * held);
    // Stage 1: every layer of the stage whole.
    c.plan.shard_gradients = false;
    const std::int64_t stage1 = predict_step(c).memory[0][gradients];
    EXPECT_EQ(stage1, bytes * (buckets.rest + all_layers));
    EXPECT_LT(r.memory[0][gradients], stage1);
  }
}

// weave predict gives the materialised step's memory and length beside Ampipe and zb-v as well.
TEST(ZeroStageMemory, AmpipeAndZbVPredictAsMaterialised) {
  const ParallelPlan plans[] = {{.expert_parallel = 2,
                                 .data_parallel = 2,
                                 .micro_batch_size = 1,
                                 .global_batch_size = 4,
                                 .ampipe_degree = 2},
                                {.data_parallel = 2,
                                 .pipeline_parallel = 2,
                                 .virtual_pipeline = 2,
                                 .pipeline_scheduler = "zb-v",
                                 .micro_batch_size = 1,
                                 .global_batch_size = 4}};
  for (const ParallelPlan& plan : plans)
    for (const bool stage3 : {false, true}) {
      SCOPED_TRACE(::testing::Message() << (plan.ampipe_degree > 1 ? "Ampipe" : "zb-v")
                                        << (stage3 ? " stage 3" : " stage 2"));
      ParallelPlan sharded = plan;
      sharded.distributed_optimizer = sharded.shard_gradients = true;
      sharded.shard_parameters = stage3;
      const TrainerConfig c = memory_config(sharded);
      const MaterialisedStep r = materialised_step(c);
      expect_predicted_as_materialised(c, r);
    }
}

// On the virtual clock with a slow link: layer 2's gather into the slot layer 0 held starts once
// layer 0's forward is done with it (two units in flight), runs under layer 1's compute, and
// layer 2's forward waits for it.
TEST(ZeroStage3Overlap, TheNextLayersGatherRunsUnderTheLayersCompute) {
  TrainerConfig c;
  c.model = four_layers(0);
  c.plan = {.data_parallel = 2,
            .micro_batch_size = 1,
            .global_batch_size = 2,
            .distributed_optimizer = true,
            .shard_gradients = true,
            .shard_parameters = true};
  c.machine = {.device_flops = 1e9, .device_memory_bandwidth = 1e10, .link = "pcie4"};
  validate(c.model, c.plan);
  const rt::Trace& trace = materialised_step(c).replay.trace;
  const rt::TaskTable& tasks = trace.tasks();
  struct Window {
    rt::Nanos start = -1, end = -1;
    void add(const rt::Span& s) {
      start = start < 0 ? s.start : std::min(start, s.start);
      end = std::max(end, s.end);
    }
  };
  Window gather, layer[3];
  for (const rt::Span& s : trace.spans()) {
    if (tasks[s.task].device != 0 || tasks[s.task].tags.phase != rt::Phase::forward) continue;
    const std::string_view name = tasks.name(s.task);
    if (name.rfind("layers.2.", 0) == 0 && name.find(".gather") != std::string_view::npos)
      gather.add(s);
    for (int l = 0; l < 3; ++l)
      if (name.rfind("L" + std::to_string(l) + ".", 0) == 0) layer[l].add(s);
  }
  ASSERT_GE(gather.start, 0);
  ASSERT_GE(layer[1].start, 0);
  EXPECT_GE(gather.start, layer[0].end);  // the slot is free
  EXPECT_LT(gather.start, layer[1].end);  // under layer 1's compute
  EXPECT_LT(std::max(gather.start, layer[1].start), std::min(gather.end, layer[1].end));
  EXPECT_GE(layer[2].start, gather.end);  // layer 2 waits for its parameters
}

// --zero-units-in-flight N: the stage's layers take N parameter slots in turn, layer l slot
// l mod N, each as large as its largest layer; a device's parameters are the embeddings' and the
// model end's values whole, its shard of every layer's and the slots, parameters / dp plus N
// units in flight, predicted and materialised alike (the step's length too).
TEST(ZeroStage3Memory, ParametersFollowTheUnitsInFlight) {
  TrainerConfig c = memory_config(ParallelPlan{.expert_parallel = 2,
                                               .data_parallel = 4,
                                               .micro_batch_size = 1,
                                               .global_batch_size = 8,
                                               .distributed_optimizer = true,
                                               .shard_gradients = true,
                                               .shard_parameters = true});
  const Rank0Buckets buckets = rank0_buckets(c, named_for_a_layer);
  ASSERT_EQ(buckets.layers.size(), 4u);
  const auto parameters = static_cast<std::size_t>(rt::MemoryCategory::parameters);
  std::int64_t previous = 0;
  for (const int units : {1, 2, 3}) {
    SCOPED_TRACE(::testing::Message() << units << " units in flight");
    c.plan.zero_units_in_flight = units;
    std::vector<std::int64_t> slots(static_cast<std::size_t>(units), 0);
    for (const auto& [l, elements] : buckets.layers) {
      std::int64_t& slot = slots[static_cast<std::size_t>(l % units)];
      slot = std::max(slot, elements);
    }
    std::int64_t in_flight = 0;
    for (const std::int64_t slot : slots)
      in_flight += slot;
    const MaterialisedStep r = materialised_step(c);
    EXPECT_EQ(r.memory[0][parameters], static_cast<std::int64_t>(sizeof(float)) *
                                           (buckets.rest + buckets.shards + in_flight));
    EXPECT_GT(r.memory[0][parameters], previous);
    previous = r.memory[0][parameters];
    expect_predicted_as_materialised(c, r);
  }
}

// On the virtual clock with a slow link, stage 3's gathers are most of the step: with one unit
// in flight each layer's gather waits for the previous layer to be done with the only slot, with
// two the next layer's runs under the current one's compute, with three the two next ones'. More
// units hide more of the gathers: the step is shorter from 1 to 2, and no longer from 2 to 3.
TEST(ZeroStage3Overlap, MoreUnitsInFlightHideMoreOfTheGathers) {
  TrainerConfig c;
  c.model = four_layers(0);
  c.model.num_layers = 6;
  c.plan = {.data_parallel = 2,
            .micro_batch_size = 1,
            .global_batch_size = 2,
            .distributed_optimizer = true,
            .shard_gradients = true,
            .shard_parameters = true};
  c.machine = {.device_flops = 1e9, .device_memory_bandwidth = 1e10, .link = "pcie4"};
  std::vector<rt::Nanos> step;
  for (const int units : {1, 2, 3}) {
    c.plan.zero_units_in_flight = units;
    validate(c.model, c.plan);
    step.push_back(materialised_step(c).replay.makespan);
  }
  EXPECT_LT(step[1], step[0]);
  EXPECT_LE(step[2], step[1]);
  RecordProperty("step_ns_1_2_3_units", std::to_string(step[0]) + " " + std::to_string(step[1]) +
                                            " " + std::to_string(step[2]));
}

// The units in flight move the gathers, not the arithmetic: 1, 2 and 3 train the same bits, the
// step's values gathered into whichever slot before each use (a gather into a slot another
// layer still reads, or a prefetched layer read from the wrong slot, would show in the losses).
TEST(ZeroStage3, UnitsInFlightTrainTheSameBits) {
  const ModelConfig m = four_layers(0);
  ParallelPlan plan{.data_parallel = 2,
                    .micro_batch_size = 1,
                    .global_batch_size = 4,
                    .distributed_optimizer = true,
                    .shard_gradients = true,
                    .shard_parameters = true};
  std::vector<std::vector<double>> losses;
  for (const int units : {1, 2, 3}) {
    plan.zero_units_in_flight = units;
    std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> shards;
    losses.push_back(train(m, plan, 3, {}, &shards).losses);
  }
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_EQ(losses[2], losses[1]);
  EXPECT_LT(losses[1].back(), losses[1].front());
}

TEST(ZeroStage3Rules, UnitsInFlightAreAtLeastOneAndForStageThree) {
  const ModelConfig m = four_layers(0);
  ParallelPlan plan{.data_parallel = 2,
                    .micro_batch_size = 1,
                    .global_batch_size = 2,
                    .distributed_optimizer = true,
                    .shard_gradients = true,
                    .zero_units_in_flight = 3};
  try {
    validate(m, plan);
    ADD_FAILURE() << "units in flight accepted without stage 3";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--zero-units-in-flight 3"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("--zero-stage 3"), std::string::npos) << e.what();
  }
  plan.shard_parameters = true;
  EXPECT_NO_THROW(validate(m, plan));
  plan.zero_units_in_flight = 0;
  try {
    validate(m, plan);
    ADD_FAILURE() << "no units in flight accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("at least 1"), std::string::npos) << e.what();
  }
}

TEST(ZeroStage2Rules, RefusesAStageWithoutTheOnesBelowIt) {
  const ModelConfig m = four_layers(4);
  ParallelPlan without_optimizer{
      .data_parallel = 2, .micro_batch_size = 1, .global_batch_size = 2, .shard_gradients = true};
  EXPECT_THROW(validate(m, without_optimizer), ConfigError);
  try {
    validate(m, without_optimizer);
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("shards the optimizer state too"), std::string::npos)
        << e.what();
  }
  ParallelPlan parameters_alone = without_optimizer;
  parameters_alone.distributed_optimizer = true;
  parameters_alone.shard_gradients = false;
  parameters_alone.shard_parameters = true;
  try {
    validate(m, parameters_alone);
    ADD_FAILURE() << "parameters sharded without the gradients accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("shards the gradients too"), std::string::npos)
        << e.what();
  }
}

// Asked for stage 2, the advice weighs it against stage 1 at every layout, and names the stage
// each candidate runs.
TEST(ZeroStage2Advice, WeighsStageTwoAgainstStageOneAtEachLayout) {
  TrainerConfig base;
  base.model = four_layers(0);
  base.plan = {.data_parallel = 4,
               .micro_batch_size = 1,
               .global_batch_size = 8,
               .distributed_optimizer = true,
               .shard_gradients = true};
  const PlanCandidates candidates = enumerate_plans(base);
  int stage1 = 0, stage2 = 0, stage2_zero_bubble = 0;
  for (const TrainerConfig& c : candidates.configs) {
    const std::string flags = plan_flags(c);
    if (c.plan.shard_gradients) {
      ++stage2;
      EXPECT_NE(flags.find("--zero-stage 2"), std::string::npos) << flags;
      stage2_zero_bubble += c.plan.pipeline_scheduler == "zb-h1";
    } else {
      ++stage1;
      EXPECT_NE(flags.find("--zero-stage 1"), std::string::npos) << flags;
    }
  }
  EXPECT_GT(stage2, 0);
  // Every layout in both stages, the zero-bubble ones included.
  EXPECT_EQ(stage1, stage2);
  EXPECT_GT(stage2_zero_bubble, 0);
}

}  // namespace
}  // namespace weave::graphs
