#include "weave/devices/collective_matcher.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <stdexcept>

#include "collective_ops.hpp"

namespace weave::devices {

// A collective some members have issued: their tasks exist; the work is bound when the last
// member issues.
struct CollectiveMatcher::Pending {
  explicit Pending(Collective c) : collective(std::move(c)) {}
  Collective collective;
  std::vector<rt::TaskId> tasks;  // by member; kNoTask until it issues
  std::vector<bool> issued;
  int count = 0;
  int expected = 0;  // the members this process holds: the others issue in their own process
  // Shared with the member tasks, which run it; empty until the collective is complete.
  std::shared_ptr<MemberWork> work = std::make_shared<MemberWork>();
  std::shared_ptr<bool> complete = std::make_shared<bool>(false);
};

namespace {

// Groups are told apart by name and devices: two groups of one name are different groups. An
// evenly spaced group (every group of a mesh) is named by its first device, stride and size,
// which its devices determine, so the key stays short for groups of thousands of devices.
std::string group_key(const ProcessGroup& group) {
  if (group.device_stride() != 0)
    return fmt::format("{}({}+{}x{})", group.name(), group.device(0), group.device_stride(),
                       group.size());
  return fmt::format("{}({})", group.name(), fmt::join(group.devices(), ","));
}

// The members of `group` whose devices this process holds.
int held_members(const Communicator& backend, const ProcessGroup& group) {
  int held = 0;
  for (int r = 0; r < group.size(); ++r)
    held += backend.holds(group.device(r)) ? 1 : 0;
  return held;
}

std::vector<rt::TaskId> issued_tasks(const std::vector<rt::TaskId>& tasks) {
  std::vector<rt::TaskId> out;
  for (rt::TaskId t : tasks)
    if (t != rt::kNoTask) out.push_back(t);
  return out;
}

// Every op indexes the op table and the backends' tables: a value outside the enum is refused
// before it reaches them.
void check_op(CollectiveOp op, const ProcessGroup& group) {
  if (static_cast<std::size_t>(op) >= detail::kCollectiveOpCount)
    throw std::invalid_argument(fmt::format(
        "collective over group '{}' issued op {}, which is not a CollectiveOp (there are {}): "
        "issue one of CollectiveOp's values",
        group.name(), static_cast<int>(op), detail::kCollectiveOpCount));
}

std::string task_prefix(CollectiveOp op, const ProcessGroup& group,
                        const CollectiveOptions& options) {
  return options.name.empty() ? fmt::format("{}:{}", to_string(op), group.name())
                              : std::string(options.name);
}

}  // namespace

CollectiveMatcher::CollectiveMatcher(rt::GraphBuilder& graph, Communicator& backend)
    : graph_(graph), backend_(backend) {}

CollectiveMatcher::~CollectiveMatcher() = default;

rt::TaskId CollectiveMatcher::issue(const CollectiveCall& call, const ProcessGroup& group,
                                    int member, const CollectiveMember& buffers,
                                    const CollectiveOptions& options) {
  const CollectiveOp op = call.op;
  check_op(op, group);
  const int n = group.size();
  if (member < 0 || member >= n)
    throw std::invalid_argument(
        fmt::format("{} over group '{}' of {} ranks issued by member {}: a member is its rank "
                    "in the group, in [0, {})",
                    to_string(op), group.name(), n, member, n));
  if (!backend_.holds(group.device(member)))
    throw std::invalid_argument(fmt::format(
        "{} over group '{}': member {} is device {}, which this process does not hold; each "
        "process issues the members of its own devices only",
        to_string(op), group.name(), member, group.device(member)));
  const std::string key = group_key(group);
  const std::uint64_t sequence = issued_[{key, member}]++;
  auto& slot = pending_[{key, sequence}];
  const std::string prefix = task_prefix(op, group, options);
  if (!slot) {
    slot = std::make_unique<Pending>(
        Collective{.call = call,
                   .group = group,
                   .members = std::vector<CollectiveMember>(static_cast<std::size_t>(n)),
                   .name = prefix});
    slot->tasks.assign(static_cast<std::size_t>(n), rt::kNoTask);
    slot->issued.assign(static_cast<std::size_t>(n), false);
    slot->expected = held_members(backend_, group);
  }
  Pending& p = *slot;
  const Collective& c = p.collective;
  if (c.call != call || c.name != prefix)
    throw std::invalid_argument(fmt::format(
        "collective {} over group '{}': member {} issued {} '{}' where another member issued {} "
        "'{}'; every member of a group must issue the same collectives in the same order",
        sequence, group.name(), member, to_string(op), prefix, to_string(c.call.op), c.name));
  p.collective.members[static_cast<std::size_t>(member)] = buffers;
  const rt::TaskId task = graph_.add(
      {.device = group.device(member),
       .stream = graph_.stream(options.stream, options.stream_kind),
       .kind = rt::TaskKind::comm,
       .name = fmt::format("{}[{}]", prefix, member),
       .tags = options.tags,
       .cost = member_cost(op, group, member, call.root, buffers, call.row_elements,
                           options.element_bytes)},
      [work = p.work, complete = p.complete, member, name = prefix](rt::TaskContext& context) {
        if (!*complete)
          throw std::logic_error(fmt::format(
              "collective '{}' runs with members that were never issued in this graph", name));
        if (*work) (*work)(member, context);
      });
  p.tasks[static_cast<std::size_t>(member)] = task;
  p.issued[static_cast<std::size_t>(member)] = true;
  if (++p.count == p.expected) {
    complete(p);
    pending_.erase({key, sequence});
  }
  return task;
}

void CollectiveMatcher::complete(Pending& p) {
  *p.work = backend_.plan(p.collective);
  *p.complete = true;
  graph_.rendezvous(p.collective.name, issued_tasks(p.tasks));
}

Communicator::MemberTasks CollectiveMatcher::issue_whole(Collective c,
                                                         const CollectiveOptions& options) {
  check_op(c.call.op, c.group);
  const int n = c.group.size();
  if (c.members.size() != static_cast<std::size_t>(n))
    throw std::invalid_argument(fmt::format("{} over group '{}' of {} ranks got {} members",
                                            to_string(c.call.op), c.group.name(), n,
                                            c.members.size()));
  c.name = task_prefix(c.call.op, c.group, options);
  // The backend sees the buffers of the members this process holds only, as when they issue
  // one at a time; a process holding none of the group has no part in it.
  const int held = held_members(backend_, c.group);
  if (held == 0) return Communicator::MemberTasks(static_cast<std::size_t>(n), rt::kNoTask);
  for (int r = 0; r < n; ++r)
    if (!backend_.holds(c.group.device(r))) c.members[static_cast<std::size_t>(r)] = {};
  // Planned before any task exists: a refused collective leaves the graph as it was.
  auto work = std::make_shared<MemberWork>(backend_.plan(c));
  const std::string key = group_key(c.group);
  Communicator::MemberTasks ids;
  ids.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    if (!backend_.holds(c.group.device(r))) {
      ids.push_back(rt::kNoTask);  // issued by the process holding its device
      ++issued_[{key, r}];
      continue;
    }
    if (pending_.count({key, issued_[{key, r}]}) != 0)
      throw std::logic_error(fmt::format(
          "{} over group '{}' issued whole while member {} still has a collective of that group "
          "open",
          to_string(c.call.op), c.group.name(), r));
    ++issued_[{key, r}];
    rt::TaskFn fn;
    if (*work) fn = [work, r](rt::TaskContext& context) { (*work)(r, context); };
    ids.push_back(graph_.add({.device = c.group.device(r),
                              .stream = graph_.stream(options.stream, options.stream_kind),
                              .kind = rt::TaskKind::comm,
                              .name = fmt::format("{}[{}]", c.name, r),
                              .tags = options.tags,
                              .cost = member_cost(c.call.op, c.group, r, c.call.root,
                                                  c.members[static_cast<std::size_t>(r)],
                                                  c.call.row_elements, options.element_bytes)},
                             std::move(fn)));
  }
  graph_.rendezvous(c.name, issued_tasks(ids));
  return ids;
}

rt::TaskId CollectiveMatcher::all_reduce(const ProcessGroup& group, int member,
                                         std::span<float> buffer, ReduceOp op,
                                         const CollectiveOptions& options) {
  return issue({.op = CollectiveOp::all_reduce, .reduce = op}, group, member, {.output = buffer},
               options);
}

rt::TaskId CollectiveMatcher::all_gather(const ProcessGroup& group, int member,
                                         std::span<const float> input, std::span<float> output,
                                         const CollectiveOptions& options) {
  return issue({.op = CollectiveOp::all_gather}, group, member, {.input = input, .output = output},
               options);
}

rt::TaskId CollectiveMatcher::reduce_scatter(const ProcessGroup& group, int member,
                                             std::span<const float> input, std::span<float> output,
                                             ReduceOp op, const CollectiveOptions& options) {
  return issue({.op = CollectiveOp::reduce_scatter, .reduce = op}, group, member,
               {.input = input, .output = output}, options);
}

rt::TaskId CollectiveMatcher::all_to_all(const ProcessGroup& group, int member,
                                         std::span<const float> input, std::span<float> output,
                                         const CollectiveOptions& options) {
  return issue({.op = CollectiveOp::all_to_all}, group, member, {.input = input, .output = output},
               options);
}

rt::TaskId CollectiveMatcher::all_to_all_v(const ProcessGroup& group, int member,
                                           const VariableAllToAllBuffers& buffers,
                                           std::int64_t row_elements,
                                           const CollectiveOptions& options) {
  return issue({.op = CollectiveOp::all_to_all_v, .row_elements = row_elements}, group, member,
               {.variable = buffers}, options);
}

rt::TaskId CollectiveMatcher::all_gather_v(const ProcessGroup& group, int member,
                                           const VariableGatherBuffers& buffers,
                                           std::int64_t row_elements,
                                           const CollectiveOptions& options) {
  return issue({.op = CollectiveOp::all_gather_v, .row_elements = row_elements}, group, member,
               {.gather = buffers}, options);
}

rt::TaskId CollectiveMatcher::reduce_scatter_v(const ProcessGroup& group, int member,
                                               const VariableScatterBuffers& buffers,
                                               std::int64_t row_elements,
                                               const CollectiveOptions& options) {
  return issue({.op = CollectiveOp::reduce_scatter_v, .row_elements = row_elements}, group, member,
               {.scatter = buffers}, options);
}

rt::TaskId CollectiveMatcher::broadcast(const ProcessGroup& group, int member,
                                        std::span<float> buffer, int root,
                                        const CollectiveOptions& options) {
  return issue({.op = CollectiveOp::broadcast, .root = root}, group, member, {.output = buffer},
               options);
}

rt::TaskId CollectiveMatcher::barrier(const ProcessGroup& group, int member,
                                      const CollectiveOptions& options) {
  return issue({.op = CollectiveOp::barrier}, group, member, {}, options);
}

namespace {

ProcessGroup transfer_pair(rt::DeviceId from, rt::DeviceId to) {
  if (from == to)
    throw std::invalid_argument(fmt::format(
        "send_recv from device {} to itself: a transfer needs two devices; copy within the "
        "device instead",
        from));
  return ProcessGroup(fmt::format("{}->{}", from, to), {from, to});
}

}  // namespace

rt::TaskId CollectiveMatcher::send(rt::DeviceId from, rt::DeviceId to, std::span<const float> data,
                                   const CollectiveOptions& options) {
  return issue({.op = CollectiveOp::send_recv}, transfer_pair(from, to), 0, {.input = data},
               options);
}

rt::TaskId CollectiveMatcher::receive(rt::DeviceId from, rt::DeviceId to, std::span<float> into,
                                      const CollectiveOptions& options) {
  return issue({.op = CollectiveOp::send_recv}, transfer_pair(from, to), 1, {.output = into},
               options);
}

std::vector<std::string> CollectiveMatcher::open_collectives() const {
  std::vector<std::string> out;
  for (const auto& [key, p] : pending_) {
    std::vector<int> issued;
    for (int r = 0; r < p->collective.group.size(); ++r)
      if (p->issued[static_cast<std::size_t>(r)]) issued.push_back(r);
    out.push_back(fmt::format(
        "{} '{}' over group '{}' (collective {} of the group): members {} "
        "of {} issued it",
        to_string(p->collective.call.op), p->collective.name, p->collective.group.name(),
        key.second, fmt::join(issued, ", "), p->collective.group.size()));
  }
  return out;
}

void CollectiveMatcher::finish() const {
  const std::vector<std::string> open = open_collectives();
  if (!open.empty())
    throw std::logic_error(fmt::format(
        "{} collective(s) were issued by some members of their group and not by others; every "
        "member must issue the same collectives in the same order:\n  {}",
        open.size(), fmt::join(open, "\n  ")));
  backend_.commit();
}

}  // namespace weave::devices
