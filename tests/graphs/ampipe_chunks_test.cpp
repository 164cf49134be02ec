// What each Ampipe chunk's attention takes, from the cost hints the virtual clock replays, which
// price a chunk by the (query, key) products it computes (that it computes exactly those, each
// once, the equal-one-device tests show):
//   - under SP the chunks are contiguous ranges of the sequence, as MindSpeed's permutation
//     makes them, so chunk c of N takes (2c + 1) / N^2 of the causal attention;
//   - under context parallelism each rank's two chunks take about equal shares of its attention,
//     forward and backward, on every rank and for every cp size.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "tiny_model.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/training_step.hpp"
#include "weave/runtime/graph_view.hpp"

namespace weave::graphs {
namespace {

// Cost-hint FLOPs of layer 0's Ampipe chunks on each device: [device][backward][chunk].
using ChunkFlops = std::map<rt::DeviceId, std::vector<std::array<double, 2>>>;

ChunkFlops chunk_attention_flops(const ModelConfig& m, ParallelPlan plan) {
  validate(m, plan);
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  const TrainingStep step(m, plan, {}, set, comm, {.materialize = false});
  const rt::TaskTable& tasks = step.graph().tasks();
  ChunkFlops flops;
  for (rt::TaskId id = 0; id < tasks.size(); ++id) {
    const std::string_view name = tasks.name(id);
    for (int c = 0; c < plan.ampipe_degree; ++c) {
      const std::string prefix = "L0.c" + std::to_string(c) + ".attention";
      if (!name.starts_with(prefix)) continue;
      const bool backward = name.find("backward") != std::string_view::npos;
      auto& device = flops[tasks[id].device];
      device.resize(static_cast<std::size_t>(plan.ampipe_degree), {0, 0});
      device[static_cast<std::size_t>(c)][backward ? 1 : 0] += tasks[id].cost.flops;
    }
  }
  return flops;
}

ModelConfig one_moe_layer(std::int64_t seq_length) {
  ModelConfig m = tiny(4);
  m.num_layers = 1;
  m.moe_layer_freq = 1;
  m.seq_length = seq_length;
  return m;
}

// The Ampipe chunk a task's name places it in ("L<l>.c<k>."), or -1.
int chunk_in_name(std::string_view name) {
  const std::size_t dot = name.find('.');
  if (dot == std::string_view::npos || name.substr(dot + 1, 1) != "c") return -1;
  std::size_t end = dot + 2;
  while (end < name.size() && name[end] >= '0' && name[end] <= '9')
    ++end;
  if (end == dot + 2 || end >= name.size() || name[end] != '.') return -1;
  return std::stoi(std::string(name.substr(dot + 2, end - dot - 2)));
}

// Every task of an Ampipe chunk carries the chunk as its tag (what --graph-filter chunk=K and the
// traces select by), and no other task does: through the attention chunks, the routers, the
// dispatch and combine all-to-alls, the experts (whole, split over tp, or in items under the
// tp-sp overlap), the ring attention's chunks and every backward.
TEST(AmpipeChunks, EveryChunksTasksCarryTheChunkAsTheirTag) {
  ParallelPlan overlap{.tensor_parallel = 2,
                       .sequence_parallel = true,
                       .expert_parallel = 2,
                       .data_parallel = 2,
                       .micro_batch_size = 1,
                       .global_batch_size = 4,
                       .ampipe_degree = 2,
                       .ampipe_tp_sp_comm_overlap = true};
  overlap.moe_model_type = "deepspeed_moe";
  const std::vector<ParallelPlan> plans{
      {.tensor_parallel = 2,
       .sequence_parallel = true,
       .expert_parallel = 2,
       .data_parallel = 2,
       .micro_batch_size = 1,
       .global_batch_size = 2,
       .ampipe_degree = 2},
      {.context_parallel = 2,
       .expert_parallel = 2,
       .micro_batch_size = 1,
       .global_batch_size = 1,
       .ampipe_degree = 2},
      overlap,
      {.expert_parallel = 2, .data_parallel = 2, .micro_batch_size = 1, .global_batch_size = 2}};
  for (ParallelPlan plan : plans) {
    const ModelConfig m = one_moe_layer(64);
    validate(m, plan);
    devices::DeviceSet set(plan.devices(), {.pin = false});
    devices::SharedMemoryCommunicator comm;
    const TrainingStep step(m, plan, {}, set, comm, {.materialize = false});
    const rt::TaskTable& tasks = step.graph().tasks();
    const rt::GraphFilter chunk1 = rt::parse_graph_filter("chunk=1");
    std::size_t tagged = 0;
    for (rt::TaskId id = 0; id < tasks.size(); ++id) {
      const int expected = chunk_in_name(tasks.name(id));
      EXPECT_EQ(tasks[id].tags.chunk, expected) << tasks.name(id);
      EXPECT_EQ(chunk1.selects(tasks, id), expected == 1) << tasks.name(id);
      tagged += expected >= 0 ? 1 : 0;
    }
    // Without Ampipe nothing is a chunk's; with it both chunks' tasks are there.
    if (plan.ampipe_degree == 1)
      EXPECT_EQ(tagged, 0u);
    else
      EXPECT_GT(tagged, 20u);
  }
}

TEST(AmpipeChunks, UnderSequenceParallelismChunksAreContiguous) {
  for (const int degree : {2, 4}) {
    const ModelConfig m = one_moe_layer(64);
    const ParallelPlan plan{.tensor_parallel = 2,
                            .sequence_parallel = true,
                            .expert_parallel = 2,
                            .data_parallel = 2,
                            .micro_batch_size = 1,
                            .global_batch_size = 2,
                            .ampipe_degree = degree};
    // The rank's causal attention: B Hl heads, S queries against S keys, half of the pairs.
    const double d = static_cast<double>(m.hidden_size / m.num_attention_heads);
    const double heads = m.num_attention_heads / 2.0, S = static_cast<double>(m.seq_length);
    const double causal = 2 * 2 * heads * S * S * d * 0.5;
    for (const auto& [device, chunks] : chunk_attention_flops(m, plan))
      for (int c = 1; c < degree; ++c) {
        // Every chunk's hint adds the same share of the out-projection: differences are the
        // attention's, chunk c taking (2c + 1) / N^2 of it.
        const double more = chunks[static_cast<std::size_t>(c)][0] - chunks[0][0];
        EXPECT_NEAR(more, 2.0 * c / (degree * degree) * causal, 1e-9 * causal)
            << "degree " << degree << ", device " << device << ", chunk " << c;
      }
  }
}

TEST(AmpipeChunks, UnderContextParallelismEachRanksChunksTakeEqualAttention) {
  for (const int cp : {2, 4, 8})
    for (const int tp : {1, 2}) {
      const ChunkFlops flops = chunk_attention_flops(one_moe_layer(32 * cp),  // 4 cp tp divides
                                                     {.tensor_parallel = tp,
                                                      .sequence_parallel = tp > 1,
                                                      .context_parallel = cp,
                                                      .expert_parallel = 2,
                                                      .micro_batch_size = 1,
                                                      .global_batch_size = 1,
                                                      .ampipe_degree = 2});
      ASSERT_EQ(flops.size(), static_cast<std::size_t>(cp * tp)) << "cp " << cp << " tp " << tp;
      const double whole = flops.begin()->second[0][0] + flops.begin()->second[1][0];
      for (const auto& [device, chunks] : flops)
        for (int backward = 0; backward < 2; ++backward) {
          const double c0 = chunks[0][backward], c1 = chunks[1][backward];
          const std::string at = "cp " + std::to_string(cp) + " tp " + std::to_string(tp) +
                                 ", device " + std::to_string(device) +
                                 (backward ? ", backward" : ", forward");
          EXPECT_GT(c0, 0) << at;
          EXPECT_LE(std::abs(c0 - c1), 0.1 * std::max(c0, c1))
              << at << ": chunk 0 " << c0 << " FLOPs, chunk 1 " << c1;
          // Load-balanced CP gives every rank the same causal work in all.
          if (backward == 0) {
            EXPECT_DOUBLE_EQ(c0 + c1, whole) << at;
          }
        }
    }
}

// --ampipe-cp-resend-kv: each layer keeps its own key/value block only, the others coming round
// the ring again in backward into a workspace of cp - 1 blocks (one for the forward's ring, one
// for the backward's): the activations shrink by cp - 1 blocks per layer less the workspaces.
TEST(AmpipeChunks, ResendingTheBlocksKeepsOneBlockPerLayer) {
  const int cp = 4, layers = 3;
  ModelConfig m = one_moe_layer(32 * cp);
  m.num_layers = layers;
  ParallelPlan keep{.context_parallel = cp,
                    .expert_parallel = 2,
                    .micro_batch_size = 1,
                    .global_batch_size = 1,
                    .ampipe_degree = 2};
  ParallelPlan resend = keep;
  resend.ampipe_cp_resend_kv = true;
  validate(m, keep);
  validate(m, resend);
  devices::SharedMemoryCommunicator comm;
  devices::DeviceSet a(keep.devices(), {.pin = false}), b(resend.devices(), {.pin = false});
  const TrainingStep kept(m, keep, {}, a, comm, {.materialize = false});
  const TrainingStep sent(m, resend, {}, b, comm, {.materialize = false});
  // One block: a rank's Sc positions' keys and values, B = 1, every head.
  const std::int64_t block =
      static_cast<std::int64_t>(m.seq_length / cp) * m.hidden_size * 2 * sizeof(float);
  for (int d = 0; d < keep.devices(); ++d) {
    const auto id = static_cast<rt::DeviceId>(d);
    const std::int64_t with = a.memory().current(id, rt::MemoryCategory::activations);
    const std::int64_t without = b.memory().current(id, rt::MemoryCategory::activations);
    EXPECT_EQ(with - without, (layers - 2) * (cp - 1) * block) << "device " << d;
  }
  // Each layer's backward sends the blocks round again: cp - 1 more ring steps.
  auto ring_steps = [](const TrainingStep& step) {
    int count = 0;
    for (rt::TaskId t = 0; t < step.graph().size(); ++t)
      if (step.graph().tasks().name(t).find("cp_ring_kv") != std::string_view::npos) ++count;
    return count;
  };
  EXPECT_EQ(ring_steps(kept), 0);
  EXPECT_EQ(ring_steps(sent), keep.devices() * layers * (cp - 1));
}

}  // namespace
}  // namespace weave::graphs
