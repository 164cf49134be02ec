#include "weave/devices/folded_communicator.hpp"

#include <fmt/format.h>

#include <stdexcept>

namespace weave::devices {

FoldedCommunicator::FoldedCommunicator(std::vector<bool> held) : held_(std::move(held)) {}

bool FoldedCommunicator::holds(rt::DeviceId device) const {
  return device < held_.size() && held_[device];
}

MemberWork FoldedCommunicator::plan(const Collective& collective) {
  // The members absent here do the same as the ones present: no buffers to check against them,
  // and no data to move in a replay that does not run the work.
  const std::string name = collective.group.name();
  return [name](int member, rt::TaskContext&) {
    throw std::logic_error(fmt::format(
        "member {} of a collective over '{}' was run, but a folded step (some ranks standing "
        "for others) is only replayed on the virtual clock without running its tasks",
        member, name));
  };
}

}  // namespace weave::devices
