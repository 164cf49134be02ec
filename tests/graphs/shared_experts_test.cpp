// Megatron-Core's shared experts (--moe-shared-expert-intermediate-size): a dense MLP beside the
// routed experts of every MoE layer. Its backward against a central difference of the loss; the
// step under tensor (+ sequence), expert, data and pipeline parallelism equal to one device;
// --moe-shared-expert-overlap running fc1 under the dispatch all-to-all and fc2 under the
// combine on the virtual clock with bitwise the same numbers; under zb-h1 their weight
// gradients in the W action; the prediction's FLOPs and parameter bytes against closed forms and
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

TEST(SharedExperts, OverlapRunsFc1UnderTheDispatchAndFc2UnderTheCombine) {
  const Replayed before = replay(false), under = replay(true);
  ASSERT_EQ(under.trace.tasks().device_count(), 2u);  // ep folds over tp
  for (rt::DeviceId d = 0; d < 2; ++d) {
    SCOPED_TRACE(fmt::format("device {}", d));
    auto span = [&](const Replayed& r, std::string_view name, bool collective = false) {
      const rt::Span* s = on_device(r.trace, d, name, collective);
      EXPECT_NE(s, nullptr) << name;
      return s ? *s : rt::Span{};
    };
    auto expect_under = [](const rt::Span& task, const rt::Span& comm, std::string_view what) {
      EXPECT_TRUE(overlap(task, comm))
          << what << ": task [" << task.start << ", " << task.end << "), all-to-all [" << comm.start
          << ", " << comm.end << ")";
    };
    // Megatron-Core's order without the flag: the shared experts before the router.
    EXPECT_LE(span(before, "L0.shared_expert_fc2").end, span(before, "L0.router").start);
    EXPECT_FALSE(overlap(span(before, "L0.shared_expert_fc1"), span(before, "L0.dispatch", true)));
    // With it, as its alltoall dispatcher calls them: the input's gather and fc1 after the
    // router, while the dispatch all-to-all is in flight; fc2 after the routed experts, while the
    // combine all-to-all is (before, fc2 ran right after fc1, under the dispatch).
    const rt::Span fc1 = span(under, "L0.shared_expert_fc1"),
                   fc2 = span(under, "L0.shared_expert_fc2");
    EXPECT_GE(span(under, "L0.shared_expert_sp_gather", true).start, span(under, "L0.router").end);
    EXPECT_GE(fc1.start, span(under, "L0.router").end);
    expect_under(fc1, span(under, "L0.dispatch", true), "fc1 under the dispatch");
    EXPECT_GE(fc2.start, span(under, "L0.experts").end);
    expect_under(fc2, span(under, "L0.combine", true), "fc2 under the combine");
    EXPECT_FALSE(overlap(fc2, span(under, "L0.dispatch", true)));
    // Backward, the mirror: fc2's while the combine's gradient is in flight, the activation's and
    // fc1's after the routed experts' while the dispatch's gradient is.
    const rt::Span fc2_back = span(under, "L0.shared_expert_fc2_backward"),
                   fc1_back = span(under, "L0.shared_expert_fc1_backward");
    expect_under(fc2_back, span(under, "L0.combine_backward", true), "fc2 backward");
    EXPECT_GE(fc1_back.start, span(under, "L0.experts_backward").end);
    expect_under(fc1_back, span(under, "L0.dispatch_backward", true), "fc1 backward");
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

// Under zb-h1 their weight gradients wait for the W action as the dense MLP's do: two stages of
// two layers (the first of each a MoE layer), with and without the overlap, equal one device;
// so does ZeRO stage 2 over two replicas with four layers a stage, more than its two gradient
// slots, where the gradients the I actions write (their gate's) are held aside until the W
// (ZeroStageMemory.ZeroBubbleStage2HoldsTwoSlotsAndTheInputPassGradients counts what is held).
TEST(SharedExperts, ZeroBubbleEqualsOneDevice) {
  ModelConfig m = shared_model();
  m.num_layers = 4;
  const ParallelPlan zb{.pipeline_parallel = 2,
                        .pipeline_scheduler = "zb-h1",
                        .micro_batch_size = 1,
                        .global_batch_size = 4};
  for (const bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "overlapped" : "before the router");
    m.moe_shared_expert_overlap = overlap;
    expect_equals_one_device(m, zb);
    ParallelPlan tp_sp_ep = zb;
    tp_sp_ep.tensor_parallel = tp_sp_ep.expert_parallel = 2;
    tp_sp_ep.sequence_parallel = true;
    SCOPED_TRACE("tp2+sp ep2");
    const ParallelPlan serial{.micro_batch_size = 1, .global_batch_size = 4};
    const Outcome a = run(m, serial, 1, false), b = run(m, tp_sp_ep, 1, false);
    EXPECT_NEAR(b.losses[0], a.losses[0], 1e-5 * a.losses[0]);
    expect_same_gradients(a, b);
  }
  m.num_layers = 8;
  m.moe_shared_expert_gate = true;  // its weight's gradient is the I action's, held
  expect_equals_one_device(m, {.data_parallel = 2,
                               .pipeline_parallel = 2,
                               .pipeline_scheduler = "zb-h1",
                               .micro_batch_size = 1,
                               .global_batch_size = 4,
                               .distributed_optimizer = true,
                               .shard_gradients = true});
}

// The structure: under zb-h1 each MoE layer's micro-batch has one weight-gradient task of the
// shared experts, in the W action (weight phase), and their backward's tasks in the I action
// carry no weight product (half the FLOPs of 1F1B's); under 1F1B there is none. weave predict
// equals the materialised step (the I actions' kept output gradients counted alike).
TEST(SharedExperts, ZeroBubbleRunsTheirWeightGradientsInW) {
  for (const bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "overlapped" : "before the router");
    TrainerConfig c = predicted(kShared);
    c.model.moe_shared_expert_overlap = overlap;
    c.plan.pipeline_scheduler = "zb-h1";
    c.plan.global_batch_size = 4;
    TrainerConfig one_f_one_b = c;
    one_f_one_b.plan.pipeline_scheduler = "1f1b";
    const Prediction zb = predict_step(c), plain = predict_step(one_f_one_b);
    // Per device: FLOPs of the shared experts' backward tasks by phase, and the W tasks' count.
    struct Seen {
      double input = 0, weight = 0;
      int weight_tasks = 0;
    };
    auto seen = [](const Prediction& p) {
      std::map<rt::DeviceId, Seen> out;
      const rt::TaskTable& tasks = p.trace.tasks();
      for (const rt::Span& span : p.trace.spans()) {
        const rt::TaskInfo& t = tasks[span.task];
        const std::string_view name = tasks.name(span.task);
        if (name.find("shared_expert") == std::string_view::npos) continue;
        Seen& s = out[t.device];
        if (name.ends_with("shared_expert_weight_grad")) {
          EXPECT_EQ(t.tags.phase, rt::Phase::weight) << name;
          s.weight += t.cost.flops;
          ++s.weight_tasks;
        } else if (name.ends_with("_fc1_backward") || name.ends_with("_fc2_backward")) {
          EXPECT_EQ(t.tags.phase, rt::Phase::backward) << name;
          s.input += t.cost.flops;
        }
      }
      return out;
    };
    const std::map<rt::DeviceId, Seen> split = seen(zb), folded = seen(plain);
    // Each stage holds one MoE layer (the prediction replays one tp rank of each).
    ASSERT_GE(split.size(), 2u);
    ASSERT_EQ(folded.size(), split.size());
    for (const auto& [device, s] : split) {
      SCOPED_TRACE(fmt::format("device {}", device));
      EXPECT_EQ(s.weight_tasks, 4);  // one per micro-batch
      EXPECT_GT(s.input, 0);
      EXPECT_DOUBLE_EQ(s.weight, s.input);
      EXPECT_EQ(folded.at(device).weight_tasks, 0);
      EXPECT_DOUBLE_EQ(folded.at(device).input, s.input + s.weight);
    }
    const MaterialisedStep r = materialised_step(c);
    EXPECT_DOUBLE_EQ(zb.step_ms, static_cast<double>(r.replay.makespan) * 1e-6);
    EXPECT_EQ(zb.memory, r.memory);
  }
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
