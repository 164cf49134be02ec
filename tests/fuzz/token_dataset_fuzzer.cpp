// libFuzzer target: the text data loader (token_dataset_input.hpp). A refusal must be the
// documented std::invalid_argument or std::runtime_error naming the value; a crash, a sanitizer
// report, a split that loses bytes or a wrong sample is a finding.
#include <cstdint>
#include <stdexcept>

#include "token_dataset_input.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static weave::fuzz::ScratchFile file("text");
  try {
    weave::fuzz::read_and_sample_text(data, size, file);
  } catch (const std::runtime_error&) {
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
