// The in-process backend: every device shares the host's memory, so a collective is a set of
// copies and reductions split among its members, each done by the member's own task on its
// own device's cores once the rendezvous has started them all. Member r of an all-reduce
// reduces the r-th share of every rank's buffer in rank order and writes it to every rank, so
// each byte is read and written once; a reduce-scatter member reduces its own block; gathers
// and all-to-alls copy what their member receives (or, for all-gather, sends). Collectives
// too large to stay cached write with streaming stores.
#pragma once

#include "weave/devices/communicator.hpp"

namespace weave::devices {

class SharedMemoryCommunicator final : public Communicator {
 public:
  MemberTasks all_reduce(rt::GraphBuilder& graph, const ProcessGroup& group,
                         std::span<const std::span<float>> buffers, ReduceOp op,
                         const CollectiveOptions& options = {}) override;
  MemberTasks all_gather(rt::GraphBuilder& graph, const ProcessGroup& group,
                         std::span<const std::span<const float>> inputs,
                         std::span<const std::span<float>> outputs,
                         const CollectiveOptions& options = {}) override;
  MemberTasks reduce_scatter(rt::GraphBuilder& graph, const ProcessGroup& group,
                             std::span<const std::span<const float>> inputs,
                             std::span<const std::span<float>> outputs, ReduceOp op,
                             const CollectiveOptions& options = {}) override;
  MemberTasks all_to_all(rt::GraphBuilder& graph, const ProcessGroup& group,
                         std::span<const std::span<const float>> inputs,
                         std::span<const std::span<float>> outputs,
                         const CollectiveOptions& options = {}) override;
  MemberTasks all_to_all_v(rt::GraphBuilder& graph, const ProcessGroup& group,
                           std::span<const VariableAllToAllBuffers> buffers,
                           std::int64_t row_elements,
                           const CollectiveOptions& options = {}) override;
  MemberTasks broadcast(rt::GraphBuilder& graph, const ProcessGroup& group,
                        std::span<const std::span<float>> buffers, int root,
                        const CollectiveOptions& options = {}) override;
  std::pair<rt::TaskId, rt::TaskId> send_recv(rt::GraphBuilder& graph, rt::DeviceId from,
                                              std::span<const float> data, rt::DeviceId to,
                                              std::span<float> into,
                                              const CollectiveOptions& options = {}) override;
  MemberTasks barrier(rt::GraphBuilder& graph, const ProcessGroup& group,
                      const CollectiveOptions& options = {}) override;
};

}  // namespace weave::devices
