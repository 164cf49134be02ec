// A step predicted from its graph built without tensors: the same virtual-clock time and memory
// as the materialised step, and Megatron-LM's model-FLOPs count.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "materialised_step.hpp"
#include "tiny_model.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/prediction.hpp"
#include "weave/graphs/virtual_replay.hpp"

namespace weave::graphs {
namespace {

// A GPT as Megatron's formula assumes it: 4h-wide GELU MLPs, one key/value head per query head.
TEST(Prediction, ModelFlopsAreMegatronsCount) {
  ModelConfig m = tiny(0);
  m.num_layers = 6;
  m.hidden_size = 96;
  m.num_attention_heads = 6;
  m.ffn_hidden_size = 4 * 96;
  m.seq_length = 128;
  const ParallelPlan plan{.tensor_parallel = 2, .micro_batch_size = 2, .global_batch_size = 8};
  const double B = 8, s = 128, l = 6, h = 96, V = m.padded_vocab_size(2);
  const double plain = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h));
  const double recompute = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h));
  EXPECT_NEAR(model_flops_per_step(m, plan, false), plain, 1e-9 * plain);
  EXPECT_NEAR(model_flops_per_step(m, plan, true), recompute, 1e-9 * recompute);
  // Grouped-query attention and SwiGLU count what they multiply: fewer key/value heads, a third
  // matrix in the MLP.
  ModelConfig llama = m;
  llama.num_query_groups = 2;
  llama.activation = Activation::swiglu;
  const double per_token_layer_change = 2 * h * (2 * 2 - 2 * 6) * (h / 6) + 2 * h * (4 * h);
  EXPECT_NEAR(model_flops_per_step(llama, plan, false) - plain,
              3 * B * s * l * per_token_layer_change, 1e-6 * plain);
}

TEST(Prediction, EqualsTheMaterialisedStepOnTheVirtualClock) {
  TrainerConfig c;
  c.model = tiny(4);
  c.plan = {.tensor_parallel = 2,
            .sequence_parallel = true,
            .expert_parallel = 2,
            .pipeline_parallel = 2,
            .micro_batch_size = 1,
            .global_batch_size = 4};
  c.machine = {.device_flops = 1e12, .device_memory_bandwidth = 1e11, .link = "nvlink4"};
  const Prediction p = predict_step(c);
  // The same step built with tensors, replayed without running its kernels.
  const MaterialisedStep r = materialised_step(c);
  EXPECT_DOUBLE_EQ(p.step_ms, static_cast<double>(r.replay.makespan) * 1e-6);
  EXPECT_EQ(p.memory, r.memory);
  EXPECT_DOUBLE_EQ(p.tokens_per_second, 4 * 16 / (p.step_ms * 1e-3));
  // tp 2 x pp 2 devices (ep 2 folds over tp).
  EXPECT_NEAR(p.flops_per_device, p.model_flops / (p.step_ms * 1e-3) / 4, 1e-9 * p.model_flops);
  EXPECT_NEAR(p.mfu, p.flops_per_device / 1e12, 1e-12);
  EXPECT_GT(p.bubble, 0);  // two stages, four micro-batches
  bool tp = false, pipeline = false;
  for (const ExposedCommunication& e : p.exposed) {
    EXPECT_GT(e.ms_per_device, 0) << e.group;
    tp |= e.group == "tp";
    pipeline |= e.group == "pipeline";
  }
  EXPECT_TRUE(tp);
  EXPECT_TRUE(pipeline);
}

// Ampipe's tp-sp overlap without SP (each chunk's projection all-reduced, the split experts'
// items reduced under the next item's fc1): the prediction is the materialised step's replay.
TEST(Prediction, EqualsTheMaterialisedStepForTheTpOverlapWithoutSp) {
  TrainerConfig c;
  c.model = tiny(4);
  c.plan = {.tensor_parallel = 2,
            .expert_parallel = 2,
            .expert_tensor_parallel = 2,
            .moe_model_type = "deepspeed_moe",
            .data_parallel = 2,
            .micro_batch_size = 1,
            .global_batch_size = 4,
            .ampipe_degree = 2,
            .ampipe_tp_sp_comm_overlap = true};
  c.machine = {.device_flops = 1e12, .device_memory_bandwidth = 1e11, .link = "nvlink4"};
  const Prediction p = predict_step(c);
  const MaterialisedStep r = materialised_step(c);
  EXPECT_DOUBLE_EQ(p.step_ms, static_cast<double>(r.replay.makespan) * 1e-6);
  EXPECT_EQ(p.memory, r.memory);
}

// MindSpeed's gate under tp without SP (every tp rank routing the whole chunk, the split experts'
// partial sums all-reduced, per item under the tp-sp overlap): the prediction is the
// materialised step's replay, with and without the overlap.
TEST(Prediction, EqualsTheMaterialisedStepForTheGateRoutedOnEveryTpRank) {
  for (const bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "tp-sp overlap" : "no overlap");
    TrainerConfig c;
    c.model = tiny(4);
    c.model.moe_gate = MoeGate::deepspeed;
    c.model.moe_z_loss_coeff = 0;
    c.plan = {.tensor_parallel = 2,
              .expert_parallel = 2,
              .moe_model_type = "deepspeed_moe",
              .data_parallel = 2,
              .micro_batch_size = 1,
              .global_batch_size = 4,
              .ampipe_degree = 2,
              .ampipe_tp_sp_comm_overlap = overlap};
    c.machine = {.device_flops = 1e12, .device_memory_bandwidth = 1e11, .link = "nvlink4"};
    const Prediction p = predict_step(c);
    const MaterialisedStep r = materialised_step(c);
    EXPECT_DOUBLE_EQ(p.step_ms, static_cast<double>(r.replay.makespan) * 1e-6);
    EXPECT_EQ(p.memory, r.memory);
  }
}

// The materialised step and its prediction agree too with the options that change the graph's
// order and prices: data-parallel reductions after the backward (no --overlap-grad-reduce) or
// during it, the distributed optimizer's gathers after the update or at the next step's start
// (--overlap-param-gather), and the materialised scores' tasks and memory (--attention-backend
// unfused).
TEST(Prediction, EqualsTheMaterialisedStepWithEachOverlapAndAttentionBackend) {
  for (const int overlaps : {0, 1, 2}) {
    SCOPED_TRACE(overlaps == 0   ? "after the backward"
                 : overlaps == 1 ? "overlap grad reduce"
                                 : "overlap grad reduce and param gather");
    const bool overlap = overlaps > 0;
    TrainerConfig c;
    c.model = tiny(0);
    c.model.attention_backend = AttentionBackend::unfused;
    c.model.attention_dropout = 0.1;
    c.plan = {.tensor_parallel = 2,
              .sequence_parallel = true,
              .data_parallel = 2,
              .micro_batch_size = 1,
              .global_batch_size = 4,
              .distributed_optimizer = true};
    c.plan.overlap_grad_reduce = overlap;
    c.plan.overlap_param_gather = overlaps == 2;
    c.machine = {.device_flops = 1e12, .device_memory_bandwidth = 1e11, .link = "nvlink4"};
    const Prediction p = predict_step(c);
    std::vector<std::int64_t> memory;
    const rt::VirtualRunResult r =
        replay_step(c, {}, false, [&](TrainingStep&, devices::DeviceSet& set) {
          for (std::size_t d = 0; d < set.size(); ++d)
            memory.push_back(set.memory().peak_total(static_cast<rt::DeviceId>(d)));
        });
    EXPECT_DOUBLE_EQ(p.step_ms, static_cast<double>(r.makespan) * 1e-6);
    EXPECT_EQ(p.memory_total, memory);
  }
}

// Without --overlap-grad-reduce every data-parallel gradient reduction starts after the rank's
// last backward compute task ends (Megatron-LM's finish_grad_sync after the backward); with it
// the first reductions start while the backward still runs. Read on the virtual clock, device by
// device.
TEST(Prediction, GradientReductionsWaitForTheBackwardWithoutOverlapGradReduce) {
  for (const bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "overlap" : "after the backward");
    TrainerConfig c;
    c.model = tiny(0);
    c.model.num_layers = 4;
    c.plan = {.data_parallel = 2, .micro_batch_size = 1, .global_batch_size = 4};
    c.plan.overlap_grad_reduce = overlap;
    c.machine = {.device_flops = 1e11, .device_memory_bandwidth = 1e10, .link = "nvlink4"};
    const Prediction p = predict_step(c, {.fold_data_parallel = false});
    const rt::TaskTable& tasks = p.trace.tasks();
    for (rt::DeviceId device = 0; device < 2; ++device) {
      rt::Nanos backward_end = 0, first_reduction = std::numeric_limits<rt::Nanos>::max();
      int reductions = 0;
      for (const rt::Span& span : p.trace.spans()) {
        const rt::TaskInfo& t = tasks[span.task];
        if (t.device != device) continue;
        const std::string_view name = tasks.name(span.task);
        // The backward's tasks: its input and weight halves (the optimizer's weight-phase tasks
        // belong to no micro-batch).
        if (t.kind == rt::TaskKind::compute && t.tags.micro_batch >= 0 &&
            (t.tags.phase == rt::Phase::backward || t.tags.phase == rt::Phase::weight))
          backward_end = std::max(backward_end, span.end);
        if (t.kind == rt::TaskKind::comm && name.find(".dp[") != std::string_view::npos) {
          first_reduction = std::min(first_reduction, span.start);
          ++reductions;
        }
      }
      EXPECT_GT(reductions, 2) << device;
      if (overlap)
        EXPECT_LT(first_reduction, backward_end) << device;
      else
        EXPECT_GE(first_reduction, backward_end) << device;
    }
  }
}

// Under 1F1B with --overlap-grad-reduce only the first pipeline stage starts reductions while its
// backward runs; the second starts every one after its last backward compute task (Megatron-LM's
// default --delay-grad-reduce: the later stages reduce in the bubble). Each reduction starts after
// its bucket's NaN check and scaling on the compute stream. Read on the virtual clock, device by
// device (the stage holding the embedding is the first).
TEST(Prediction, LaterPipelineStagesReduceInTheBubble) {
  TrainerConfig c;
  c.model = tiny(0);
  c.model.num_layers = 4;
  c.plan = {.data_parallel = 2,
            .pipeline_parallel = 2,
            .micro_batch_size = 1,
            .global_batch_size = 8,
            .distributed_optimizer = true};
  c.plan.overlap_grad_reduce = true;
  c.machine = {.device_flops = 1e11, .device_memory_bandwidth = 1e10, .link = "nvlink4"};
  const Prediction p = predict_step(c, {.fold_data_parallel = false});
  const rt::TaskTable& tasks = p.trace.tasks();
  int first_stage = 0, later_stage = 0;
  for (rt::DeviceId device = 0; device < 4; ++device) {
    rt::Nanos backward_end = 0, first_reduction = std::numeric_limits<rt::Nanos>::max();
    rt::Nanos first_check_end = std::numeric_limits<rt::Nanos>::max();
    bool holds_embedding = false;
    int reductions = 0;
    for (const rt::Span& span : p.trace.spans()) {
      const rt::TaskInfo& t = tasks[span.task];
      if (t.device != device) continue;
      const std::string_view name = tasks.name(span.task);
      holds_embedding |= name == "embedding";
      if (t.kind == rt::TaskKind::compute && t.tags.micro_batch >= 0 &&
          (t.tags.phase == rt::Phase::backward || t.tags.phase == rt::Phase::weight))
        backward_end = std::max(backward_end, span.end);
      if (t.kind == rt::TaskKind::compute && name.ends_with(".check"))
        first_check_end = std::min(first_check_end, span.end);
      if (t.kind == rt::TaskKind::comm && name.find(".dp[") != std::string_view::npos) {
        first_reduction = std::min(first_reduction, span.start);
        ++reductions;
      }
    }
    EXPECT_GT(reductions, 2) << device;
    EXPECT_GE(first_reduction, first_check_end) << device;
    if (holds_embedding) {
      ++first_stage;
      EXPECT_LT(first_reduction, backward_end) << device;
    } else {
      ++later_stage;
      EXPECT_GE(first_reduction, backward_end) << device;
    }
  }
  EXPECT_EQ(first_stage, 2);
  EXPECT_EQ(later_stage, 2);
}

// The distributed optimizer's parameter gathers: without --overlap-param-gather they follow the
// shards' update, where the step ends; with it they open the step (gathering the last update),
// each layer's forward waits for its own bucket's gather only, and the step ends after the
// update, as Megatron-LM's forward pre-hooks overlap them with the next forward. On a slow
// data-parallel link the step is then shorter. Read on the virtual clock, device by device.
TEST(Prediction, ParameterGathersOverlapTheNextForwardWithOverlapParamGather) {
  double step_ms[2] = {0, 0};
  for (const bool gather_early : {false, true}) {
    SCOPED_TRACE(gather_early ? "overlap param gather" : "gathers after the update");
    TrainerConfig c;
    c.model = tiny(0);
    c.model.num_layers = 4;
    c.plan = {.data_parallel = 2,
              .micro_batch_size = 1,
              .global_batch_size = 8,
              .distributed_optimizer = true};
    c.plan.overlap_grad_reduce = true;
    c.plan.overlap_param_gather = gather_early;
    c.machine = {.device_flops = 1e11, .device_memory_bandwidth = 1e10, .link = "pcie4"};
    const Prediction p = predict_step(c, {.fold_data_parallel = false});
    step_ms[gather_early] = p.step_ms;
    const rt::TaskTable& tasks = p.trace.tasks();
    for (rt::DeviceId device = 0; device < 2; ++device) {
      SCOPED_TRACE(device);
      const rt::Span* optimizer = nullptr;
      const rt::Span* last_layer_gather = nullptr;  // layers.3.attention's
      const rt::Span* first_forward[4] = {};        // each layer's first forward task
      int gathers = 0;
      for (const rt::Span& span : p.trace.spans()) {
        const rt::TaskInfo& t = tasks[span.task];
        if (t.device != device) continue;
        const std::string_view name = tasks.name(span.task);
        if (name == "optimizer") optimizer = &span;
        if (t.kind == rt::TaskKind::comm && name.find(".gather[") != std::string_view::npos) {
          ++gathers;
          if (name.starts_with("layers.3.attention/")) last_layer_gather = &span;
        }
        if (t.kind == rt::TaskKind::compute && t.tags.phase == rt::Phase::forward &&
            t.tags.layer >= 0 && t.tags.layer < 4) {
          const rt::Span*& first = first_forward[t.tags.layer];
          if (!first || span.start < first->start) first = &span;
        }
      }
      ASSERT_NE(optimizer, nullptr);
      ASSERT_NE(last_layer_gather, nullptr);
      ASSERT_NE(first_forward[0], nullptr);
      ASSERT_NE(first_forward[3], nullptr);
      // The embeddings', the 8 layer halves' and the final norm's buckets (the output layer is
      // the tied word embedding), each sharded over dp 2.
      EXPECT_EQ(gathers, 10);
      if (!gather_early) {
        EXPECT_GE(last_layer_gather->start, optimizer->end);
        continue;
      }
      // The last layer's first forward task waits for its bucket's gather, by an edge...
      const std::span<const rt::TaskId> next = p.graph.successors(last_layer_gather->task);
      EXPECT_NE(std::find(next.begin(), next.end(), first_forward[3]->task), next.end());
      EXPECT_GE(first_forward[3]->start, last_layer_gather->end);
      // ...while the first layer's forward starts before it ends: the gathers overlap the forward.
      EXPECT_LT(first_forward[0]->start, last_layer_gather->end);
      // The update ends the step; no gather follows it.
      EXPECT_LE(last_layer_gather->end, optimizer->start);
    }
  }
  EXPECT_LT(step_ms[1], step_ms[0]);
}

// The compute time by kind (products, attention, element-wise, optimizer) splits each device's
// compute busy time, so the kinds add up to it (busy = step x devices / (1 + bubble)); each kind
// is there with the kernel model; a micro-batch fold extrapolates them to what a whole replay
// gives.
TEST(Prediction, ComputeByKindAddsUpToTheComputeBusyTime) {
  TrainerConfig c;
  c.model = tiny(0);
  c.plan = {.pipeline_parallel = 2, .micro_batch_size = 1, .global_batch_size = 12};
  c.machine = {.device_flops = 1e12,
               .device_memory_bandwidth = 1e11,
               .attention_flops = 5e11,
               .matmul_overhead_dimension = 16,
               .kernel_launch_seconds = 2e-6,
               .link = "nvlink4"};
  const Prediction every = predict_step(c);
  const Prediction folded = predict_step(c, {.fold_micro_batches = true});
  ASSERT_EQ(folded.micro_batches_replayed.size(), 3u);
  double kinds = 0;
  for (std::size_t k = 0; k < kComputeKindCount; ++k) {
    SCOPED_TRACE(std::string(to_string(static_cast<ComputeKind>(k))));
    EXPECT_GT(every.compute_ms_per_device[k], 0);
    EXPECT_NEAR(folded.compute_ms_per_device[k], every.compute_ms_per_device[k],
                1e-9 * every.step_ms);
    kinds += every.compute_ms_per_device[k];
  }
  const double busy = every.step_ms / (1 + every.bubble);  // per device, as the bubble counts it
  EXPECT_NEAR(kinds, busy, 1e-6 * busy);
}

// A group's exposed communication read from the replay by its name is the prediction's figure
// of that group; groups together are their streams' union.
TEST(Prediction, AGroupsExposedCommunicationIsReadFromTheReplay) {
  TrainerConfig c;
  c.model = tiny(4);
  c.plan = {.tensor_parallel = 2,
            .sequence_parallel = true,
            .expert_parallel = 2,
            .pipeline_parallel = 2,
            .micro_batch_size = 1,
            .global_batch_size = 4};
  c.machine = {.device_flops = 1e12, .device_memory_bandwidth = 1e11, .link = "nvlink4"};
  const Prediction p = predict_step(c);
  ASSERT_FALSE(p.exposed.empty());
  rt::Nanos separately = 0;
  std::vector<std::string_view> all;
  for (const ExposedCommunication& e : p.exposed) {
    const std::string_view group[] = {e.group};
    const rt::Nanos ns = exposed_comm_of_groups(p.trace, group);
    EXPECT_DOUBLE_EQ(static_cast<double>(ns) * 1e-6 / p.replayed_devices, e.ms_per_device)
        << e.group;
    separately += ns;
    all.push_back(e.group);
  }
  EXPECT_LE(exposed_comm_of_groups(p.trace, all), separately);
  EXPECT_GT(exposed_comm_of_groups(p.trace, all), 0);
  const std::string_view none[] = {"no such group"};
  EXPECT_EQ(exposed_comm_of_groups(p.trace, none), 0);
}

// Nodes of `devices_per_node` devices joined by a fast node link, the nodes by a slow network.
devices::Cluster nodes_of(int devices_per_node) {
  return devices::Cluster(devices_per_node, {.name = "node link", .params = {3'000, 450e9}},
                          {.name = "network", .params = {10'000, 5e9}});
}

// The figures a fold must keep: step time, bubble, memory, each group's exposed time.
void expect_same_figures(const Prediction& folded, const Prediction& every,
                         const std::string& name) {
  EXPECT_DOUBLE_EQ(folded.step_ms, every.step_ms) << name;
  EXPECT_DOUBLE_EQ(folded.bubble, every.bubble) << name;
  EXPECT_DOUBLE_EQ(folded.exposed_ms_per_device, every.exposed_ms_per_device) << name;
  EXPECT_EQ(folded.memory, every.memory) << name;
  EXPECT_EQ(folded.memory_total, every.memory_total) << name;
  ASSERT_EQ(folded.exposed.size(), every.exposed.size()) << name;
  for (std::size_t i = 0; i < every.exposed.size(); ++i) {
    EXPECT_EQ(folded.exposed[i].group, every.exposed[i].group) << name;
    EXPECT_NEAR(folded.exposed[i].ms_per_device, every.exposed[i].ms_per_device,
                1e-9 * every.exposed[i].ms_per_device)
        << name << " " << every.exposed[i].group;
  }
}

// Folding data-parallel replicas into the first: the same step time, exposed communication,
// bubble and memory as replaying every rank, from a fraction of the ranks.
TEST(Prediction, FoldedReplicasPredictWhatEveryRankDoes) {
  const std::pair<const char*, ParallelPlan> plans[] = {
      {"dense tp2 dp4",
       {.tensor_parallel = 2, .data_parallel = 4, .micro_batch_size = 1, .global_batch_size = 8}},
      {"moe tp2+sp ep4 dp2 pp2 distributed optimizer",
       {.tensor_parallel = 2,
        .sequence_parallel = true,
        .expert_parallel = 4,
        .data_parallel = 2,
        .pipeline_parallel = 2,
        .micro_batch_size = 1,
        .global_batch_size = 8,
        .distributed_optimizer = true}},
      {"moe cp2 ep2 dp2 ampipe 2",
       {.context_parallel = 2,
        .expert_parallel = 2,
        .data_parallel = 2,
        .micro_batch_size = 1,
        .global_batch_size = 4,
        .ampipe_degree = 2}},
  };
  // Without a cluster, and on nodes of 2 and 4 devices whose slow network the data-parallel
  // groups (and some expert and pipeline groups) cross.
  const std::optional<devices::Cluster> clusters[] = {
      std::nullopt,
      nodes_of(2),
      nodes_of(4),
  };
  for (const auto& cluster : clusters)
    for (const auto& [plan_name, plan] : plans) {
      const std::string name = fmt::format("{} on {} devices a node", plan_name,
                                           cluster ? cluster->devices_per_node() : 0);
      TrainerConfig c;
      c.model = tiny(4);
      c.plan = plan;
      c.machine = {.device_flops = 1e12,
                   .device_memory_bandwidth = 1e11,
                   .link = "nvlink4",
                   .cluster = cluster};
      const Prediction folded = predict_step(
                           c, {.fold_tensor_parallel = false, .fold_context_parallel = false}),
                       every = predict_step(c, {.fold_data_parallel = false,
                                                .fold_tensor_parallel = false,
                                                .fold_context_parallel = false});
      EXPECT_EQ(every.replayed_devices, plan.devices()) << name;
      EXPECT_EQ(folded.replayed_devices * plan.data_parallel, plan.devices()) << name;
      expect_same_figures(folded, every, name);
    }
}

// Folding tensor- and context-parallel peers too (the default): the same figures as replaying
// every rank, from the ranks with tp = cp = 0 of the first replica, for every way a tp group
// shares its work (SP, split experts with Ampipe's tp-sp overlap, expert parallelism over tp,
// interleaved pipelines) and a cp ring (with tp, with Ampipe and experts), on one node and across
// nodes.
TEST(Prediction, FoldedTensorAndContextParallelPeersPredictWhatEveryRankDoes) {
  const std::pair<const char*, ParallelPlan> plans[] = {
      {"dense tp4 dp2 pp2 interleaved",
       {.tensor_parallel = 4,
        .data_parallel = 2,
        .pipeline_parallel = 2,
        .virtual_pipeline = 2,
        .micro_batch_size = 1,
        .global_batch_size = 8}},
      {"moe tp2+sp ep2 over tp, distributed optimizer",
       {.tensor_parallel = 2,
        .sequence_parallel = true,
        .expert_parallel = 2,
        .data_parallel = 2,
        .micro_batch_size = 1,
        .global_batch_size = 4,
        .distributed_optimizer = true}},
      {"moe tp2+sp split experts ep2 ampipe 2 tp-sp overlap",
       {.tensor_parallel = 2,
        .sequence_parallel = true,
        .expert_parallel = 2,
        .expert_tensor_parallel = 2,
        .moe_model_type = "deepspeed_moe",
        .data_parallel = 2,
        .micro_batch_size = 1,
        .global_batch_size = 4,
        .ampipe_degree = 2,
        .ampipe_tp_sp_comm_overlap = true}},
      {"moe tp2 split experts ep2 ampipe 2 tp-sp overlap without SP",
       {.tensor_parallel = 2,
        .expert_parallel = 2,
        .expert_tensor_parallel = 2,
        .moe_model_type = "deepspeed_moe",
        .data_parallel = 2,
        .micro_batch_size = 1,
        .global_batch_size = 4,
        .ampipe_degree = 2,
        .ampipe_tp_sp_comm_overlap = true}},
      {"dense tp2 cp2 dp2",
       {.tensor_parallel = 2,
        .context_parallel = 2,
        .data_parallel = 2,
        .micro_batch_size = 1,
        .global_batch_size = 4}},
      {"moe cp4 ep2 ampipe 2 pp2",
       {.context_parallel = 4,
        .expert_parallel = 2,
        .pipeline_parallel = 2,
        .micro_batch_size = 1,
        .global_batch_size = 4,
        .ampipe_degree = 2}},
  };
  const std::optional<devices::Cluster> clusters[] = {
      std::nullopt,
      nodes_of(2),
  };
  for (const auto& cluster : clusters)
    for (const auto& [plan_name, plan] : plans) {
      const std::string name = fmt::format("{} on {} devices a node", plan_name,
                                           cluster ? cluster->devices_per_node() : 0);
      TrainerConfig c;
      c.model = tiny(4);
      c.model.num_layers = 4;  // two chunks on each of two stages
      c.plan = plan;
      c.machine = {.device_flops = 1e12,
                   .device_memory_bandwidth = 1e11,
                   .link = "nvlink4",
                   .cluster = cluster};
      const Prediction folded = predict_step(c),
                       every = predict_step(c, {.fold_data_parallel = false,
                                                .fold_tensor_parallel = false,
                                                .fold_context_parallel = false});
      EXPECT_EQ(folded.replayed_devices, plan.pipeline_parallel) << name;
      expect_same_figures(folded, every, name);
    }
}

// Folding micro-batches: three replays with fewer micro-batches, extrapolated, predict what the
// whole step's replay does, for every schedule's steady phase (1F1B, interleaved, GPipe, zero
// bubble, gradient accumulation without a pipeline), with MoE, recomputation and a cluster.
TEST(Prediction, FoldedMicroBatchesPredictWhatEveryMicroBatchDoes) {
  struct Case {
    const char* name;
    ParallelPlan plan;
    int experts = 0;
    bool recompute = false;
  };
  const Case cases[] = {
      {"1f1b pp2", {.pipeline_parallel = 2, .micro_batch_size = 1, .global_batch_size = 16}},
      {"interleaved pp2 x 2",
       {.pipeline_parallel = 2,
        .virtual_pipeline = 2,
        .micro_batch_size = 1,
        .global_batch_size = 20}},
      {"gpipe pp2",
       {.pipeline_parallel = 2,
        .pipeline_scheduler = "gpipe",
        .micro_batch_size = 1,
        .global_batch_size = 15}},
      {"zb-h1 pp2",
       {.pipeline_parallel = 2,
        .pipeline_scheduler = "zb-h1",
        .micro_batch_size = 1,
        .global_batch_size = 16}},
      {"accumulation without a pipeline", {.micro_batch_size = 2, .global_batch_size = 18}},
      {"moe tp2+sp ep2 pp2 dp2, full recomputation",
       {.tensor_parallel = 2,
        .sequence_parallel = true,
        .expert_parallel = 2,
        .data_parallel = 2,
        .pipeline_parallel = 2,
        .micro_batch_size = 1,
        .global_batch_size = 32},
       4,
       true},
  };
  for (const bool cluster : {false, true})
    for (const Case& k : cases) {
      const std::string name = fmt::format("{}{}", k.name, cluster ? " on nodes of 2" : "");
      TrainerConfig c;
      c.model = tiny(k.experts);
      c.model.num_layers = 4;
      if (k.recompute)
        c.model.recompute = {.granularity = RecomputeGranularity::full,
                             .method = RecomputeMethod::uniform,
                             .num_layers = 1};
      c.plan = k.plan;
      c.machine = {.device_flops = 1e12, .device_memory_bandwidth = 1e11, .link = "nvlink4"};
      if (cluster) c.machine.cluster = nodes_of(2);
      const Prediction folded = predict_step(c, {.fold_micro_batches = true}),
                       whole = predict_step(c);
      ASSERT_EQ(folded.micro_batches_replayed.size(), 3u) << name << ": not folded";
      EXPECT_LT(folded.micro_batches_replayed[2], c.plan.micro_batches()) << name;
      EXPECT_EQ(whole.micro_batches_replayed, std::vector<int>{c.plan.micro_batches()}) << name;
      expect_same_figures(folded, whole, name);
    }
}

// A group that crosses nodes pays the network: the same step on one node (every group on the
// node link) is faster than on nodes of 2 devices, whose data-parallel all-reduce crosses them.
TEST(Prediction, AClusterPricesGroupsByTheLinksTheySpan) {
  TrainerConfig c;
  c.model = tiny(4);
  c.plan = {
      .tensor_parallel = 2, .data_parallel = 4, .micro_batch_size = 1, .global_batch_size = 8};
  c.machine = {.device_flops = 1e12, .device_memory_bandwidth = 1e11, .link = "nvlink4"};
  auto step_ms = [&](int devices_per_node) {
    c.machine.cluster = nodes_of(devices_per_node);
    return predict_step(c);
  };
  const Prediction one_node = step_ms(8), two_a_node = step_ms(2);
  EXPECT_LT(one_node.step_ms, two_a_node.step_ms);
  auto exposed_dp = [](const Prediction& p) {
    double ms = 0;
    for (const ExposedCommunication& e : p.exposed)
      if (e.group.starts_with("dp")) ms += e.ms_per_device;
    return ms;
  };
  EXPECT_LT(exposed_dp(one_node), exposed_dp(two_a_node));
}

}  // namespace
}  // namespace weave::graphs
