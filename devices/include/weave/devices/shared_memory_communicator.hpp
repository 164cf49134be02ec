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
  MemberWork plan(const Collective& collective) override;
};

}  // namespace weave::devices
