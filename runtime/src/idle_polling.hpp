// The executor's side of IdlePoll (weave/runtime/idle_poll.hpp): what its idle threads call.
#pragma once

namespace weave::rt::detail {

// Whether the installed IdlePoll, if any, has transfers in flight.
bool idle_poll_busy();
// Polls the installed IdlePoll, if any.
void idle_poll_now();

}  // namespace weave::rt::detail
