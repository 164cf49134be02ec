// Experts split over the tensor-parallel group (MindSpeed's deepspeed_moe layout): every
// configuration gives the one-device model's loss, aux loss and every gradient (in the logical
// layout, so each rank's expert slices land where the whole experts have them), and its loss
// curve, with and without Ampipe, pipe experts and the tp-sp overlap.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <string>

#include "step_outcome.hpp"
#include "tiny_model.hpp"
#include "weave/devices/machine_model.hpp"
#include "weave/graphs/prediction.hpp"
#include "weave/ops/deepspeed_gate.hpp"
#include "weave/runtime/trace_metrics.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::graphs {
namespace {

struct Case {
  const char* name;
  ParallelPlan plan;
  bool swiglu = false;
  std::int64_t seq_length = 32;  // divisible by 4 cp tp and by 2 degree tp
};

class SplitExperts : public ::testing::TestWithParam<Case> {};

TEST_P(SplitExperts, EqualOneDevice) {
  const Case c = GetParam();
  ModelConfig m = tiny(4);
  m.moe_layer_freq = 1;
  m.seq_length = c.seq_length;
  if (c.plan.tensor_parallel > m.num_attention_heads) {  // a head and 8 vocabulary rows a rank
    m.num_attention_heads = c.plan.tensor_parallel;
    m.make_vocab_size_divisible_by = 8;
  }
  if (c.swiglu) m.activation = Activation::swiglu;
  ParallelPlan plan = c.plan;
  plan.moe_model_type = "deepspeed_moe";
  const ParallelPlan serial{.micro_batch_size = plan.micro_batch_size,
                            .global_batch_size = plan.global_batch_size};
  const Outcome a = run(m, serial, 1, false), b = run(m, plan, 1, false);
  EXPECT_NEAR(b.losses[0], a.losses[0], 1e-5 * a.losses[0]);
  EXPECT_NEAR(b.aux[0], a.aux[0], 1e-5 * std::max(a.aux[0], 1e-3));
  // The distributed optimizer leaves each replica only its shard of the reduced gradients: its
  // losses and curve are compared.
  if (!plan.distributed_optimizer) expect_same_gradients(a, b);
  const Outcome a5 = run(m, serial, 5, true), b5 = run(m, plan, 5, true);
  for (std::size_t i = 0; i < a5.losses.size(); ++i)
    EXPECT_NEAR(b5.losses[i], a5.losses[i], 1e-4 * a5.losses[i]) << "step " << i + 1;
}

const Case kCases[] = {
    {"tp2_sp",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .micro_batch_size = 2,
      .global_batch_size = 4}},
    {"tp2_no_sp", {.tensor_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}},
    {"tp2_sp_ep2_dp2",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4}},
    {"tp2_sp_ep2_dp2_swiglu",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4},
     true},
    {"tp4_sp_ep2_dp2",
     {.tensor_parallel = 4,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 2}},
    {"tp2_sp_ep2_cp2",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .context_parallel = 2,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 2}},
    {"tp2_sp_ep2_dp2_ampipe2",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .ampipe_degree = 2}},
    {"tp2_sp_ep2_dp2_pp2_zb_h1",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .data_parallel = 2,
      .pipeline_parallel = 2,
      .pipeline_scheduler = "zb-h1",
      .micro_batch_size = 1,
      .global_batch_size = 4}},
    {"tp2_sp_ep2_dp2_distributed_optimizer",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .distributed_optimizer = true}},
    // Ampipe without SP: each chunk's projection all-reduced, every tp rank routing its slice
    // of the chunk, the chunk's output gathered back.
    {"tp2_ep2_dp2_ampipe2",
     {.tensor_parallel = 2,
      .expert_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .ampipe_degree = 2}},
    // --ampipe-tp-sp-comm-overlap without SP: the items' tensor-parallel reductions pipelined.
    {"tp2_ep2_dp2_ampipe2_overlap",
     {.tensor_parallel = 2,
      .expert_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .ampipe_degree = 2,
      .ampipe_tp_sp_comm_overlap = true}},
    // --ampipe-tp-sp-comm-overlap: (chunk, local expert) items over every chunk.
    {"tp2_sp_ep2_dp2_ampipe2_overlap",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .ampipe_degree = 2,
      .ampipe_tp_sp_comm_overlap = true}},
    {"tp2_sp_ep2_dp2_ampipe2_overlap_swiglu",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .ampipe_degree = 2,
      .ampipe_tp_sp_comm_overlap = true},
     true},
    {"tp2_sp_ep4_dp4_ampipe2_overlap",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 4,
      .data_parallel = 4,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .ampipe_degree = 2,
      .ampipe_tp_sp_comm_overlap = true}},
    {"tp4_sp_ep2_dp2_ampipe2_overlap",
     {.tensor_parallel = 4,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 2,
      .ampipe_degree = 2,
      .ampipe_tp_sp_comm_overlap = true}},
    {"tp2_sp_ep2_dp2_pp2_zb_h1_ampipe2_overlap",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .data_parallel = 2,
      .pipeline_parallel = 2,
      .pipeline_scheduler = "zb-h1",
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .ampipe_degree = 2,
      .ampipe_tp_sp_comm_overlap = true}},
    // Pipe experts with split experts: items of one slot, each gathered and reduce-scattered.
    {"tp2_sp_ep2_dp2_pipe_experts_multi_data2",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .pipe_experts = true,
      .pipe_experts_multi_data = 2}},
    {"tp2_sp_ep2_dp2_ampipe2_pipe_experts_multi_data4",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .ampipe_degree = 2,
      .pipe_experts = true,
      .pipe_experts_multi_data = 4}},
    {"tp2_sp_ep2_dp2_ampipe2_pipe_experts_multi_data2_multi_stream",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .ampipe_degree = 2,
      .pipe_experts = true,
      .pipe_experts_multi_stream = true,
      .pipe_experts_multi_data = 2}},
    {"tp2_sp_ep4_dp4_ampipe2_pipe_experts_multi_data4_multi_stream",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 4,
      .data_parallel = 4,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .ampipe_degree = 2,
      .pipe_experts = true,
      .pipe_experts_multi_stream = true,
      .pipe_experts_multi_data = 4}},
    {"tp4_sp_ep2_dp2_ampipe2_pipe_experts_multi_data4_multi_stream_swiglu",
     {.tensor_parallel = 4,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 2,
      .ampipe_degree = 2,
      .pipe_experts = true,
      .pipe_experts_multi_stream = true,
      .pipe_experts_multi_data = 4},
     true},
    // MindSpeed's own grid: (tp, ep) = (8, 1) (no all-to-all: the overlap is switched off)...
    {"tp8_sp_ampipe2",
     {.tensor_parallel = 8,
      .sequence_parallel = true,
      .micro_batch_size = 1,
      .global_batch_size = 1,
      .ampipe_degree = 2,
      .ampipe_tp_sp_comm_overlap = true},
     false,
     64},
    // ... degree 3 ...
    {"tp2_sp_ep2_dp2_ampipe3_overlap",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .ampipe_degree = 3,
      .ampipe_tp_sp_comm_overlap = true},
     false,
     48},
    // ... and (2, 2), (2, 4), (4, 2) under context parallelism: the chunks are each rank's
    // halves, every tp rank holding a piece of each.
    {"tp2_sp_ep2_cp2_ampipe2_overlap",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .context_parallel = 2,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 2,
      .ampipe_degree = 2,
      .ampipe_tp_sp_comm_overlap = true}},
    {"tp2_sp_ep2_cp2_ampipe2_overlap_swiglu",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .context_parallel = 2,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 2,
      .ampipe_degree = 2,
      .ampipe_tp_sp_comm_overlap = true},
     true},
    {"tp2_sp_ep2_cp2_ampipe2_overlap_resend_kv",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .context_parallel = 2,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 2,
      .ampipe_degree = 2,
      .ampipe_tp_sp_comm_overlap = true,
      .ampipe_cp_resend_kv = true}},
    {"tp2_sp_ep2_cp2_ampipe2_no_overlap",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .context_parallel = 2,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 2,
      .ampipe_degree = 2}},
    {"tp2_sp_ep4_cp2_dp2_ampipe2_overlap",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .context_parallel = 2,
      .expert_parallel = 4,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 2,
      .ampipe_degree = 2,
      .ampipe_tp_sp_comm_overlap = true}},
    {"tp4_sp_ep2_cp2_ampipe2_overlap",
     {.tensor_parallel = 4,
      .sequence_parallel = true,
      .context_parallel = 2,
      .expert_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 1,
      .ampipe_degree = 2,
      .ampipe_tp_sp_comm_overlap = true}},
    // Pipe experts under CP: multi-data 2 and 4, multi-stream on and off.
    {"tp2_sp_ep2_cp2_ampipe2_pipe_experts_multi_data2_multi_stream",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .context_parallel = 2,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 2,
      .ampipe_degree = 2,
      .pipe_experts = true,
      .pipe_experts_multi_stream = true,
      .pipe_experts_multi_data = 2}},
    {"tp2_sp_ep2_cp2_ampipe2_pipe_experts_multi_data4",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .context_parallel = 2,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 2,
      .ampipe_degree = 2,
      .pipe_experts = true,
      .pipe_experts_multi_data = 4}},
    {"tp2_sp_ep2_cp2_ampipe2_pipe_experts_multi_data4_multi_stream",
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .context_parallel = 2,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 2,
      .ampipe_degree = 2,
      .pipe_experts = true,
      .pipe_experts_multi_stream = true,
      .pipe_experts_multi_data = 4}},
};

INSTANTIATE_TEST_SUITE_P(Plans, SplitExperts, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// One step of a one-layer MoE model (tp 2 + SP, ep 2, dp 2, split experts) on the virtual
// clock, with the kernels run (or skipped: `execute`), on links where an expert's all-gather costs
// about what its fc1 does.
rt::Trace replay(ParallelPlan plan, MoeGate gate = MoeGate::megatron, bool execute = true,
                 int experts = 4) {
  ModelConfig m = tiny(experts);
  m.moe_gate = gate;
  if (gate == MoeGate::deepspeed) m.moe_z_loss_coeff = 0;  // MindSpeed's gate has none
  m.num_layers = 1;
  m.moe_layer_freq = 1;
  m.hidden_size = 256;
  m.num_attention_heads = 8;
  m.ffn_hidden_size = 512;
  m.seq_length = 256;
  m.hidden_dropout = 0;
  if (plan.moe_model_type.empty()) plan.moe_model_type = "deepspeed_moe";
  validate(m, plan);
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  TrainingStep step(m, plan, {}, set, comm);
  fill_batches(step, m, plan);
  step.prepare(1, 1e-3);
  const devices::MachineModel model(std::vector<int>(set.size(), 0), 1e12,
                                    devices::LinkModel::preset("ampipe-20gbps"));
  rt::VirtualClock clock(model, {.execute = execute});
  return clock.run(step.graph()).trace;
}

ParallelPlan split_plan() {
  return {.tensor_parallel = 2,
          .sequence_parallel = true,
          .expert_parallel = 2,
          .data_parallel = 2,
          .micro_batch_size = 1,
          .global_batch_size = 2};
}

// When the replayed step's last task ends.
rt::Nanos step_end(const rt::Trace& trace) {
  rt::Nanos end = 0;
  for (const rt::Span& s : trace.spans())
    end = std::max(end, s.end);
  return end;
}

bool overlap(const rt::Span& a, const rt::Span& b) {
  return a.start < b.end && b.start < a.end;
}

TEST(SplitExperts, TpSpOverlapGathersTheNextItemUnderThisItemsFc1) {
  ParallelPlan plain = split_plan();
  plain.ampipe_degree = 2;
  ParallelPlan piped = plain;
  piped.ampipe_tp_sp_comm_overlap = true;
  const rt::Trace without = replay(plain), with = replay(piped);
  const rt::Span* gather = with.find("L0.c0.i1.experts_gather[0]");
  const rt::Span* fc1 = with.find("L0.c0.i0.fc1");
  ASSERT_TRUE(gather && fc1) << "the overlap's items are missing";
  EXPECT_TRUE(overlap(*gather, *fc1)) << "gather [" << gather->start << ", " << gather->end
                                      << "), fc1 [" << fc1->start << ", " << fc1->end << ")";
  // The experts' tensor-parallel traffic, exposed: less once it is pipelined.
  constexpr std::string_view kTensorParallel[] = {"experts_gather", "experts_scatter",
                                                  "experts_grad_gather", "experts_grad_scatter"};
  const rt::Nanos exposed_without = rt::exposed_comm_named(without, kTensorParallel);
  const rt::Nanos exposed_with = rt::exposed_comm_named(with, kTensorParallel);
  EXPECT_GT(exposed_without, 0);
  EXPECT_LT(exposed_with, exposed_without)
      << "exposed tp: " << exposed_with << " ns with the overlap, " << exposed_without
      << " ns without";
}

// Without SP (MindSpeed's async all-reduce of each item's output under the next item's
// expert compute, ampipe_moe_mlp_computer.py): each item's tensor-parallel reduction runs while
// the next item's fc1 computes, across the chunks too (chunk 0's last item under chunk 1's
// first), and the step is shorter than without the overlap on a slow link.
TEST(SplitExperts, TpOverlapWithoutSpReducesEachItemUnderTheNextItemsFc1) {
  ParallelPlan plain = split_plan();
  plain.sequence_parallel = false;
  plain.ampipe_degree = 2;
  ParallelPlan piped = plain;
  piped.ampipe_tp_sp_comm_overlap = true;
  const rt::Trace without = replay(plain), with = replay(piped);
  // tiny's 4 experts over ep 2: items (c, i) for chunks c and local experts i in {0, 1}.
  const std::pair<const char*, const char*> under[] = {
      {"L0.c0.i0.experts_scatter[0]", "L0.c0.i1.fc1"},
      {"L0.c0.i1.experts_scatter[0]", "L0.c1.i0.fc1"},
      {"L0.c1.i0.experts_scatter[0]", "L0.c1.i1.fc1"}};
  for (const auto& [reduce, next] : under) {
    const rt::Span* r = with.find(reduce);
    const rt::Span* f = with.find(next);
    ASSERT_TRUE(r && f) << reduce << " or " << next << " is missing";
    EXPECT_EQ(with.tasks().stream_name(with.tasks()[r->task].stream), "tp") << reduce;
    EXPECT_TRUE(overlap(*r, *f)) << reduce << " [" << r->start << ", " << r->end << "), " << next
                                 << " [" << f->start << ", " << f->end << ")";
  }
  // Without the overlap a chunk's experts reduce once, after all its local experts.
  EXPECT_EQ(without.find("L0.c0.i0.experts_scatter[0]"), nullptr);
  ASSERT_NE(without.find("L0.c0.experts_scatter[0]"), nullptr);
  EXPECT_LT(step_end(with), step_end(without))
      << step_end(with) << " ns with the overlap, " << step_end(without) << " ns without";
}

// MindSpeed's gate without SP: every tp rank holds each item's rows, so fc2's partial sums are
// all-reduced (async_fw_all_reduce_scatter_ampipe), each item's all-reduce on the tp stream while
// the next item's fc1 computes, its combine issued after that fc1; the step is shorter than
// without the overlap on a slow link.
TEST(SplitExperts, GateRoutedOnEveryTpRankAllReducesEachItemUnderTheNextItemsFc1) {
  ParallelPlan plain = split_plan();
  plain.sequence_parallel = false;
  plain.ampipe_degree = 2;
  ParallelPlan piped = plain;
  piped.ampipe_tp_sp_comm_overlap = true;
  // The kernels skipped (the all-to-alls timed for balanced routing): the order is the graph's.
  const rt::Trace without = replay(plain, MoeGate::deepspeed, false);
  const rt::Trace with = replay(piped, MoeGate::deepspeed, false);
  const char* const items[] = {"L0.c0.i0.", "L0.c0.i1.", "L0.c1.i0.", "L0.c1.i1."};
  for (std::size_t k = 0; k + 1 < std::size(items); ++k) {
    const std::string reduce = std::string(items[k]) + "experts_reduce[0]";
    const std::string next = std::string(items[k + 1]) + "fc1";
    const std::string combine = std::string(items[k]) + "combine[0]";
    const rt::Span* r = with.find(reduce);
    const rt::Span* f = with.find(next);
    const rt::Span* a = with.find(combine);
    ASSERT_TRUE(r && f && a) << reduce << ", " << next << " or " << combine << " is missing";
    EXPECT_EQ(with.tasks().stream_name(with.tasks()[r->task].stream), "tp") << reduce;
    EXPECT_TRUE(overlap(*r, *f)) << reduce << " [" << r->start << ", " << r->end << "), " << next
                                 << " [" << f->start << ", " << f->end << ")";
    EXPECT_GE(a->start, f->start) << combine << " starts before " << next;
  }
  // No gather or scatter: the rows are every tp rank's already.
  EXPECT_EQ(with.find("L0.c0.i0.experts_gather[0]"), nullptr);
  EXPECT_EQ(with.find("L0.c0.i0.experts_scatter[0]"), nullptr);
  // Without the overlap a chunk's experts all-reduce once, after all its local experts.
  EXPECT_EQ(without.find("L0.c0.i0.experts_reduce[0]"), nullptr);
  ASSERT_NE(without.find("L0.c0.experts_reduce[0]"), nullptr);
  EXPECT_LT(step_end(with), step_end(without))
      << step_end(with) << " ns with the overlap, " << step_end(without) << " ns without";
}

// A step of ampipe_tp_bench's MoE layer (hidden 512, 8 experts top-2, 2048 positions; one layer,
// tp 2 without SP, ep 2, dp 2) under MindSpeed's gate at Ampipe degree 2, built without tensors
// and replayed on the virtual clock at 1.2e13 FLOP/s on ampipe-20gbps, where a device's
// communication and compute are about equally busy: the step time and the exposed tp time.
std::pair<rt::Nanos, rt::Nanos> bench_layer_step(bool overlap) {
  ModelConfig m = tiny(8);
  m.moe_gate = MoeGate::deepspeed;
  m.moe_z_loss_coeff = 0;  // MindSpeed's gate has none
  m.num_layers = 1;
  m.moe_layer_freq = 1;
  m.hidden_size = 512;
  m.num_attention_heads = 8;
  m.ffn_hidden_size = 1024;
  m.seq_length = 2048;
  m.vocab_size = 256;
  ParallelPlan plan = split_plan();
  plan.sequence_parallel = false;
  plan.moe_model_type = "deepspeed_moe";
  plan.ampipe_degree = 2;
  plan.ampipe_tp_sp_comm_overlap = overlap;
  validate(m, plan);
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  const TrainingStep step(m, plan, {}, set, comm, {.materialize = false});
  const devices::MachineModel model(std::vector<int>(set.size(), 0), 1.2e13,
                                    devices::LinkModel::preset("ampipe-20gbps"));
  rt::VirtualClock clock(model, {.execute = false});
  const rt::VirtualRunResult r = clock.run(step.graph());
  constexpr std::string_view kTensor[] = {"tp", "tp_cp"};
  return {r.makespan, exposed_comm_of_groups(r.trace, kTensor)};
}

// MindSpeed's gate keeps at most C = ceil(n k / E x factor) picks per expert of a gate call (a
// chunk's n tokens), and its experts run dense [ep, C, h] tensors: the tensor-parallel
// all-reduce of an item (a local expert of a chunk) moves ep C rows, and a chunk's items
// together what the chunk's single all-reduce moves without the overlap (E C rows), forward and
// backward. With 8 experts over ep 2 (4 local experts, more than top-2) buffers sized for
// dropless routing made each item's all-reduce 4 times MindSpeed's and the items' together twice
// the chunk's, so on ampipe_tp_bench's layer the overlap lengthened the step and exposed more tp
// time; sized by the capacity it shortens the step and hides tp time.
TEST(SplitExperts, GateRoutedOnEveryTpRankAllReducesTheGatesCapacityTensors) {
  constexpr int kExperts = 8, kTopK = 2, kTp = 2, kEp = 2, kHidden = 256, kPositions = 256;
  ParallelPlan plain = split_plan();
  plain.sequence_parallel = false;
  plain.ampipe_degree = 2;
  ParallelPlan piped = plain;
  piped.ampipe_tp_sp_comm_overlap = true;
  const rt::Trace without = replay(plain, MoeGate::deepspeed, false, kExperts);
  const rt::Trace with = replay(piped, MoeGate::deepspeed, false, kExperts);
  // Every tp rank routes its whole chunk: n = 256 / 2 tokens a gate call.
  const std::int64_t capacity = ops::gate_capacity(kPositions / 2, kExperts, kTopK, 1.0);
  ASSERT_LT(capacity, kPositions / 2) << "the test needs a capacity below the chunk's tokens";
  // A ring all-reduce's member sends and receives 2 (p - 1) / p of the buffer, 4 bytes a value.
  auto ring_bytes = [](std::int64_t rows) {
    return 2.0 * (kTp - 1) / kTp * static_cast<double>(rows) * kHidden * 4;
  };
  auto bytes_on_device0 = [](const rt::Trace& trace, const std::string& name) {
    const rt::TaskTable& tasks = trace.tasks();
    for (rt::TaskId t = 0; t < tasks.size(); ++t)
      if (tasks[t].device == 0 && tasks.name(t) == name) return tasks[t].cost.bytes;
    ADD_FAILURE() << "no task " << name << " on device 0";
    return 0.0;
  };
  for (const char* reduce : {"experts_reduce[0]", "experts_grad_reduce[0]"}) {
    for (const char* chunk : {"L0.c0.", "L0.c1."}) {
      SCOPED_TRACE(std::string(chunk) + reduce);
      double items = 0;
      for (int i = 0; i < kExperts / kEp; ++i) {
        const double item = bytes_on_device0(with, fmt::format("{}i{}.{}", chunk, i, reduce));
        EXPECT_DOUBLE_EQ(item, ring_bytes(kEp * capacity)) << "item " << i;
        items += item;
      }
      const double whole = bytes_on_device0(without, std::string(chunk) + reduce);
      EXPECT_DOUBLE_EQ(whole, ring_bytes(kExperts * capacity));
      EXPECT_DOUBLE_EQ(items, whole);
    }
  }
  const auto [step_without, tp_without] = bench_layer_step(false);
  const auto [step_with, tp_with] = bench_layer_step(true);
  EXPECT_LT(step_with, step_without)
      << step_with << " ns with the overlap, " << step_without << " ns without";
  EXPECT_LT(tp_with, tp_without) << "exposed tp: " << tp_with << " ns with the overlap, "
                                 << tp_without << " ns without";
}

// MindSpeed's deepspeed_moe experts are tensor-parallel linears: their backward (Megatron-LM's
// LinearWithGradAccumulationAndAsyncCommunication) launches fc1's input-gradient reduce-scatter
// (all-reduce when every tp rank routes the rows) and computes the weight gradients while it runs.
// On the virtual clock the collective overlaps the weight half, which starts once the input half
// is done, and the step is shorter than with Megatron-Core's experts split by
// --expert-tensor-parallel-size, whose dispatcher reduces only after their whole backward.
TEST(SplitExperts, Fc1InputGradientReducesUnderTheWeightGradient) {
  for (const bool sp : {true, false}) {
    ParallelPlan plan = split_plan();
    plan.sequence_parallel = sp;
    const MoeGate gate = sp ? MoeGate::megatron : MoeGate::deepspeed;
    const rt::Trace t = replay(plan, gate);
    const std::string reduce = sp ? "L0.experts_grad_scatter[0]" : "L0.experts_grad_reduce[0]";
    const rt::Span* r = t.find(reduce);
    const rt::Span* input = t.find("L0.experts_backward");
    const rt::Span* weights = t.find("L0.experts_weight_grad");
    ASSERT_TRUE(r && input && weights) << reduce << ", the input or the weight half is missing";
    EXPECT_EQ(t.tasks().stream_name(t.tasks()[r->task].stream), "tp") << reduce;
    EXPECT_GE(weights->start, input->end) << "the weight half starts before the input half ends";
    EXPECT_GE(r->start, input->end) << reduce << " starts before the input gradient is complete";
    EXPECT_TRUE(overlap(*r, *weights))
        << reduce << " [" << r->start << ", " << r->end << "), weights [" << weights->start << ", "
        << weights->end << ")";
  }
  ParallelPlan megatron = split_plan();
  megatron.moe_model_type = "megatron";
  megatron.expert_tensor_parallel = 2;
  const rt::Trace core = replay(megatron), mindspeed = replay(split_plan());
  EXPECT_EQ(core.find("L0.experts_weight_grad"), nullptr)
      << "Megatron-Core's split experts computed their weight gradients apart";
  EXPECT_LT(step_end(mindspeed), step_end(core))
      << step_end(mindspeed) << " ns with the reduce-scatter under the weight gradients, "
      << step_end(core) << " ns after them";
}

TEST(SplitExperts, MultiStreamNeverOverlapsExpertAndTensorParallelCollectives) {
  ParallelPlan plan = split_plan();
  plan.pipe_experts = true;
  plan.pipe_experts_multi_data = 2;
  auto clashes = [](const rt::Trace& trace) {
    const rt::TaskTable& tasks = trace.tasks();
    int count = 0;
    for (const rt::Span& a : trace.spans())
      for (const rt::Span& b : trace.spans()) {
        const rt::TaskInfo &x = tasks[a.task], &y = tasks[b.task];
        if (x.device != y.device || x.kind != rt::TaskKind::comm || y.kind != rt::TaskKind::comm)
          continue;
        const bool ep = tasks.stream_name(x.stream) == "ep";
        const bool tp = tasks.stream_name(y.stream) == "tp" &&
                        tasks.name(b.task).find("experts") != std::string_view::npos;
        if (ep && tp && overlap(a, b)) ++count;
      }
    return count;
  };
  const rt::Trace free = replay(plan);
  plan.pipe_experts_multi_stream = true;
  const rt::Trace chained = replay(plan);
  ASSERT_NE(chained.find("L0.i1.experts_gather[0]"), nullptr);
  EXPECT_GT(clashes(free), 0) << "without multi-stream the items' collectives do overlap";
  EXPECT_EQ(clashes(chained), 0);
}

// Explicit edges from a task whose name holds `from` to one whose name holds `to` (and not
// `not_to`), over the step's graph.
int edges_between(const rt::Graph& g, std::string_view from, std::string_view to,
                  std::string_view not_to) {
  int count = 0;
  for (rt::TaskId t = 0; t < g.size(); ++t) {
    if (g.tasks().name(t).find(from) == std::string_view::npos) continue;
    const auto succ = g.successors(t);
    const auto kinds = g.successor_kinds(t);
    for (std::size_t i = 0; i < succ.size(); ++i) {
      const std::string_view name = g.tasks().name(succ[i]);
      if (kinds[i] == rt::EdgeKind::explicit_dependency &&
          name.find(to) != std::string_view::npos && name.find(not_to) == std::string_view::npos)
        ++count;
    }
  }
  return count;
}

// MindSpeed chains each item's dispatch after the gather before it outside Ampipe
// (pipe_experts.py) and leaves Ampipe's dispatches unchained (their ag_events still unset):
// so does the graph, forward and backward.
TEST(SplitExperts, MultiStreamChainsDispatchesAfterGathersOutsideAmpipeOnly) {
  auto graph_edges = [](int degree) {
    ModelConfig m = tiny(4);
    m.num_layers = 1;
    m.moe_layer_freq = 1;
    ParallelPlan plan = split_plan();
    plan.moe_model_type = "deepspeed_moe";
    plan.ampipe_degree = degree;
    plan.pipe_experts = true;
    plan.pipe_experts_multi_stream = true;
    plan.pipe_experts_multi_data = 2;
    validate(m, plan);
    devices::DeviceSet set(plan.devices(), {.pin = false});
    devices::SharedMemoryCommunicator comm;
    const TrainingStep step(m, plan, {}, set, comm);
    const rt::Graph& g = step.graph();
    // Under Ampipe the gathers stay chained, one after another (MindSpeed's all-gather stream).
    if (degree > 1) {
      EXPECT_GT(edges_between(g, "experts_gather", "experts_gather", "grad"), 0);
    }
    return std::pair{edges_between(g, "experts_gather", ".dispatch", "dispatch_backward"),
                     edges_between(g, "experts_grad_gather", "combine_backward", "~")};
  };
  const auto [forward_alone, backward_alone] = graph_edges(1);
  EXPECT_GT(forward_alone, 0);
  EXPECT_GT(backward_alone, 0);
  const auto [forward_ampipe, backward_ampipe] = graph_edges(2);
  EXPECT_EQ(forward_ampipe, 0);
  EXPECT_EQ(backward_ampipe, 0);
}

// The prefixes of device 0's tasks whose names end with `suffix`, in the order they were built.
std::vector<std::string> task_order(const rt::Graph& g, std::string_view suffix) {
  std::vector<std::string> names;
  for (rt::TaskId t = 0; t < g.size(); ++t) {
    const std::string_view name = g.tasks().name(t);
    if (g.tasks()[t].device == 0 && name.size() > suffix.size() &&
        name.substr(name.size() - suffix.size()) == suffix)
      names.emplace_back(name.substr(0, name.size() - suffix.size()));
  }
  return names;
}

// Pipe experts under Ampipe run their items expert-major, as MindSpeed's PipeExpert does: each
// local expert's capacity slices of both chunks before the next expert's, forward in chunk order
// and backward with the chunks reversed.
TEST(SplitExperts, PipeExpertsUnderAmpipeRunTheItemsExpertMajor) {
  ModelConfig m = tiny(4);  // 4 experts over ep 2: local experts 0 and 1
  m.num_layers = 1;
  m.moe_layer_freq = 1;
  ParallelPlan plan = split_plan();
  plan.moe_model_type = "deepspeed_moe";
  plan.ampipe_degree = 2;
  plan.pipe_experts = true;
  plan.pipe_experts_multi_data = 4;       // 2 slices a chunk: items i0, i1 (expert 0), i2, i3
  plan.ampipe_tp_sp_comm_overlap = true;  // MindSpeed splits Ampipe's all-to-alls by expert so
  validate(m, plan);
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  const TrainingStep step(m, plan, {}, set, comm);
  const rt::Graph& g = step.graph();
  const std::vector<std::string> forward = {"L0.c0.i0.", "L0.c0.i1.", "L0.c1.i0.", "L0.c1.i1.",
                                            "L0.c0.i2.", "L0.c0.i3.", "L0.c1.i2.", "L0.c1.i3."};
  const std::vector<std::string> backward = {"L0.c1.i0.", "L0.c1.i1.", "L0.c0.i0.", "L0.c0.i1.",
                                             "L0.c1.i2.", "L0.c1.i3.", "L0.c0.i2.", "L0.c0.i3."};
  EXPECT_EQ(task_order(g, "fc1"), forward);
  EXPECT_EQ(task_order(g, "experts_backward"), backward);
}

// Whole experts (tp 1, MindSpeed's deepspeed_moe layout) with pipe experts under Ampipe: each
// chunk's items in turn, the backward's chunks reversed. MindSpeed runs them expert-major only
// under --ampipe-tp-sp-comm-overlap (which weave switches off for whole experts) and fails
// without it; the plan's warning names that (plan_test's
// AmpipeNamesMindSpeedsFailureWithWholePipeExperts).
TEST(WholeExperts, PipeExpertsUnderAmpipeRunEachChunksItemsInTurn) {
  ModelConfig m = tiny(4);  // 4 experts over ep 2: local experts 0 and 1
  m.num_layers = 1;
  m.moe_layer_freq = 1;
  ParallelPlan plan{.expert_parallel = 2,
                    .moe_model_type = "deepspeed_moe",
                    .data_parallel = 2,
                    .micro_batch_size = 1,
                    .global_batch_size = 2,
                    .ampipe_degree = 2,
                    .pipe_experts = true,
                    .pipe_experts_multi_data = 4};  // 2 slices a chunk: items i0, i1, i2, i3
  const std::vector<std::string> warnings = validate(m, plan);
  ASSERT_TRUE(plan.pipe_experts);
  ASSERT_FALSE(plan.ampipe_tp_sp_comm_overlap);
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  const TrainingStep step(m, plan, {}, set, comm);
  const rt::Graph& g = step.graph();
  const std::vector<std::string> forward = {"L0.c0.i0.", "L0.c0.i1.", "L0.c0.i2.", "L0.c0.i3.",
                                            "L0.c1.i0.", "L0.c1.i1.", "L0.c1.i2.", "L0.c1.i3."};
  const std::vector<std::string> backward = {"L0.c1.i0.", "L0.c1.i1.", "L0.c1.i2.", "L0.c1.i3.",
                                             "L0.c0.i0.", "L0.c0.i1.", "L0.c0.i2.", "L0.c0.i3."};
  EXPECT_EQ(task_order(g, "experts"), forward);
  EXPECT_EQ(task_order(g, "experts_backward"), backward);
  ASSERT_FALSE(warnings.empty());
  EXPECT_NE(warnings[0].find("weave runs each chunk's items in turn, chunk-major"),
            std::string::npos)
      << warnings[0];
}

}  // namespace
}  // namespace weave::graphs
