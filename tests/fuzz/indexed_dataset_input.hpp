// What the indexed_dataset fuzz target does with one input, shared with the regression tests:
// a Megatron indexed dataset (.idx and .bin) opened and every sequence read.
//
// Input: four bytes, the .idx's length L (little-endian, cut to what follows); L bytes, the
// .idx; the rest, the .bin. Throws what the reader refuses input with: std::runtime_error
// naming the file and the rule. Aborts when what it read is wrong: a sequence that does not
// read whole, or tokens counted otherwise than the lengths say.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "scratch_file.hpp"
#include "weave/graphs/indexed_dataset.hpp"

namespace weave::fuzz {

struct IndexedFiles {
  ScratchFile idx{"dataset.idx"}, bin{"dataset.bin"};
  // The prefix both files share.
  std::string prefix() const { return idx.path().substr(0, idx.path().size() - 4); }
};

inline void read_indexed_dataset(const std::uint8_t* data, std::size_t size, IndexedFiles& files) {
  if (size < 4) return;
  std::uint32_t idx_size = 0;
  std::memcpy(&idx_size, data, 4);
  const std::size_t idx = std::min<std::size_t>(idx_size, size - 4);
  files.idx.write(data + 4, idx);
  files.bin.write(data + 4 + idx, size - 4 - idx);
  const graphs::IndexedDataset dataset(files.prefix());
  std::uint64_t tokens = 0;
  std::vector<std::int32_t> sequence;
  for (std::size_t s = 0; s < dataset.sequences(); ++s) {
    sequence.clear();
    const auto length = static_cast<std::size_t>(dataset.sequence_length(s));
    dataset.read(s, 0, length, sequence);
    if (sequence.size() != length) std::abort();
    tokens += length;
  }
  if (tokens != dataset.tokens()) std::abort();
  if (dataset.document_start(dataset.documents()) != static_cast<std::int64_t>(dataset.sequences()))
    std::abort();
}

}  // namespace weave::fuzz
