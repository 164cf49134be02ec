// A backend for replaying a step in which only some ranks are built: the representatives of
// classes of ranks that do the same work (a prediction folds data-parallel replicas into the
// first). A collective is complete once the representatives among its members have issued,
// and each member's cost is that of the whole group (collective costs come from the group's
// size and the member's own buffers), so the representatives' timeline on the virtual clock is
// the one every member of their class would show. Nothing is moved: the graph can be replayed
// without running its tasks (rt::VirtualClockOptions::execute = false) and not run.
#pragma once

#include <vector>

#include "weave/devices/communicator.hpp"

namespace weave::devices {

class FoldedCommunicator : public Communicator {
 public:
  // `held[d]`: whether device d is a representative (its tasks are built and replayed).
  explicit FoldedCommunicator(std::vector<bool> held);

  MemberWork plan(const Collective& collective) override;
  bool holds(rt::DeviceId device) const override;

 private:
  std::vector<bool> held_;
};

}  // namespace weave::devices
