// Collectives as graph tasks: the interface every backend implements.
//
// A collective adds one task per rank of the group to a graph, on each member device's stream
// (kind comm, "comm" unless the options name another), and returns their ids by rank so callers
// order them against compute with precede() or events. The tasks rendezvous: their transfer
// runs once every member is ready, and every member completes when the whole transfer is done
// (held further by the link model when the executor has one). Nothing blocks a worker thread
// while members are missing. Each member task carries the bytes that rank would send in a ring
// (NCCL-style) algorithm as its cost hint, so the link model and the virtual clock cost it like
// an accelerator collective.
//
// Two ways to issue one. A program written for one rank issues its own side through a
// CollectiveMatcher, which matches the members of each group by issue order, as NCCL and MPI
// do. The calls below take every rank's buffers at once (in rank order) and issue every member
// in turn. A backend implements plan(): given the members' buffers, the work each member's task
// does. The in-process backend runs every rank and needs every rank's buffers; a multi-process
// backend (MPI) runs only the ranks its process holds: it says which devices it holds
// (holds()), members of other processes never issue here, and plan() gets the buffers of the
// members this process holds only (the others' are empty).
//
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

#include "weave/devices/collective.hpp"
#include "weave/devices/process_group.hpp"
#include "weave/devices/process_set.hpp"
#include "weave/runtime/graph.hpp"

namespace weave::devices {

struct CollectiveOptions {
  std::string_view name;             // tasks are "<name>[rank]"; empty: "<op>:<group>"
  rt::TaskTags tags;                 // copied to every member task
  std::string_view stream = "comm";  // the member devices' stream the tasks run on
  // The stream's kind, given when the stream is first made (rt::StreamKind): what the caller
  // classifies it as, such as the process group it serves.
  rt::StreamKind stream_kind = rt::kUnclassifiedStream;
  // Bytes each element would move on the link, for the cost hints: the buffers hold fp32, a
  // prediction of a 16-bit run moves 2 bytes an element.
  std::size_t element_bytes = sizeof(float);
};

class Communicator {
 public:
  // By rank; rt::kNoTask for the members of devices this process does not hold.
  using MemberTasks = std::vector<rt::TaskId>;

  virtual ~Communicator() = default;

  // The backend's part: checks the members' buffers against each other (std::invalid_argument
  // naming the rule, the ranks and the sizes) and returns the work of each member's task.
  virtual MemberWork plan(const Collective& collective) = 0;

  // Whether this process holds `device` (runs its tasks). The in-process backend holds every
  // device; a multi-process one only those of its process. Collectives meet the members this
  // process holds here and reach the others through the backend.
  virtual bool holds(rt::DeviceId device) const {
    (void)device;
    return true;
  }
  // Every collective of the graph being built has been planned (CollectiveMatcher::finish calls
  // it; after the calls below, call it yourself before running the graph). A multi-process
  // backend agrees with the other processes on the collectives they share, so every process
  // must call it at the same point of its build; the in-process backend has nothing to do.
  virtual void commit() {}
  // The processes this backend spans: one for the in-process backend.
  virtual ProcessSet& processes();

  // In place: every rank's buffer (equal sizes) ends holding the element-wise reduction over
  // ranks, reduced in rank order so every rank and every run gets the same bits.
  MemberTasks all_reduce(rt::GraphBuilder& graph, const ProcessGroup& group,
                         std::span<const std::span<float>> buffers, ReduceOp op,
                         const CollectiveOptions& options = {});
  // outputs[r] (size n * m) = inputs[0] ++ inputs[1] ++ ... (each of size m). inputs[r] may be
  // block r of outputs[r] (in place).
  MemberTasks all_gather(rt::GraphBuilder& graph, const ProcessGroup& group,
                         std::span<const std::span<const float>> inputs,
                         std::span<const std::span<float>> outputs,
                         const CollectiveOptions& options = {});
  // outputs[r] (size m) = the reduction over ranks, in rank order, of block r of inputs (size
  // n * m). outputs[r] may be block r of inputs[r] (in place).
  MemberTasks reduce_scatter(rt::GraphBuilder& graph, const ProcessGroup& group,
                             std::span<const std::span<const float>> inputs,
                             std::span<const std::span<float>> outputs, ReduceOp op,
                             const CollectiveOptions& options = {});
  // Equal splits: block j of inputs[r] goes to block r of outputs[j] (sizes n * m everywhere).
  MemberTasks all_to_all(rt::GraphBuilder& graph, const ProcessGroup& group,
                         std::span<const std::span<const float>> inputs,
                         std::span<const std::span<float>> outputs,
                         const CollectiveOptions& options = {});
  // Run-time splits, in rows of row_elements floats.
  MemberTasks all_to_all_v(rt::GraphBuilder& graph, const ProcessGroup& group,
                           std::span<const VariableAllToAllBuffers> buffers,
                           std::int64_t row_elements, const CollectiveOptions& options = {});
  // Run-time block sizes, in rows of row_elements floats: every rank's rows gathered (in rank
  // order) on every rank; every rank's block of the others' buffers summed into it.
  MemberTasks all_gather_v(rt::GraphBuilder& graph, const ProcessGroup& group,
                           std::span<const VariableGatherBuffers> buffers,
                           std::int64_t row_elements, const CollectiveOptions& options = {});
  MemberTasks reduce_scatter_v(rt::GraphBuilder& graph, const ProcessGroup& group,
                               std::span<const VariableScatterBuffers> buffers,
                               std::int64_t row_elements, const CollectiveOptions& options = {});
  // Every rank's buffer (equal sizes) ends holding the root rank's.
  MemberTasks broadcast(rt::GraphBuilder& graph, const ProcessGroup& group,
                        std::span<const std::span<float>> buffers, int root,
                        const CollectiveOptions& options = {});
  // Point to point, a two-member rendezvous: `to` receives `from`'s data (equal sizes).
  // Returns {send task, receive task}.
  std::pair<rt::TaskId, rt::TaskId> send_recv(rt::GraphBuilder& graph, rt::DeviceId from,
                                              std::span<const float> data, rt::DeviceId to,
                                              std::span<float> into,
                                              const CollectiveOptions& options = {});
  // No data: every member completes once all have arrived.
  MemberTasks barrier(rt::GraphBuilder& graph, const ProcessGroup& group,
                      const CollectiveOptions& options = {});

 private:
  // Checks and plans `c` before anything is added, then adds the members this process holds
  // (the others' ids are rt::kNoTask).
  MemberTasks issue_whole(rt::GraphBuilder& graph, Collective c, const CollectiveOptions& options);
};

}  // namespace weave::devices
