// Experts split over the tensor-parallel group (MindSpeed's deepspeed_moe layout): every
// configuration gives the one-device model's loss, aux loss and every gradient (in the logical
// layout, so each rank's expert slices land where the whole experts have them), and its loss
// curve, with and without Ampipe, pipe experts and the tp-sp overlap.
#include <gtest/gtest.h>

#include <cmath>

#include "step_outcome.hpp"
#include "tiny_model.hpp"

namespace weave::graphs {
namespace {

struct Case {
  const char* name;
  ParallelPlan plan;
  bool swiglu = false;
};

class SplitExperts : public ::testing::TestWithParam<Case> {};

TEST_P(SplitExperts, EqualOneDevice) {
  const Case c = GetParam();
  ModelConfig m = tiny(4);
  m.moe_layer_freq = 1;
  m.seq_length = 32;  // divisible by 4 cp tp and by 2 degree tp
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
};

INSTANTIATE_TEST_SUITE_P(Plans, SplitExperts, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace weave::graphs
