// The activations Ampipe's tp-sp overlap (--ampipe-tp-sp-comm-overlap, split experts as items)
// keeps beside what Ampipe without it keeps, as a closed form of the buffers' shapes: every item
// its own rows of the all-to-alls and the tp gathers (sized for the most rows an item can carry,
// one pick per token of every source), the items' hidden layers and their gradients as rows of
// the slot's (the most rows the slot can receive, as without items), where without items the
// slot keeps its own all-to-all and tp buffers.
#include <gtest/gtest.h>

#include <cstdint>

#include "tiny_model.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/training_step.hpp"

namespace weave::graphs {
namespace {

// One MoE layer of 4 experts (top-2, dropless) split over tp 2, 2 per expert-parallel rank, in
// 2 Ampipe chunks, over 2 data-parallel replicas; the step built without tensors (4 bytes a value).
std::int64_t activation_bytes(bool overlap) {
  ModelConfig m = tiny(4);
  m.num_layers = 1;
  m.moe_layer_freq = 1;
  ParallelPlan plan{.tensor_parallel = 2,
                    .expert_parallel = 2,
                    .expert_tensor_parallel = 2,
                    .data_parallel = 2,
                    .micro_batch_size = 1,
                    .global_batch_size = 2,
                    .ampipe_degree = 2,
                    .ampipe_tp_sp_comm_overlap = overlap};
  validate(m, plan);
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  const TrainingStep step(m, plan, {}, set, comm, {.materialize = false});
  return set.memory().current(0, rt::MemoryCategory::activations);
}

TEST(AmpipeOverlapMemory, ItemsKeepTheirOwnCollectiveRowsAndShareTheSlotsHiddenLayer) {
  const std::int64_t h = 32, tp = 2, ep = 2, k = 2, local = 2, slots = 2;
  const std::int64_t f = 64 / tp, f1 = f;  // each tp rank's share of an expert (GeLU)
  // Without SP each tp rank routes its slice of a chunk: 16 tokens / (tp x chunks).
  const std::int64_t n = 16 / (tp * slots), picks = n * k;
  const std::int64_t capacity = ep * picks;       // the rows a slot can receive (dropless)
  const std::int64_t in = ep * n, run = tp * in;  // an item: one pick per token of every source
  const std::int64_t headers = 1;                 // a row of counts per source
  // Both: the slot's picks' outputs and gradients, its hidden layer before and after the
  // activation over every tp rank's rows.
  const std::int64_t shared = 3 * picks * h + tp * capacity * (f1 + f);
  const std::int64_t item = (picks + ep) * h + (in + ep) * h  // dispatch sent, received
                            + 2 * in * h                      // this rank's rows, their result
                            + 3 * picks * h  // results home; their gradients, both ways
                            + 2 * in * h     // gradients received, sent back
                            + 3 * run * h;   // gathered rows, partial sums, gathered gradients
  const std::int64_t with_items = shared + local * item + tp * capacity * (f + f1);
  const std::int64_t without_items =
      shared + (picks + ep * headers) * h                 // the framed dispatch
      + (capacity + ep * headers) * h + 3 * capacity * h  // all-to-alls' rows
      + 4 * capacity * h                                  // regrouped rows, results, gradients
      + (headers + capacity) * h + tp * (headers + capacity) * h  // tp gather, framed
      + tp * capacity * h + 2 * capacity * h                      // partial sums, reduced, d rows
      + tp * capacity * h + capacity * h;                         // gathered gradients, reduced
  // Without items each slot keeps the counts of rows per source and local expert too: ep x
  // local values in a storage of 64 bytes (a tensor's storage is a whole number of cache lines).
  const std::int64_t counts_bytes = 64;
  static_assert(4 * ep * local <= counts_bytes);
  EXPECT_EQ(activation_bytes(true) - activation_bytes(false),
            slots * (4 * (with_items - without_items) - counts_bytes));
}

}  // namespace
}  // namespace weave::graphs
