// The calls that take every rank's buffers at once: each builds the whole collective and issues
// it through a matcher, checked and planned before any task is added.
#include "weave/devices/communicator.hpp"

#include <fmt/format.h>

#include <stdexcept>

#include "weave/devices/collective_matcher.hpp"

namespace weave::devices {

namespace {

void check_count(CollectiveOp op, const ProcessGroup& g, std::size_t given, const char* what) {
  if (given != static_cast<std::size_t>(g.size()))
    throw std::invalid_argument(
        fmt::format("{} over group '{}' of {} ranks got {} {}: pass one per rank, in rank order",
                    to_string(op), g.name(), g.size(), given, what));
}

Collective whole(CollectiveOp op, const ProcessGroup& group) {
  return {.call = {.op = op},
          .group = group,
          .members = std::vector<CollectiveMember>(static_cast<std::size_t>(group.size()))};
}

// A collective whose members each read an input and write an output.
Collective with_inputs_and_outputs(CollectiveOp op, const ProcessGroup& group,
                                   std::span<const std::span<const float>> inputs,
                                   std::span<const std::span<float>> outputs) {
  check_count(op, group, inputs.size(), "inputs");
  check_count(op, group, outputs.size(), "outputs");
  Collective c = whole(op, group);
  for (std::size_t r = 0; r < inputs.size(); ++r)
    c.members[r] = {.input = inputs[r], .output = outputs[r]};
  return c;
}

}  // namespace

ProcessSet& Communicator::processes() {
  static ProcessSet one;
  return one;
}

Communicator::MemberTasks Communicator::issue_whole(rt::GraphBuilder& graph, Collective c,
                                                    const CollectiveOptions& options) {
  CollectiveMatcher matcher(graph, *this);
  return matcher.issue_whole(std::move(c), options);
}

Communicator::MemberTasks Communicator::all_reduce(rt::GraphBuilder& graph,
                                                   const ProcessGroup& group,
                                                   std::span<const std::span<float>> buffers,
                                                   ReduceOp op, const CollectiveOptions& options) {
  check_count(CollectiveOp::all_reduce, group, buffers.size(), "buffers");
  Collective c = whole(CollectiveOp::all_reduce, group);
  c.call.reduce = op;
  for (std::size_t r = 0; r < buffers.size(); ++r)
    c.members[r].output = buffers[r];
  return issue_whole(graph, std::move(c), options);
}

Communicator::MemberTasks Communicator::all_gather(rt::GraphBuilder& graph,
                                                   const ProcessGroup& group,
                                                   std::span<const std::span<const float>> inputs,
                                                   std::span<const std::span<float>> outputs,
                                                   const CollectiveOptions& options) {
  return issue_whole(
      graph, with_inputs_and_outputs(CollectiveOp::all_gather, group, inputs, outputs), options);
}

Communicator::MemberTasks Communicator::reduce_scatter(
    rt::GraphBuilder& graph, const ProcessGroup& group,
    std::span<const std::span<const float>> inputs, std::span<const std::span<float>> outputs,
    ReduceOp op, const CollectiveOptions& options) {
  Collective c = with_inputs_and_outputs(CollectiveOp::reduce_scatter, group, inputs, outputs);
  c.call.reduce = op;
  return issue_whole(graph, std::move(c), options);
}

Communicator::MemberTasks Communicator::all_to_all(rt::GraphBuilder& graph,
                                                   const ProcessGroup& group,
                                                   std::span<const std::span<const float>> inputs,
                                                   std::span<const std::span<float>> outputs,
                                                   const CollectiveOptions& options) {
  return issue_whole(
      graph, with_inputs_and_outputs(CollectiveOp::all_to_all, group, inputs, outputs), options);
}

Communicator::MemberTasks Communicator::all_to_all_v(
    rt::GraphBuilder& graph, const ProcessGroup& group,
    std::span<const VariableAllToAllBuffers> buffers, std::int64_t row_elements,
    const CollectiveOptions& options) {
  check_count(CollectiveOp::all_to_all_v, group, buffers.size(), "buffers");
  Collective c = whole(CollectiveOp::all_to_all_v, group);
  c.call.row_elements = row_elements;
  for (std::size_t r = 0; r < buffers.size(); ++r)
    c.members[r].variable = buffers[r];
  return issue_whole(graph, std::move(c), options);
}

Communicator::MemberTasks Communicator::all_gather_v(rt::GraphBuilder& graph,
                                                     const ProcessGroup& group,
                                                     std::span<const VariableGatherBuffers> buffers,
                                                     std::int64_t row_elements,
                                                     const CollectiveOptions& options) {
  check_count(CollectiveOp::all_gather_v, group, buffers.size(), "buffers");
  Collective c = whole(CollectiveOp::all_gather_v, group);
  c.call.row_elements = row_elements;
  for (std::size_t r = 0; r < buffers.size(); ++r)
    c.members[r].gather = buffers[r];
  return issue_whole(graph, std::move(c), options);
}

Communicator::MemberTasks Communicator::reduce_scatter_v(
    rt::GraphBuilder& graph, const ProcessGroup& group,
    std::span<const VariableScatterBuffers> buffers, std::int64_t row_elements,
    const CollectiveOptions& options) {
  check_count(CollectiveOp::reduce_scatter_v, group, buffers.size(), "buffers");
  Collective c = whole(CollectiveOp::reduce_scatter_v, group);
  c.call.row_elements = row_elements;
  for (std::size_t r = 0; r < buffers.size(); ++r)
    c.members[r].scatter = buffers[r];
  return issue_whole(graph, std::move(c), options);
}

Communicator::MemberTasks Communicator::broadcast(rt::GraphBuilder& graph,
                                                  const ProcessGroup& group,
                                                  std::span<const std::span<float>> buffers,
                                                  int root, const CollectiveOptions& options) {
  check_count(CollectiveOp::broadcast, group, buffers.size(), "buffers");
  Collective c = whole(CollectiveOp::broadcast, group);
  c.call.root = root;
  for (std::size_t r = 0; r < buffers.size(); ++r)
    c.members[r].output = buffers[r];
  return issue_whole(graph, std::move(c), options);
}

std::pair<rt::TaskId, rt::TaskId> Communicator::send_recv(rt::GraphBuilder& graph,
                                                          rt::DeviceId from,
                                                          std::span<const float> data,
                                                          rt::DeviceId to, std::span<float> into,
                                                          const CollectiveOptions& options) {
  if (from == to)
    throw std::invalid_argument(fmt::format(
        "send_recv from device {} to itself: a transfer needs two devices; copy within the "
        "device instead",
        from));
  Collective c =
      whole(CollectiveOp::send_recv, ProcessGroup(fmt::format("{}->{}", from, to), {from, to}));
  c.members[0].input = data;
  c.members[1].output = into;
  const MemberTasks ids = issue_whole(graph, std::move(c), options);
  return {ids[0], ids[1]};
}

Communicator::MemberTasks Communicator::barrier(rt::GraphBuilder& graph, const ProcessGroup& group,
                                                const CollectiveOptions& options) {
  return issue_whole(graph, whole(CollectiveOp::barrier, group), options);
}

}  // namespace weave::devices
