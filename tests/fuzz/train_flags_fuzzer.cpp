// libFuzzer target: weave train's flags and --config JSON (train_flags_input.hpp). A refusal
// must be a clear error: CLI11's parse errors or std::invalid_argument naming the rule
// (ConfigError is one). Any other exception, a crash or a sanitizer report is a finding.
#include <cstdint>
#include <stdexcept>
#include <string_view>

#include "train_flags_input.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    weave::fuzz::parse_train_flags(std::string_view(reinterpret_cast<const char*>(data), size));
  } catch (const CLI::Error&) {
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
