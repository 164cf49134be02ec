// The data movement inside the shared-memory collectives: element-wise reductions over the
// ranks' buffers and copies, bandwidth-bound and bitwise deterministic. A copy (one source, or
// copy_floats) moves the elements' bytes (memcpy, or the vector loads and stores, which may
// alias anything) and never reads an element as a float: its buffers may hold 4 bytes of any
// kind, as an all-gather of packed 16-bit values gives (weave/devices/packed_halves.hpp).
#pragma once

#include <cstddef>
#include <span>

#include "weave/devices/communicator.hpp"

namespace weave::devices::detail {

// A collective that touches at least this many bytes (read and written) copies with streaming
// stores: its data would not stay in a last-level cache anyway, and skipping the
// read-for-ownership of the destination lines saves a third of a copy's memory traffic. Below
// it, results stay cached for the tasks that read them next.
inline constexpr std::size_t kStreamingBytes = std::size_t{16} << 20;

// For every i in [0, count): reduces sources[0][s + i], sources[1][s + i], ... in that order
// (s = source_offset) and writes the result to destinations[d][destination_offset + i] for
// every d. Sources and destinations may be the same
// buffers (an in-place all-reduce): each element is read from every source before it is
// written anywhere. `streaming` writes with non-temporal stores, for destinations that are not
// read by this call and are too large to stay cached.
void reduce_to_all(ReduceOp op, std::span<const float* const> sources, std::size_t source_offset,
                   std::span<float* const> destinations, std::size_t destination_offset,
                   std::size_t count, bool streaming);

// Copies count 4-byte elements between buffers that do not overlap (or are the same buffer).
void copy_floats(float* to, const float* from, std::size_t count, bool streaming);

}  // namespace weave::devices::detail
