// The checks flags share: counts and positive numbers, with messages that name the value.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cmath>
#include <string>

#include "commands.hpp"

namespace weave::cli {

CLI::Validator at_least(long minimum) {
  return CLI::Validator(
      [minimum](std::string& value) -> std::string {
        long parsed = 0;
        if (!CLI::detail::lexical_cast(value, parsed) || parsed < minimum) {
          return fmt::format("must be a whole number of at least {} (got '{}')", minimum, value);
        }
        return {};
      },
      fmt::format("INT>={}", minimum));
}

CLI::Validator positive() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        double parsed = 0;
        if (!CLI::detail::lexical_cast(value, parsed) || !(parsed > 0) || !std::isfinite(parsed)) {
          return fmt::format("must be a number greater than 0 (got '{}')", value);
        }
        return {};
      },
      "NUMBER>0");
}

}  // namespace weave::cli
