// What the train_flags fuzz target does with one input, shared with the regression tests: `weave
// train`'s flags and its --config JSON, checked, expanded, parsed, derived and validated as the
// program does before it trains (nothing runs).
//
// Input: the --config file's text, a NUL byte, then the arguments, one per line; without a NUL
// the whole input is arguments. Every --config names that text. Throws what the program refuses
// input with: CLI::Error (CLI11's parse errors) or std::invalid_argument naming the rule.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "train_command_line.hpp"
#include "weave/graphs/trainer_config.hpp"

namespace weave::fuzz {

inline graphs::TrainerConfig parse_train_flags(std::string_view input) {
  std::string config;
  std::string_view flags = input;
  if (const std::size_t nul = input.find('\0'); nul != std::string_view::npos) {
    config = input.substr(0, nul);
    flags = input.substr(nul + 1);
  }
  std::vector<std::string> args;
  for (std::size_t begin = 0; begin < flags.size();) {
    std::size_t end = flags.find('\n', begin);
    if (end == std::string_view::npos) end = flags.size();
    args.emplace_back(flags.substr(begin, end - begin));
    begin = end + 1;
  }
  // One command line for every input: building it costs far more than a parse.
  static cli::TrainCommandLine command_line;
  cli::TrainOptions options = command_line.parse(
      args, [&](const std::string&) { return std::optional<std::string>(config); });
  cli::derive_config(options);
  graphs::validate(options.config);
  return options.config;
}

}  // namespace weave::fuzz
