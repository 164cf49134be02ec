// A collective as a backend sees it: the operation, the group and every member's buffers, known
// once the last member has issued its side (see CollectiveMatcher). The backend turns it into
// the work each member's task does; the graph wiring (tasks, streams, rendezvous, cost hints) is
// the matcher's, the same for every backend.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weave/devices/process_group.hpp"
#include "weave/runtime/task_context.hpp"

namespace weave::devices {

enum class ReduceOp { sum, max };

enum class CollectiveOp : std::uint8_t {
  all_reduce,
  all_gather,
  reduce_scatter,
  all_to_all,
  all_to_all_v,
  all_gather_v,
  reduce_scatter_v,
  broadcast,
  send_recv,
  barrier,
};
std::string_view to_string(CollectiveOp op);

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

// One rank's side of an all-gather whose blocks' sizes are known only at run time (the rows
// each tensor-parallel rank of an expert received). Sizes are in rows of `row_elements` floats.
// An earlier task sets *send_rows; the collective writes recv_rows (one entry per rank, checked
// when the graph is built): block j, rank j's rows, lands in `recv` after the blocks of the
// ranks before it. send and recv are capacities; the task fails if the counts need more.
struct VariableGatherBuffers {
  std::span<const float> send;
  const std::int64_t* send_rows = nullptr;
  std::span<float> recv;
  std::span<std::int64_t> recv_rows;
  // The rows this member expects to send, for the cost hint a replay without kernels uses
  // (0: its whole send buffer). Once run, a member is timed by the real sizes.
  std::int64_t expected_rows = 0;
};

// One rank's side of a reduce-scatter whose blocks' sizes are known only at run time: `send`
// holds every rank's block in rank order, (*rows)[j] rows for rank j; the member receives the
// reduction over the ranks, in rank order, of its own block into `recv` (which may be that
// block of its own `send`). Every member's *rows must hold the same counts when it runs.
struct VariableScatterBuffers {
  std::span<const float> send;
  const std::vector<std::int64_t>* rows = nullptr;
  std::span<float> recv;
  std::int64_t expected_rows = 0;  // rows of its own block expected (cost hint); 0: recv's size
};

// One member's buffers. all_reduce and broadcast work in place on `output`; all_gather,
// reduce_scatter and all_to_all read `input` and write `output`; all_to_all_v uses `variable`,
// all_gather_v `gather` and reduce_scatter_v `scatter`;
// send_recv's sender (member 0) reads `input` and its receiver (member 1) writes `output`;
// barrier has none.
struct CollectiveMember {
  std::span<const float> input;
  std::span<float> output;
  VariableAllToAllBuffers variable;
  VariableGatherBuffers gather;
  VariableScatterBuffers scatter;
};

// What a member issues besides its buffers: the op and the parameters some ops take. The members
// of one collective issue the same call.
struct CollectiveCall {
  CollectiveOp op = CollectiveOp::barrier;
  ReduceOp reduce = ReduceOp::sum;  // all_reduce, reduce_scatter
  int root = 0;                     // broadcast: the root's rank in the group
  std::int64_t row_elements = 0;    // all_to_all_v, all_gather_v, reduce_scatter_v

  friend bool operator==(const CollectiveCall&, const CollectiveCall&) = default;
};

struct Collective {
  CollectiveCall call;  // the op and its parameters, as every member issued them
  ProcessGroup group;
  std::vector<CollectiveMember> members;  // by rank in the group
  std::string name;                       // the member tasks' name prefix
};

// Member r's share of a collective's transfer, run by member r's task once every member has
// arrived (the rendezvous). Empty: the members only meet.
using MemberWork = std::function<void(int member, rt::TaskContext& context)>;

// What one member's task costs the link model and the virtual clock: the bytes that member
// moves in the ring (NCCL-style) algorithm for its op, and the latency terms it pays, from its
// own buffers and the group's size alone (a member's cost is known when it issues). The hint also
// names the op's transfer pattern, its payload and where the group's devices are, for a cost
// model that prices the algorithm by the links the group spans (devices::Cluster). Bytes count
// `element_bytes` a value (CollectiveOptions::element_bytes: 2 in a 16-bit prediction).
rt::CostHint member_cost(CollectiveOp op, const ProcessGroup& group, int member, int root,
                         const CollectiveMember& buffers, std::int64_t row_elements,
                         std::size_t element_bytes);

}  // namespace weave::devices
