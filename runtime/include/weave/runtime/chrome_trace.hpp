// Chrome trace-event JSON (opens in Perfetto and chrome://tracing): one process per device,
// one thread per stream, one complete event per task with its tags as arguments.
#pragma once

#include <iosfwd>
#include <string>

#include "weave/runtime/trace.hpp"

namespace weave::rt {

void write_chrome_trace(const Trace& trace, std::ostream& out);
// Writes to a file through a temporary name and a rename, so a reader never sees half a file.
void write_chrome_trace(const Trace& trace, const std::string& path);

}  // namespace weave::rt
