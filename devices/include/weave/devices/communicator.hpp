// Collectives as graph tasks: the interface every backend implements.
//
// A call adds one task per rank of the group to a graph, on each member device's comm stream
// (kind comm), and returns their ids by rank so callers order them against compute with
// precede() or events. The tasks rendezvous: their transfer runs once every member is ready,
// and every member completes when the whole transfer is done (held further by the link model
// when the executor has one). Nothing blocks a worker thread while members are missing. Each
// member task carries the bytes that rank would send in a ring (NCCL-style) algorithm as its
// cost hint, so the link model and the virtual clock cost it like an accelerator collective.
//
// Buffers are given per rank, in rank order. The in-process backend runs every rank and needs
// every rank's buffers; a multi-process backend (MPI) runs only the ranks its process holds and
// reads only their entries, the others may be empty, so callers are written once for both.
// Buffers must stay valid while the graph may run; inputs and outputs of one call must not
// overlap, except where an operation says so. Sizes known when the graph is built are checked
// then (std::invalid_argument naming the rule, the ranks and the sizes); run-time sizes (the
// variable all-to-all's counts) are checked by the tasks, whose error cancels the run and
// reaches the caller as rt::TaskError naming the task.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "weave/devices/process_group.hpp"
#include "weave/runtime/graph.hpp"

namespace weave::devices {

enum class ReduceOp { sum, max };

struct CollectiveOptions {
  std::string_view name;             // tasks are "<name>[rank]"; empty: "<op>:<group>"
  rt::TaskTags tags;                 // copied to every member task
  std::string_view stream = "comm";  // the member devices' stream the tasks run on
};

// One rank's side of an all-to-all whose split sizes are known only at run time (MoE dispatch).
// Counts are in rows of `row_elements` floats. An earlier task of the graph fills *send_counts
// with one entry per rank: the rows for each destination, stored in `send` grouped by
// destination in rank order. The collective writes recv_counts (one entry per rank, checked
// when the graph is built): the rows received from each source, stored in `recv` in rank order.
// send and recv are capacities; the task fails if the counts need more.
struct VariableAllToAllBuffers {
  std::span<const float> send;
  const std::vector<std::int64_t>* send_counts = nullptr;
  std::span<float> recv;
  std::span<std::int64_t> recv_counts;
  // The rows this member expects to send in all, for the cost hint a replay without kernels
  // uses (0: its whole send buffer). Once run, a member is timed by its real split.
  std::int64_t expected_rows = 0;
};

class Communicator {
 public:
  using MemberTasks = std::vector<rt::TaskId>;  // by rank

  virtual ~Communicator() = default;

  // In place: every rank's buffer (equal sizes) ends holding the element-wise reduction over
  // ranks, reduced in rank order so every rank and every run gets the same bits.
  virtual MemberTasks all_reduce(rt::GraphBuilder& graph, const ProcessGroup& group,
                                 std::span<const std::span<float>> buffers, ReduceOp op,
                                 const CollectiveOptions& options = {}) = 0;
  // outputs[r] (size n * m) = inputs[0] ++ inputs[1] ++ ... (each of size m). inputs[r] may be
  // block r of outputs[r] (in place).
  virtual MemberTasks all_gather(rt::GraphBuilder& graph, const ProcessGroup& group,
                                 std::span<const std::span<const float>> inputs,
                                 std::span<const std::span<float>> outputs,
                                 const CollectiveOptions& options = {}) = 0;
  // outputs[r] (size m) = the reduction over ranks, in rank order, of block r of inputs (size
  // n * m). outputs[r] may be block r of inputs[r] (in place).
  virtual MemberTasks reduce_scatter(rt::GraphBuilder& graph, const ProcessGroup& group,
                                     std::span<const std::span<const float>> inputs,
                                     std::span<const std::span<float>> outputs, ReduceOp op,
                                     const CollectiveOptions& options = {}) = 0;
  // Equal splits: block j of inputs[r] goes to block r of outputs[j] (sizes n * m everywhere).
  virtual MemberTasks all_to_all(rt::GraphBuilder& graph, const ProcessGroup& group,
                                 std::span<const std::span<const float>> inputs,
                                 std::span<const std::span<float>> outputs,
                                 const CollectiveOptions& options = {}) = 0;
  // Run-time splits, in rows of row_elements floats.
  virtual MemberTasks all_to_all_v(rt::GraphBuilder& graph, const ProcessGroup& group,
                                   std::span<const VariableAllToAllBuffers> buffers,
                                   std::int64_t row_elements,
                                   const CollectiveOptions& options = {}) = 0;
  // Every rank's buffer (equal sizes) ends holding the root rank's.
  virtual MemberTasks broadcast(rt::GraphBuilder& graph, const ProcessGroup& group,
                                std::span<const std::span<float>> buffers, int root,
                                const CollectiveOptions& options = {}) = 0;
  // Point to point, a two-member rendezvous: `to` receives `from`'s data (equal sizes).
  // Returns {send task, receive task}.
  virtual std::pair<rt::TaskId, rt::TaskId> send_recv(rt::GraphBuilder& graph, rt::DeviceId from,
                                                      std::span<const float> data, rt::DeviceId to,
                                                      std::span<float> into,
                                                      const CollectiveOptions& options = {}) = 0;
  // No data: every member completes once all have arrived.
  virtual MemberTasks barrier(rt::GraphBuilder& graph, const ProcessGroup& group,
                              const CollectiveOptions& options = {}) = 0;
};

}  // namespace weave::devices
