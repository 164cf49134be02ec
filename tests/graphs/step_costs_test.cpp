// Every compute task of a training step has a price on the virtual clock: matrix products by
// their FLOPs, element-wise work (norms, residuals, dropout, copies, the optimizer) by the memory
// it streams at the device's bandwidth, whichever is longer; with kernel rates, each kind of work
// at its own rate, products by their shapes.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <string_view>
#include <utility>

#include "tiny_model.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/virtual_replay.hpp"
#include "weave/ops/deepspeed_gate.hpp"

namespace weave::graphs {
namespace {

struct Built {
  ParallelPlan plan;
  devices::DeviceSet set;
  devices::SharedMemoryCommunicator comm;
  TrainingStep step;
  Built(const ModelConfig& m, ParallelPlan p, const OptimizerConfig& o = {})
      : plan((validate(m, p), p)),
        set(plan.devices(), {.pin = false}),
        step(m, plan, o, set, comm, {.materialize = false}) {}
};

// Device 0's compute tasks' costs by name, of a step built with tensors or without: the tests
// below compare the two, which must carry the same costs.
std::map<std::string, rt::CostHint, std::less<>> device0_compute_costs(const ModelConfig& m,
                                                                       const ParallelPlan& plan,
                                                                       bool materialize) {
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  const TrainingStep step(m, plan, {}, set, comm, {.materialize = materialize});
  std::map<std::string, rt::CostHint, std::less<>> costs;
  const rt::TaskTable& tasks = step.graph().tasks();
  for (rt::TaskId t = 0; t < tasks.size(); ++t)
    if (tasks[t].device == 0 && tasks[t].kind == rt::TaskKind::compute)
      costs[std::string(tasks.name(t))] = tasks[t].cost;
  return costs;
}

TEST(StepCosts, NoComputeTaskIsFree) {
  const ModelConfig m = tiny(4);
  const ParallelPlan plans[] = {
      {.micro_batch_size = 2, .global_batch_size = 2},
      {.tensor_parallel = 2,
       .sequence_parallel = true,
       .expert_parallel = 2,
       .micro_batch_size = 2,
       .global_batch_size = 4,
       .ampipe_degree = 2},
      {.tensor_parallel = 2,
       .sequence_parallel = true,
       .expert_parallel = 2,
       .expert_tensor_parallel = 2,
       .data_parallel = 2,
       .micro_batch_size = 2,
       .global_batch_size = 4,
       .ampipe_degree = 2,
       .ampipe_tp_sp_comm_overlap = true},
      {.tensor_parallel = 2,
       .sequence_parallel = true,
       .expert_parallel = 2,
       .micro_batch_size = 2,
       .global_batch_size = 4,
       .ampipe_degree = 2,
       .pipe_experts = true,
       .pipe_experts_multi_data = 2},
      {.context_parallel = 2,
       .expert_parallel = 2,
       .pipeline_parallel = 2,
       .micro_batch_size = 1,
       .global_batch_size = 4,
       .distributed_optimizer = true},
  };
  for (const ParallelPlan& plan : plans) {
    Built b(m, plan);
    const devices::MachineModel machine = machine_model(b.set, ModelledMachine{});
    const rt::TaskTable& tasks = b.step.graph().tasks();
    int free = 0;
    for (rt::TaskId t = 0; t < tasks.size(); ++t)
      if (tasks[t].kind == rt::TaskKind::compute && machine.duration(tasks, t) == 0) {
        ++free;
        ADD_FAILURE() << tasks.name(t) << " lasts 0 ns";
      }
    EXPECT_EQ(free, 0);
  }
}

TEST(StepCosts, ElementWiseWorkStreamsAtTheMemoryBandwidth) {
  const ModelConfig m = tiny(0);
  Built b(m, {.micro_batch_size = 2, .global_batch_size = 2});
  const ModelledMachine modelled{.device_flops = 1e11, .device_memory_bandwidth = 1e10};
  const devices::MachineModel machine = machine_model(b.set, modelled);
  const rt::TaskTable& tasks = b.step.graph().tasks();
  bool seen_norm = false, seen_optimizer = false;
  for (rt::TaskId t = 0; t < tasks.size(); ++t) {
    const std::string_view name = tasks.name(t);
    if (name == "L0.input_norm") {
      // Reads and writes the [S, B, h] rows once: 2 x 16 x 2 x 32 floats.
      const double bytes = 4.0 * 2 * 16 * 2 * 32;
      EXPECT_EQ(machine.duration(tasks, t), std::llround(bytes / 1e10 * 1e9));
      seen_norm = true;
    }
    if (name == "optimizer") {
      // AdamW streams seven values per parameter element.
      EXPECT_GT(machine.duration(tasks, t), 0);
      seen_optimizer = true;
    }
    // A matrix product is priced by its arithmetic, as before.
    if (name == "L0.qkv") {
      EXPECT_GT(tasks[t].cost.flops, 0);
    }
  }
  EXPECT_TRUE(seen_norm);
  EXPECT_TRUE(seen_optimizer);
}

// The optimizer step streams AdamW's fp32 traffic (value, gradient and two moments read, three
// written: 28 bytes an element) and, in 16-bit runs, Megatron-LM's mixed-precision copies: the
// fp32 main parameters into the 16-bit ones (4 read, 2 written); the gradients are fp32 in both
// 16-bit formats (no copy into main gradients); a loss scaler's unscaling of them (4 and 4) is a
// task of its own. The elements are the gradients zero_grads clears (4 bytes each in fp32).
TEST(StepCosts, TheOptimizerStreamsAdamWAndTheMixedPrecisionCopies) {
  auto bytes_of = [](Precision precision, std::string_view task) {
    ModelConfig m = tiny(0);
    m.precision = precision;
    Built b(m, {.micro_batch_size = 2, .global_batch_size = 2},
            {.loss_scaling = precision == Precision::fp16});
    const rt::TaskTable& tasks = b.step.graph().tasks();
    for (rt::TaskId t = 0; t < tasks.size(); ++t)
      if (tasks.name(t) == task) return tasks[t].cost.bytes;
    ADD_FAILURE() << "no task " << task;
    return 0.0;
  };
  const double elements = bytes_of(Precision::fp32, "zero_grads") / 4;
  EXPECT_DOUBLE_EQ(bytes_of(Precision::fp32, "optimizer"), elements * 7 * 4);
  EXPECT_DOUBLE_EQ(bytes_of(Precision::bf16, "optimizer"), elements * (7 * 4 + 4 + 2));
  EXPECT_DOUBLE_EQ(bytes_of(Precision::fp16, "optimizer"), elements * (7 * 4 + 4 + 2));
  EXPECT_DOUBLE_EQ(bytes_of(Precision::fp16, "unscale_and_check_inf"), elements * (4 + 4));
}

// The loss streams the passes Megatron-Core's vocab-parallel cross-entropy makes over a rank's
// [S B, V/t] logits in fp32: the widening from bf16 (2 read, 4 written) and the maxima (4) with
// the output layer, subtraction (4 + 4), exp (4 + 4) and sums (4), the softmax's division (4 + 4)
// with the loss, and backward the scaling (4 + 4) and the narrowing to bf16 (4 read, 2 written);
// in fp32 neither widening nor narrowing. The word embedding's backward streams, beyond its
// rows, Megatron's dense weight gradient and its addition into the fp32 main gradient.
TEST(StepCosts, TheLossAndEmbeddingStreamMegatronsVocabularyPasses) {
  for (const Precision precision : {Precision::fp32, Precision::bf16}) {
    for (const int tp : {1, 2}) {
      SCOPED_TRACE(testing::Message() << "bf16 " << (precision == Precision::bf16) << " tp " << tp);
      ModelConfig m = tiny(0);
      m.precision = precision;
      const int B = 2;
      Built b(m, {.tensor_parallel = tp,
                  .sequence_parallel = tp > 1,
                  .micro_batch_size = B,
                  .global_batch_size = B});
      const double rows = m.seq_length * B, logits = rows * 64 / tp;  // the padded vocabulary, 64
      const double a = precision == Precision::bf16 ? 2 : 4, half = a == 2 ? 1 : 0;
      const std::pair<std::string_view, double> expected[] = {
          {"logits", logits * (half * (2 + 4) + 4)},
          {"loss_partials", logits * (8 + 8 + 4)},
          {"loss", logits * 8 + 3 * rows * a},
          {"loss_backward", logits * (8 + half * (4 + 2))},
          // The rows' gradients (read twice, written once), then the dense [V/t, h] weight
          // gradient written and added into the fp32 main gradient.
          {"embedding_backward", 3 * rows * 32 * a + 64.0 / tp * 32 * (a + a + 4 + 4)},
      };
      const rt::TaskTable& tasks = b.step.graph().tasks();
      int seen = 0;
      for (rt::TaskId t = 0; t < tasks.size(); ++t)
        for (const auto& [name, bytes] : expected)
          if (tasks.name(t) == name && tasks[t].device == 0) {
            EXPECT_DOUBLE_EQ(tasks[t].cost.bytes, bytes) << name;
            ++seen;
          }
      EXPECT_EQ(seen, 5);
    }
  }
}

// The dense MLP's activation streams between its products as Megatron-Core's fused bias-GeLU (or
// bias-SwiGLU) kernel does: forward fc1's output read (f1 wide, 2f when gated) and the activation
// written (f); backward the activation's gradient and fc1's output read and fc1's output gradient
// written, and with a bias that gradient read once more for the bias's sum over the rows. The
// same bytes whether the MLP runs whole or, under --tp-comm-overlap, in pieces of rows.
TEST(StepCosts, TheDenseMlpStreamsItsActivation) {
  for (const Precision precision : {Precision::fp32, Precision::bf16})
    for (const bool modern : {false, true})
      for (const int tp : {1, 2})
        for (const bool overlap : {false, true}) {
          if (overlap && tp == 1) continue;
          SCOPED_TRACE(testing::Message()
                       << "bf16 " << (precision == Precision::bf16) << " swiglu, no bias " << modern
                       << " tp " << tp << " overlap " << overlap);
          ModelConfig m = modern ? with_modern_decoder(tiny(0)) : tiny(0);
          m.precision = precision;
          m.hidden_dropout = 0;
          const int B = 2;
          Built b(m, {.tensor_parallel = tp,
                      .sequence_parallel = tp > 1,
                      .micro_batch_size = B,
                      .global_batch_size = B,
                      .tp_comm_overlap = overlap});
          const double rows = m.seq_length * B, a = precision == Precision::bf16 ? 2 : 4;
          const double f = 64.0 / tp, f1 = modern ? 2 * f : f;
          const double forward = rows * (f1 + f) * a;
          const double backward = rows * (f + 2 * f1 + (modern ? 0 : f1)) * a;
          // The MLP's products stream nothing of their own: its compute tasks' bytes are the
          // activation's, forward (fc1's tasks) and backward (the input gradients' tasks).
          double forward_bytes = 0, backward_bytes = 0;
          const rt::TaskTable& tasks = b.step.graph().tasks();
          for (rt::TaskId t = 0; t < tasks.size(); ++t) {
            if (tasks[t].device != 0 || tasks[t].kind != rt::TaskKind::compute) continue;
            const std::string_view name = tasks.name(t);
            if (name == "L0.mlp" || name.starts_with("L0.mlp_fc1"))
              forward_bytes += tasks[t].cost.bytes;
            if (name.starts_with("L0.mlp_backward")) backward_bytes += tasks[t].cost.bytes;
          }
          EXPECT_DOUBLE_EQ(forward_bytes, forward);
          EXPECT_DOUBLE_EQ(backward_bytes, backward);
        }
}

// --cross-entropy-loss-fusion prices the loss at its fused passes: native (Megatron-Core's
// jit-fused functions) widens and takes the maxima in one pass (2 read, 4 written in bf16),
// subtracts, exponentiates and sums in one (4 + 4), divides in one (4 + 4) and backward narrows
// the scaled gradient to bf16 in one (4 + 2); te (Transformer Engine's kernels) reads the bf16
// logits for the online softmax (2), reads them again writing the gradient over them (2 + 2),
// and backward scales it in place (2 + 2). Each task keeps its rows' work beside the passes.
TEST(StepCosts, AFusedLossStreamsItsFewerPasses) {
  for (const int tp : {1, 2}) {
    SCOPED_TRACE(testing::Message() << "tp " << tp);
    const int B = 2;
    auto bytes = [&](CrossEntropyFusion fusion) {
      ModelConfig m = tiny(0);
      m.precision = Precision::bf16;
      m.cross_entropy_fusion = fusion;
      Built b(m, {.tensor_parallel = tp,
                  .sequence_parallel = tp > 1,
                  .micro_batch_size = B,
                  .global_batch_size = B});
      std::map<std::string, double> by_name;
      const rt::TaskTable& tasks = b.step.graph().tasks();
      for (rt::TaskId t = 0; t < tasks.size(); ++t)
        if (tasks[t].device == 0) by_name[std::string(tasks.name(t))] = tasks[t].cost.bytes;
      return by_name;
    };
    const auto unfused = bytes(CrossEntropyFusion::unfused);
    const auto native = bytes(CrossEntropyFusion::native);
    const auto te = bytes(CrossEntropyFusion::te);
    const double logits = 16.0 * B * 64 / tp;  // rows x the padded vocabulary's shard
    // Against the unfused passes (52 bytes an element in bf16): the difference is the logits'.
    const std::pair<std::string, double> per_element[] = {
        {"logits", 2 + 4}, {"loss_partials", 8}, {"loss", 8}, {"loss_backward", 4 + 2}};
    const std::pair<std::string, double> te_per_element[] = {
        {"logits", 2}, {"loss_partials", 2 + 2}, {"loss", 0}, {"loss_backward", 2 + 2}};
    const std::pair<std::string, double> unfused_per_element[] = {
        {"logits", 2 + 4 + 4}, {"loss_partials", 20}, {"loss", 8}, {"loss_backward", 8 + 6}};
    for (int i = 0; i < 4; ++i) {
      const std::string& name = per_element[i].first;
      ASSERT_TRUE(unfused.contains(name)) << name;
      const double rest = unfused.at(name) - logits * unfused_per_element[i].second;
      EXPECT_DOUBLE_EQ(native.at(name), rest + logits * per_element[i].second) << name;
      EXPECT_DOUBLE_EQ(te.at(name), rest + logits * te_per_element[i].second) << name;
    }
  }
}

// The kernel model's inputs reach every task: over a dense one-device step the attention FLOPs
// are the causal attention's (forward, and 2.5 times it backward) of every layer and micro-batch,
// and the products' edges are those of every linear layer's forward and two backward halves.
TEST(StepCosts, TheStepCarriesItsAttentionAndProductShapes) {
  ModelConfig m = tiny(0);
  m.hidden_dropout = 0;
  const int B = 2, M = 2;
  Built b(m, {.micro_batch_size = B, .global_batch_size = B * M});
  const rt::TaskTable& tasks = b.step.graph().tasks();
  double attention = 0, edges = 0, flops = 0;
  for (rt::TaskId t = 0; t < tasks.size(); ++t) {
    if (tasks[t].kind != rt::TaskKind::compute) continue;
    attention += tasks[t].cost.attention_flops;
    edges += tasks[t].cost.matmul_edges;
    flops += tasks[t].cost.flops;
  }
  const double L = m.num_layers, S = m.seq_length, h = m.hidden_size, f = m.ffn_hidden_size,
               heads = m.num_attention_heads, d = h / heads, V = 64, rows = S * B;
  // Causal: half of the S^2 (query, key) pairs, 2 products of d each, 2 FLOPs a multiply-add.
  const double forward_attention = 2 * 2 * B * heads * S * S * d * 0.5;
  EXPECT_NEAR(attention, L * M * 3.5 * forward_attention, 1e-6 * attention);
  auto edge = [](double m, double k, double n) { return 2 * (m * k + k * n + m * n); };
  const double per_layer =
      edge(rows, h, 3 * h) + edge(rows, h, h) + edge(rows, h, f) + edge(rows, f, h);
  // Each product three times: forward, input gradient, weight gradient; the output layer too.
  EXPECT_NEAR(edges, 3 * M * (L * per_layer + edge(rows, h, V)), 1e-6 * edges);
  EXPECT_GT(flops, attention);
}

// Megatron's materialised core attention (--attention-backend unfused): per micro-batch and head,
// QK^T ([S, d] x [d, S]) and the product with V ([S, S] x [S, d]) over the whole square as
// products with their shapes' edges, no attention FLOPs, and the scores' softmax and dropout by
// their bytes (forward: softmax reads and writes, dropout reads and writes and writes a one-byte
// mask; backward: dropout reads the gradient and mask and writes, softmax reads the output and
// the gradient and writes); the backward's four products twice the forward's. Selective
// recomputation of the core attention adds the forward again to the backward.
TEST(StepCosts, MaterialisedScoresArePricedAsProductsAndTraffic) {
  ModelConfig m = tiny(0);
  m.attention_backend = AttentionBackend::unfused;
  m.attention_dropout = 0.1;
  m.precision = Precision::bf16;
  const int B = 2;
  const double S = m.seq_length, h = m.hidden_size, heads = m.num_attention_heads, d = h / heads;
  auto edge = [](double m, double k, double n) { return 2 * (m * k + k * n + m * n); };
  const double products = B * heads * 2 * (2 * S * d * S);
  const double edges = B * heads * (edge(S, d, S) + edge(S, S, d));
  const double scores = B * heads * S * S, a = 2;  // bf16
  const double forward_bytes = scores * (2 * a + 2 * a + 1);
  const double backward_bytes = scores * (2 * a + 1 + 3 * a);
  const double projection = 2 * S * B * h * h, projection_edges = edge(S * B, h, h);
  for (const bool selective : {false, true}) {
    SCOPED_TRACE(selective ? "selective" : "none");
    ModelConfig mm = m;
    if (selective) mm.recompute = {.granularity = RecomputeGranularity::selective};
    Built b(mm, {.micro_batch_size = B, .global_batch_size = B});
    const rt::TaskTable& tasks = b.step.graph().tasks();
    bool seen_forward = false, seen_backward = false;
    for (rt::TaskId t = 0; t < tasks.size(); ++t) {
      const rt::CostHint& c = tasks[t].cost;
      if (tasks.name(t) == "L0.attention") {
        EXPECT_EQ(c.attention_flops, 0);
        EXPECT_NEAR(c.flops, products + projection, 1e-9 * c.flops);
        EXPECT_NEAR(c.matmul_edges, edges + projection_edges, 1e-6 * c.matmul_edges);
        EXPECT_NEAR(c.bytes, forward_bytes, 1e-9 * c.bytes);
        seen_forward = true;
      }
      if (tasks.name(t) == "L0.attention_backward") {
        // The projection's input and weight gradients, then the core attention's backward.
        const double again = selective ? 1 : 0;
        EXPECT_EQ(c.attention_flops, 0);
        EXPECT_NEAR(c.flops, 2 * projection + (2 + again) * products, 1e-9 * c.flops);
        EXPECT_NEAR(c.matmul_edges, 2 * projection_edges + (2 + again) * edges,
                    1e-6 * c.matmul_edges);
        EXPECT_NEAR(c.bytes, backward_bytes + again * forward_bytes, 1e-9 * c.bytes);
        seen_backward = true;
      }
    }
    EXPECT_TRUE(seen_forward && seen_backward);
  }
}

// A MoE layer's routing streams the rows it moves, beyond the router's product: forward the
// slot's tokens copied in (2 T h), the scores' pass over the logits (2 T E) and every pick's row
// permuted into expert order (2 k T h); backward the picks' gradient rows summed back into the
// tokens' ((k T + T) h), the scores' backward (3 T E) and the router's input gradient added in
// (3 T h). With expert parallelism the experts' task also regroups the arrived rows and their
// results (2 x 2 k T h), forward and backward. Twice the tokens stream twice the bytes, and the
// step built with tensors carries the same costs as the one built without.
TEST(StepCosts, MoeRoutingStreamsTheRowsItMoves) {
  const ModelConfig m = tiny(4);
  const double h = m.hidden_size, E = m.num_experts, k = m.moe_router_topk, a = 4;
  auto build_costs = [&](const ParallelPlan& plan, bool materialize) {
    return device0_compute_costs(m, plan, materialize);
  };
  for (const int ep : {1, 2}) {
    std::map<int, double> router_bytes;
    for (const int B : {2, 4}) {
      SCOPED_TRACE(fmt::format("ep {}, micro-batch {}", ep, B));
      const ParallelPlan plan{.expert_parallel = ep,
                              .data_parallel = ep,
                              .micro_batch_size = B,
                              .global_batch_size = B * ep};
      const auto predicted = build_costs(plan, false);
      const double T = static_cast<double>(m.seq_length) * B;
      const double products = 2 * 2 * k * T * h * m.ffn_hidden_size;
      const double regrouping = ep > 1 ? a * 2 * 2 * k * T * h : 0;
      const rt::CostHint& router = predicted.at("L0.router");
      EXPECT_DOUBLE_EQ(router.flops, 2 * T * h * E);
      EXPECT_DOUBLE_EQ(router.bytes, a * (2 * T * h + 2 * T * E + 2 * k * T * h));
      EXPECT_DOUBLE_EQ(predicted.at("L0.router_backward").bytes,
                       a * ((k * T + T) * h + 3 * T * E + 3 * T * h));
      EXPECT_DOUBLE_EQ(predicted.at("L0.experts").flops, products);
      EXPECT_DOUBLE_EQ(predicted.at("L0.experts").bytes, regrouping);
      EXPECT_DOUBLE_EQ(predicted.at("L0.experts_backward").bytes, regrouping);
      router_bytes[B] = router.bytes;
      // The materialised step: every compute task of device 0 at the same price.
      const auto materialised = build_costs(plan, true);
      ASSERT_EQ(materialised.size(), predicted.size());
      for (const auto& [name, cost] : predicted) {
        ASSERT_TRUE(materialised.contains(name)) << name;
        EXPECT_EQ(materialised.at(name).bytes, cost.bytes) << name;
        EXPECT_EQ(materialised.at(name).flops, cost.flops) << name;
        EXPECT_EQ(materialised.at(name).messages, cost.messages) << name;
      }
    }
    EXPECT_DOUBLE_EQ(router_bytes[4], 2 * router_bytes[2]);
  }
}

// MindSpeed's deepspeed_moe gate without --enable-token-rearrange-opt dispatches by the einsum
// "sec,sm->ecm" and combines by "sec,ecm->sm" over a gate call's one-hot [T, E, C] tensors
// (mindspeed/moe/moe_layer.py): dense products of 2 E C T h each, forward; backward the dispatch's
// input gradient and the combine's two. With the flag (index_select) the same step carries none.
// The capacity grows with the gate call's tokens, so twice the tokens take four times the
// einsums' work: what Ampipe's chunks, each gated apart, halve. The step built with tensors
// carries the same costs.
TEST(StepCosts, MindSpeedsGateDispatchesAndCombinesByDenseEinsums) {
  ModelConfig m = tiny(4);
  m.moe_gate = MoeGate::deepspeed;
  m.moe_z_loss_coeff = 0;  // MindSpeed's gate has none
  const double h = m.hidden_size, E = m.num_experts;
  auto build_costs = [&](const ModelConfig& model, int B, bool materialize) {
    ParallelPlan plan{.micro_batch_size = B, .global_batch_size = B};
    plan.moe_model_type = "deepspeed_moe";
    validate(model, plan);
    return device0_compute_costs(model, plan, materialize);
  };
  ModelConfig rearranged = m;
  rearranged.moe_token_rearrange = true;
  std::map<int, double> einsums;
  for (const int B : {2, 4}) {
    SCOPED_TRACE(fmt::format("micro-batch {}", B));
    const double T = static_cast<double>(m.seq_length) * B;
    const double C =
        static_cast<double>(ops::gate_capacity(static_cast<std::int64_t>(T), m.num_experts,
                                               m.moe_router_topk, m.moe_train_capacity_factor));
    const double einsum = 2 * E * C * T * h;
    const auto dense = build_costs(m, B, false), index = build_costs(rearranged, B, false);
    EXPECT_DOUBLE_EQ(dense.at("L0.router").flops - index.at("L0.router").flops, einsum);
    EXPECT_DOUBLE_EQ(dense.at("L0.combine").flops - index.at("L0.combine").flops, einsum);
    EXPECT_DOUBLE_EQ(dense.at("L0.router_backward").flops - index.at("L0.router_backward").flops,
                     einsum);
    EXPECT_DOUBLE_EQ(dense.at("L0.combine_backward").flops - index.at("L0.combine_backward").flops,
                     2 * einsum);
    EXPECT_EQ(dense.at("L0.combine").messages, index.at("L0.combine").messages + 1);
    einsums[B] = einsum;
    const auto materialised = build_costs(m, B, true);
    for (const auto& [name, cost] : dense) {
      ASSERT_TRUE(materialised.contains(name)) << name;
      EXPECT_EQ(materialised.at(name).flops, cost.flops) << name;
    }
  }
  EXPECT_DOUBLE_EQ(einsums[4], 4 * einsums[2]);
}

// Kernel rates for the timing tests: products at 200 GFLOP/s slowed by dimensions near 16,
// attention at 50 GFLOP/s, streaming at 10 GB/s.
const ModelledMachine kKernelRates{.device_flops = 2e11,
                                   .device_memory_bandwidth = 1e10,
                                   .attention_flops = 5e10,
                                   .matmul_overhead_dimension = 16};

// On the virtual clock the router's task lasts its product's time and its streaming's: the
// routing's bytes at the memory bandwidth, whatever rates the products have.
TEST(StepCosts, TheRoutersRowsAreTimedAtTheMemoryBandwidth) {
  const ModelConfig m = tiny(4);
  Built b(m, {.micro_batch_size = 2, .global_batch_size = 2});
  const devices::MachineModel machine = machine_model(b.set, kKernelRates);
  const rt::TaskTable& tasks = b.step.graph().tasks();
  bool seen = false;
  for (rt::TaskId t = 0; t < tasks.size(); ++t) {
    if (tasks.name(t) != "L0.router") continue;
    // [T, h] x [h, E] = [32, 32] x [32, 4] with T = 16 x 2 tokens, then the routing's bytes.
    const double T = 32, h = 32, E = 4, k = 2;
    const double product = 2 * T * h * E * (1 + 16 / T + 16 / h + 16 / E) / 2e11;
    const double streaming = 4 * (2 * T * h + 2 * T * E + 2 * k * T * h) / 1e10;
    EXPECT_NEAR(static_cast<double>(machine.duration(tasks, t)), (product + streaming) * 1e9, 1.0);
    seen = true;
  }
  EXPECT_TRUE(seen);
}

// With kernel rates a task's time is its products' time (slowed by their small dimensions), its
// attention's and its streaming's, summed.
TEST(StepCosts, KernelRatesPriceEachKindOfWork) {
  const ModelConfig m = tiny(0);
  Built b(m, {.micro_batch_size = 2, .global_batch_size = 2});
  const devices::MachineModel machine = machine_model(b.set, kKernelRates);
  ASSERT_TRUE(machine.kernels().has_value());
  const rt::TaskTable& tasks = b.step.graph().tasks();
  bool seen_qkv = false, seen_attention = false, seen_norm = false;
  for (rt::TaskId t = 0; t < tasks.size(); ++t) {
    const std::string_view name = tasks.name(t);
    if (name == "L0.qkv") {
      // [S B, h] x [h, 3h] = [32, 32] x [32, 96]: 2mnk (1 + d0/m + d0/k + d0/n) at 2e11.
      const double mm = 32, k = 32, n = 96;
      const double seconds = 2 * mm * k * n * (1 + 16 / mm + 16 / k + 16 / n) / 2e11;
      EXPECT_NEAR(static_cast<double>(machine.duration(tasks, t)), seconds * 1e9, 1.0);
      seen_qkv = true;
    }
    if (name == "L0.attention") {
      // The causal attention at 5e10 and the output projection [32, 32] x [32, 32] at 2e11.
      const double attention = 2 * 2 * 2 * 4 * 16 * 16 * 8 * 0.5;
      const double projection = 2.0 * 32 * 32 * 32 * (1 + 3 * 16 / 32.0);
      EXPECT_NEAR(static_cast<double>(machine.duration(tasks, t)),
                  (attention / 5e10 + projection / 2e11) * 1e9, 1.0);
      seen_attention = true;
    }
    if (name == "L0.input_norm") {
      EXPECT_EQ(machine.duration(tasks, t), std::llround(4.0 * 2 * 16 * 2 * 32 / 1e10 * 1e9));
      seen_norm = true;
    }
  }
  EXPECT_TRUE(seen_qkv && seen_attention && seen_norm);
  // The same step without the kernel model prices every FLOP at device_flops: the products'
  // small dimensions and the slower attention make the step longer with it.
  rt::VirtualClock with(machine, {.execute = false});
  const devices::MachineModel roofline =
      machine_model(b.set, ModelledMachine{.device_flops = 2e11, .device_memory_bandwidth = 1e10});
  rt::VirtualClock without(roofline, {.execute = false});
  EXPECT_GT(with.run(b.step.graph()).makespan, without.run(b.step.graph()).makespan);
}

// Before each bucket's data-parallel collective Megatron-Core's start_grad_sync checks the bucket
// for NaN (a norm: every gradient read) and scales it by 1 / replicas in place (read and
// written), on the compute stream: a ".check" task per bucket streaming 3 x 4 bytes of each fp32
// gradient, every gradient once (zero_grads clears them all, 4 bytes each). A loss scaler owns
// overflows (Megatron-LM turns the check off under dynamic loss scaling): only the scaling's 2 x
// 4. With one replica there is no collective and neither pass.
TEST(StepCosts, ABucketIsCheckedAndScaledBeforeItsDataParallelReduction) {
  auto bytes_of = [](Precision precision, int replicas) {
    ModelConfig m = tiny(0);
    m.precision = precision;
    Built b(m,
            {.data_parallel = replicas,
             .micro_batch_size = 2,
             .global_batch_size = 2 * replicas,
             .distributed_optimizer = true,
             .overlap_grad_reduce = true},
            {.loss_scaling = precision == Precision::fp16});
    const rt::TaskTable& tasks = b.step.graph().tasks();
    double checks = 0, cleared = 0;
    int reductions = 0, checked = 0;
    for (rt::TaskId t = 0; t < tasks.size(); ++t) {
      if (tasks[t].device != 0) continue;
      const std::string_view name = tasks.name(t);
      if (name == "zero_grads") cleared = tasks[t].cost.bytes;
      if (name.ends_with(".check")) {
        checks += tasks[t].cost.bytes;
        ++checked;
      }
      // A bucket's reduction over its replicas: "<bucket>.dp", with the collective's index.
      if (name.find(".dp") != std::string_view::npos && tasks[t].kind != rt::TaskKind::compute)
        ++reductions;
    }
    EXPECT_EQ(checked, reductions) << "one check per bucket reduced";
    return std::pair{checks, cleared};
  };
  const auto [fp32, fp32_cleared] = bytes_of(Precision::fp32, 2);
  EXPECT_GT(fp32_cleared, 0);
  EXPECT_DOUBLE_EQ(fp32, 3 * fp32_cleared);
  const auto [bf16, bf16_cleared] = bytes_of(Precision::bf16, 2);
  EXPECT_DOUBLE_EQ(bf16, 3 * bf16_cleared);
  const auto [fp16, fp16_cleared] = bytes_of(Precision::fp16, 2);
  EXPECT_DOUBLE_EQ(fp16, 2 * fp16_cleared);
  EXPECT_EQ(bytes_of(Precision::fp32, 1).first, 0);
}

// Megatron-LM's default --delay-grad-reduce under the 1F1B schedule: only the first pipeline
// stage reduces its buckets as the last backward completes them; the later stages start every
// reduction after their last backward (weave's "grad_sync_start" marks that point, as without
// --overlap-grad-reduce on every rank). With virtual stages every rank overlaps.
TEST(StepCosts, LaterPipelineStagesReduceAfterTheirLastBackward) {
  auto delayed_ranks = [](bool overlap, int virtual_stages) {
    ModelConfig m = tiny(0);
    m.num_layers = 4;
    Built b(m, {.data_parallel = 2,
                .pipeline_parallel = 2,
                .virtual_pipeline = virtual_stages,
                .micro_batch_size = 1,
                .global_batch_size = 8,
                .distributed_optimizer = true,
                .overlap_grad_reduce = overlap});
    const rt::TaskTable& tasks = b.step.graph().tasks();
    std::map<rt::DeviceId, int> marks;
    for (rt::TaskId t = 0; t < tasks.size(); ++t)
      if (tasks.name(t) == "grad_sync_start") ++marks[tasks[t].device];
    return marks.size();
  };
  EXPECT_EQ(delayed_ranks(true, 1), 2u);   // the second stage's two replicas
  EXPECT_EQ(delayed_ranks(false, 1), 4u);  // every rank without the overlap
  EXPECT_EQ(delayed_ranks(true, 2), 0u);   // the interleaved schedule overlaps on every stage
}

}  // namespace
}  // namespace weave::graphs
