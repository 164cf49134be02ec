// libFuzzer target: the pipeline schedule CSV reader, writer and checker
// (schedule_csv_input.hpp). A refusal must be a ScheduleError naming the line and cell; any other
// exception, a crash, a sanitizer report or a schedule that does not survive the round trip is a
// finding.
#include <cstdint>
#include <string_view>

#include "schedule_csv_input.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    weave::fuzz::read_check_and_rewrite_schedule(
        std::string_view(reinterpret_cast<const char*>(data), size));
  } catch (const weave::graphs::ScheduleError&) {
  }
  return 0;
}
