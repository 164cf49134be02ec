// Chrome trace-event JSON (opens in Perfetto and chrome://tracing): one process per device,
// one thread per stream, one complete event per task with its tags as arguments. Written by
// weave's runs and read back, so a trace saved by `weave train --trace` can be measured later.
#pragma once

#include <iosfwd>
#include <span>
#include <string>

#include "weave/runtime/trace.hpp"

namespace weave::rt {

void write_chrome_trace(const Trace& trace, std::ostream& out);
// Writes to a file through a temporary name and a rename, so a reader never sees half a file.
void write_chrome_trace(const Trace& trace, const std::string& path);

// A trace written as above: each complete ("X") event becomes a span of a task on device `pid`
// and the stream its thread is named after, with its kind, tags and cost hints; the clock comes
// from otherData. Events of other writers read as compute tasks on stream "tid<N>". What a
// metric needs is kept; rendezvous names are not. Throws std::runtime_error naming the source,
// the event and what is wrong (not JSON, no traceEvents, an X event without a numeric pid, tid,
// ts or dur).
Trace read_chrome_trace(std::istream& in, const std::string& source = "trace");
Trace read_chrome_trace(const std::string& path);

// Traces of one step written by several processes, each over its own devices, as one file
// (written through a temporary name and a rename): the events of traces[i] moved later by
// shifts[i] nanoseconds, so that every process's spans stand on one clock. Throws
// std::runtime_error naming the trace that is not one written by write_chrome_trace.
void merge_chrome_traces(std::span<const std::string> traces, std::span<const Nanos> shifts,
                         const std::string& path);

}  // namespace weave::rt
