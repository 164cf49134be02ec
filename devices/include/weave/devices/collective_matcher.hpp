// Collectives issued one member at a time, as a program written for one rank issues them.
//
// Each call adds the calling member's task at once (on its device and the options' stream, kind
// comm, named "<name>[<rank in group>]", its cost hint from its own buffers), so the caller can
// order it against its other tasks right away. Members of a group are matched by issue order:
// the k-th collective a member issues over a group meets the k-th of every other member, as
// NCCL and MPI match them. When the last member has issued, the members' buffers go to the
// backend (Communicator::plan), whose work their tasks then run, and the rendezvous is made.
// Point-to-point transfers match a send with the receive of the same (from, to) pair, in order.
//
// A process may build only some ranks (the others run elsewhere). With a backend that holds
// every device (the in-process one) their members never issue here and finish() says which
// collectives stay open. With a multi-process backend (Communicator::holds) a collective is
// complete here once the members this process holds have issued: the backend plans it with
// their buffers and reaches the other processes' members itself; a member of a device this
// process does not hold is refused.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "weave/devices/communicator.hpp"

namespace weave::devices {

class CollectiveMatcher {
 public:
  CollectiveMatcher(rt::GraphBuilder& graph, Communicator& backend);
  ~CollectiveMatcher();
  CollectiveMatcher(const CollectiveMatcher&) = delete;
  CollectiveMatcher& operator=(const CollectiveMatcher&) = delete;

  // Member `member` (its rank in `group`) issues its side of `call`, with the buffers its op
  // uses (see CollectiveMember), and gets its task. Every op is issued so; the calls below are
  // this one with their op's buffers, which mean what they mean in Communicator's calls of the
  // same name.
  rt::TaskId issue(const CollectiveCall& call, const ProcessGroup& group, int member,
                   const CollectiveMember& buffers, const CollectiveOptions& options = {});

  rt::TaskId all_reduce(const ProcessGroup& group, int member, std::span<float> buffer, ReduceOp op,
                        const CollectiveOptions& options = {});
  rt::TaskId all_gather(const ProcessGroup& group, int member, std::span<const float> input,
                        std::span<float> output, const CollectiveOptions& options = {});
  rt::TaskId reduce_scatter(const ProcessGroup& group, int member, std::span<const float> input,
                            std::span<float> output, ReduceOp op,
                            const CollectiveOptions& options = {});
  rt::TaskId all_to_all(const ProcessGroup& group, int member, std::span<const float> input,
                        std::span<float> output, const CollectiveOptions& options = {});
  rt::TaskId all_to_all_v(const ProcessGroup& group, int member,
                          const VariableAllToAllBuffers& buffers, std::int64_t row_elements,
                          const CollectiveOptions& options = {});
  rt::TaskId all_gather_v(const ProcessGroup& group, int member,
                          const VariableGatherBuffers& buffers, std::int64_t row_elements,
                          const CollectiveOptions& options = {});
  rt::TaskId reduce_scatter_v(const ProcessGroup& group, int member,
                              const VariableScatterBuffers& buffers, std::int64_t row_elements,
                              const CollectiveOptions& options = {});
  rt::TaskId broadcast(const ProcessGroup& group, int member, std::span<float> buffer, int root,
                       const CollectiveOptions& options = {});
  rt::TaskId barrier(const ProcessGroup& group, int member, const CollectiveOptions& options = {});
  // The two ends of a transfer from device `from` to device `to` (equal sizes), each issued by
  // its own side.
  rt::TaskId send(rt::DeviceId from, rt::DeviceId to, std::span<const float> data,
                  const CollectiveOptions& options = {});
  rt::TaskId receive(rt::DeviceId from, rt::DeviceId to, std::span<float> into,
                     const CollectiveOptions& options = {});

  // Adds every member of `collective` at once (its members' buffers all given), its work
  // planned first, so a refused collective adds nothing.
  Communicator::MemberTasks issue_whole(Collective collective, const CollectiveOptions& options);

  // Collectives some member has issued and others have not, one line each (group, operation,
  // name, the members that issued). Empty when every collective is complete.
  std::vector<std::string> open_collectives() const;
  // Throws std::logic_error listing the open collectives, if any: every member of a group must
  // issue the same collectives in the same order. Then commits the backend
  // (Communicator::commit): with a multi-process backend every process calls it at the same
  // point of its build.
  void finish() const;

 private:
  struct Pending;
  void complete(Pending& pending);

  rt::GraphBuilder& graph_;
  Communicator& backend_;
  // By group (name and devices) and per-group sequence number.
  std::map<std::pair<std::string, std::uint64_t>, std::unique_ptr<Pending>> pending_;
  // Collectives each (group, member) has issued so far.
  std::map<std::pair<std::string, int>, std::uint64_t> issued_;
};

}  // namespace weave::devices
