// libFuzzer target: the Megatron indexed dataset reader (indexed_dataset_input.hpp). A refusal
// must be the documented std::runtime_error naming the rule; a crash, a sanitizer report or a
// sequence read otherwise than the index says is a finding.
#include <cstdint>
#include <stdexcept>

#include "indexed_dataset_input.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static weave::fuzz::IndexedFiles files;
  try {
    weave::fuzz::read_indexed_dataset(data, size, files);
  } catch (const std::runtime_error&) {
  }
  return 0;
}
