// Megatron-Core's shared experts (--moe-shared-expert-intermediate-size): a dense MLP beside the
// routed experts of every MoE layer. Its backward against a central difference of the loss; the
// step under tensor (+ sequence), expert, data and pipeline parallelism equal to one device;
// --moe-shared-expert-overlap running it under the dispatch all-to-all on the virtual clock with
// bitwise the same numbers; the prediction's FLOPs and parameter bytes against closed forms and
// equal to the materialised step; checkpoints and decoding; the rules that refuse it.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "decoder.hpp"
#include "materialised_step.hpp"
#include "step_outcome.hpp"
#include "tiny_model.hpp"
#include "weave/devices/machine_model.hpp"
#include "weave/graphs/checkpoint.hpp"
#include "weave/graphs/prediction.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::graphs {
namespace {

constexpr int kShared = 48;

// Two layers, the first MoE (4 experts, top-2) with shared experts 48 wide, the second dense;
// SwiGLU and no biases, as DeepSeek-V3's.
ModelConfig shared_model() {
  ModelConfig m = tiny(4);
  m.activation = Activation::swiglu;
  m.add_bias_linear = false;
  m.moe_shared_expert_intermediate_size = kShared;
  return m;
}

TEST(SharedExperts, GradientMatchesADirectionalDifference) {
  ModelConfig m = shared_model();
  m.hidden_dropout = 0;
  const ParallelPlan plan{.tensor_parallel = 2,
                          .sequence_parallel = true,
                          .micro_batch_size = 2,
                          .global_batch_size = 4};
  // The shared experts' weights alone, then the MoE layer's attention, which their input gradient
  // reaches through the MLP's norm.
  for (const std::string_view only : {"shared_experts", "layers.0.attention"}) {
    const auto [along, numeric] = directional_derivative(m, plan, only);
    EXPECT_NE(along, 0.0) << only;
    EXPECT_NEAR(along, numeric, 2e-2 * std::abs(numeric))
        << only << ": analytic " << along << ", numeric " << numeric;
  }
}

TEST(SharedExperts, EqualOneDeviceUnderEachParallelism) {
  const ModelConfig m = shared_model();
  const ParallelPlan serial{.micro_batch_size = 1, .global_batch_size = 2};
  const Outcome a = run(m, serial, 1, false);
  // fc1 holds the gates then the values (SwiGLU); fc2 maps back to the hidden size.
  EXPECT_EQ(a.grads.at("layers.0.moe.shared_experts.fc1.weight").size(), 2u * kShared * 32);
  EXPECT_EQ(a.grads.at("layers.0.moe.shared_experts.fc2.weight").size(), 32u * kShared);
  EXPECT_EQ(a.grads.count("layers.1.moe.shared_experts.fc1.weight"), 0u);  // a dense layer
  ModelConfig none = m;
  none.moe_shared_expert_intermediate_size = 0;
  EXPECT_NE(run(none, serial, 1, false).losses[0], a.losses[0]);  // they change the output
  const std::pair<const char*, ParallelPlan> plans[] = {
      {"tp2", {.tensor_parallel = 2, .micro_batch_size = 1, .global_batch_size = 2}},
      {"tp2+sp",
       {.tensor_parallel = 2,
        .sequence_parallel = true,
        .micro_batch_size = 1,
        .global_batch_size = 2}},
      {"ep2",
       {.expert_parallel = 2, .data_parallel = 2, .micro_batch_size = 1, .global_batch_size = 2}},
      {"dp2", {.data_parallel = 2, .micro_batch_size = 1, .global_batch_size = 2}},
      {"pp2", {.pipeline_parallel = 2, .micro_batch_size = 1, .global_batch_size = 2}},
      {"cp2", {.context_parallel = 2, .micro_batch_size = 1, .global_batch_size = 2}},
      {"tp2+sp ep2 pp2",
       {.tensor_parallel = 2,
        .sequence_parallel = true,
        .expert_parallel = 2,
        .pipeline_parallel = 2,
        .micro_batch_size = 1,
        .global_batch_size = 2}},
  };
  for (const auto& [name, plan] : plans) {
    SCOPED_TRACE(name);
    const Outcome b = run(m, plan, 1, false);
    EXPECT_NEAR(b.losses[0], a.losses[0], 1e-5 * a.losses[0]);
    EXPECT_NEAR(b.aux[0], a.aux[0], 1e-5 * a.aux[0]);
    expect_same_gradients(a, b);
  }
}

// One step of a one-layer MoE model (tp 2 + SP, ep 2) on the virtual clock with its kernels run,
// on slow links: an all-to-all costs far more than the shared experts' products.
struct Replayed {
  rt::Trace trace;
  rt::Nanos step = 0;
  double loss = 0;
};

Replayed replay(bool overlap) {
  ModelConfig m = shared_model();
  m.num_layers = 1;
  m.moe_layer_freq = 1;
  m.hidden_size = 128;
  m.num_attention_heads = 4;
  m.ffn_hidden_size = 256;
  m.moe_shared_expert_intermediate_size = 256;
  m.seq_length = 64;
  m.moe_shared_expert_overlap = overlap;
  ParallelPlan plan{.tensor_parallel = 2,
                    .sequence_parallel = true,
                    .expert_parallel = 2,
                    .micro_batch_size = 1,
                    .global_batch_size = 1};
  validate(m, plan);
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  TrainingStep step(m, plan, {}, set, comm);
  fill_batches(step, m, plan);
  step.prepare(1, 1e-3);
  const devices::MachineModel model(std::vector<int>(set.size(), 0), 1e12,
                                    devices::LinkModel::preset("ampipe-20gbps"));
  rt::VirtualClock clock(model, {.execute = true});
  rt::VirtualRunResult result = clock.run(step.graph());
  Replayed out{.trace = std::move(result.trace), .step = result.makespan};
  out.loss = step.result().loss;
  return out;
}

bool overlap(const rt::Span& a, const rt::Span& b) {
  return a.start < b.end && b.start < a.end;
}

// The span of device d's task named `name`, or with `collective` of its part of the collective
// `name` (a task "name[i]").
const rt::Span* on_device(const rt::Trace& trace, rt::DeviceId d, std::string_view name,
                          bool collective) {
  for (const rt::Span& s : trace.spans()) {
    if (trace.tasks()[s.task].device != d) continue;
    const std::string_view n = trace.tasks().name(s.task);
    if (collective ? n.starts_with(name) && n.size() > name.size() && n[name.size()] == '['
                   : n == name)
      return &s;
  }
  return nullptr;
}

TEST(SharedExperts, OverlapRunsThemUnderTheDispatchWithTheSameNumbers) {
  const Replayed before = replay(false), under = replay(true);
  ASSERT_EQ(under.trace.tasks().device_count(), 2u);  // ep folds over tp
  for (rt::DeviceId d = 0; d < 2; ++d) {
    SCOPED_TRACE(fmt::format("device {}", d));
    auto span = [&](const Replayed& r, std::string_view name, bool collective = false) {
      const rt::Span* s = on_device(r.trace, d, name, collective);
      EXPECT_NE(s, nullptr) << name;
      return s ? *s : rt::Span{};
    };
    // Megatron-Core's order without the flag: the shared experts before the router.
    EXPECT_LE(span(before, "L0.shared_expert").end, span(before, "L0.router").start);
    EXPECT_FALSE(overlap(span(before, "L0.shared_expert"), span(before, "L0.dispatch", true)));
    // With it: after the router, while the dispatch all-to-all is in flight; their backward
    // while the combine's gradient is.
    const rt::Span shared = span(under, "L0.shared_expert"),
                   dispatch = span(under, "L0.dispatch", true);
    EXPECT_GE(shared.start, span(under, "L0.router").end);
    EXPECT_TRUE(overlap(shared, dispatch))
        << "shared [" << shared.start << ", " << shared.end << "), dispatch [" << dispatch.start
        << ", " << dispatch.end << ")";
    EXPECT_TRUE(overlap(span(under, "L0.shared_expert_backward"),
                        span(under, "L0.combine_backward", true)));
  }
  EXPECT_LT(under.step, before.step);  // what the overlap hides
  EXPECT_EQ(under.loss, before.loss);

  // The same numbers bitwise: losses and every gradient, over two updates.
  ModelConfig m = shared_model();
  const ParallelPlan plan{.tensor_parallel = 2,
                          .sequence_parallel = true,
                          .expert_parallel = 2,
                          .micro_batch_size = 1,
                          .global_batch_size = 2};
  const Outcome a = run(m, plan, 2, true);
  m.moe_shared_expert_overlap = true;
  const Outcome b = run(m, plan, 2, true);
  EXPECT_EQ(b.losses, a.losses);
  EXPECT_EQ(b.grads, a.grads);
}

TrainerConfig predicted(int shared) {
  TrainerConfig c;
  c.model = shared_model();
  c.model.num_layers = 4;
  c.model.moe_shared_expert_intermediate_size = shared;
  c.plan = {.tensor_parallel = 2,
            .sequence_parallel = true,
            .expert_parallel = 2,
            .pipeline_parallel = 2,
            .micro_batch_size = 1,
            .global_batch_size = 2};
  c.machine = {.device_flops = 1e12, .device_memory_bandwidth = 1e11, .link = "nvlink4"};
  return c;
}

// FLOPs: each token of a MoE layer through a SwiGLU MLP kShared wide besides (three matrices,
// 2 h S FLOPs each, x3 for forward and backward). Parameters: each tp rank of a stage holds
// 3 S / tp x h per MoE layer it holds (layers 0 and 2 of four, one a stage).
TEST(SharedExperts, PredictionCountsThemAndEqualsTheMaterialisedStep) {
  const Prediction with = predict_step(predicted(kShared)), without = predict_step(predicted(0));
  const double h = 32, s = 16, tokens = 2 * s, moe_layers = 2, tp = 2;
  const double flops = tokens * 3 * moe_layers * 3 * 2 * h * kShared;
  EXPECT_NEAR(with.model_flops - without.model_flops, flops, 1e-9 * flops);
  const auto parameters = static_cast<std::size_t>(rt::MemoryCategory::parameters);
  ASSERT_EQ(with.memory.size(), without.memory.size());
  for (std::size_t d = 0; d < with.memory.size(); ++d)
    EXPECT_EQ(with.memory[d][parameters] - without.memory[d][parameters],
              static_cast<std::int64_t>(4 * 3 * kShared / tp * h))
        << "device " << d;
  const MaterialisedStep r = materialised_step(predicted(kShared));
  EXPECT_DOUBLE_EQ(with.step_ms, static_cast<double>(r.replay.makespan) * 1e-6);
  EXPECT_EQ(with.memory, r.memory);
  EXPECT_GT(with.step_ms, without.step_ms);
}

std::string temp_path(const char* name) {
  return (std::filesystem::temp_directory_path() / fmt::format("weave-{}-{}", ::getpid(), name))
      .string();
}

struct Trainer {
  Trainer(const ModelConfig& model, ParallelPlan p)
      : m(model),
        plan((validate(model, p), p)),
        set(plan.devices(), {.pin = false}),
        step(m, plan, {}, set, comm) {}
  double train(std::int64_t iteration) {
    fill_batches(step, m, plan, iteration * plan.global_batch_size);
    step.prepare(iteration, 1e-2);
    set.executor().run(step.graph());
    return step.result().loss;
  }
  ModelConfig m;
  ParallelPlan plan;
  devices::DeviceSet set;
  devices::SharedMemoryCommunicator comm;
  TrainingStep step;
};

// Their weights (and their Adam moments) are saved and loaded: a resumed run continues bitwise;
// a model of another shared width is refused, naming it.
TEST(SharedExperts, CheckpointRoundTrip) {
  const ParallelPlan plan{.tensor_parallel = 2,
                          .sequence_parallel = true,
                          .micro_batch_size = 1,
                          .global_batch_size = 2};
  const std::string path = temp_path("shared-experts.ckpt");
  Trainer a(shared_model(), plan);
  a.train(1);
  a.train(2);
  save_checkpoint(path, a.m, a.plan, a.step, {.iteration = 2});
  EXPECT_EQ(read_checkpoint_config(path).model.moe_shared_expert_intermediate_size, kShared);
  const double a3 = a.train(3), a4 = a.train(4);
  Trainer b(shared_model(), plan);
  load_checkpoint(path, b.m, b.plan, b.step);
  EXPECT_EQ(b.train(3), a3);
  EXPECT_EQ(b.train(4), a4);
  ModelConfig other = shared_model();
  other.moe_shared_expert_intermediate_size = 32;
  Trainer c(other, plan);
  try {
    load_checkpoint(path, c.m, c.plan, c.step);
    ADD_FAILURE() << "a checkpoint of another shared width was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("moe_shared_expert_intermediate_size is 48 in the "
                                         "checkpoint but 32 now"),
              std::string::npos)
        << e.what();
  }
  std::filesystem::remove(path);
}

// Decoding runs them too: split over tp and ep it gives the one device's logits, which give the
// training step's loss.
TEST(SharedExperts, DecodingGivesTheTrainingStepsLoss) {
  expect_decoding_gives_the_steps_loss(
      without_dropout(shared_model()),
      ParallelPlan{.tensor_parallel = 2, .sequence_parallel = true, .expert_parallel = 2});
}

TEST(SharedExperts, RulesRefuseWhatCannotRun) {
  auto refused = [](const ModelConfig& m, ParallelPlan plan) -> std::string {
    try {
      validate(m, plan);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "accepted";
  };
  const ParallelPlan one{.micro_batch_size = 1, .global_batch_size = 1};
  EXPECT_EQ(refused(shared_model(), one), "accepted");
  ModelConfig m = shared_model();
  m.add_bias_linear = true;
  EXPECT_NE(refused(m, one).find("add --disable-bias-linear"), std::string::npos);
  m = shared_model();
  m.moe_shared_expert_intermediate_size = 47;
  EXPECT_NE(refused(m, {.tensor_parallel = 2, .micro_batch_size = 1, .global_batch_size = 1})
                .find("--moe-shared-expert-intermediate-size (47) must be divisible by "
                      "--tensor-model-parallel-size (2)"),
            std::string::npos);
  m = shared_model();
  m.moe_shared_expert_intermediate_size = 0;
  m.moe_shared_expert_overlap = true;
  EXPECT_NE(refused(m, one).find("the model has none: set --moe-shared-expert-intermediate-size"),
            std::string::npos);
  m = shared_model();
  m.num_experts = 0;
  EXPECT_NE(refused(m, one).find("set --num-experts or drop it"), std::string::npos);
  EXPECT_NE(refused(shared_model(), {.tensor_parallel = 2,
                                     .sequence_parallel = true,
                                     .expert_parallel = 2,
                                     .micro_batch_size = 1,
                                     .global_batch_size = 1,
                                     .ampipe_degree = 2})
                .find("MindSpeed's Ampipe MoE layer has no shared experts"),
            std::string::npos);
}

}  // namespace
}  // namespace weave::graphs
