// What the train_flags fuzz target does with one input, shared with the regression tests: `weave
// train`'s flags and its --config JSON, checked, expanded, parsed, derived and validated as the
// program does before it trains (nothing runs).
//
// Input: the --config file's text, a NUL byte, then the arguments, one per line; without a NUL
// the whole input is arguments. Every --config names that text. Throws what the program refuses
// input with: CLI::Error (CLI11's parse errors) or std::invalid_argument naming the rule.
#pragma once

#include <CLI/CLI.hpp>

#include <algorithm>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "commands.hpp"
#include "train_options.hpp"
#include "weave/graphs/trainer_config.hpp"

namespace weave::fuzz {

// `weave train`'s command line, built once for every input: building it adds several hundred
// flags, each checked against those added before it, which took most of an input's time (a few
// hundred inputs a minute under the sanitizers). Each parse starts from new options and a cleared
// command line, as a new run does; every flag binds to the options, so nothing of an earlier input
// is left.
class TrainCommandLine {
 public:
  TrainCommandLine() { cli::add_train_flags(*app_.add_subcommand("train"), options_); }

  graphs::TrainerConfig parse(std::vector<std::string> args, const std::string& config) {
    options_ = cli::TrainOptions{};
    app_.clear();
    args = cli::prepare_arguments(
        app_, args, [&](const std::string&) { return std::optional<std::string>(config); });
    std::reverse(args.begin(), args.end());  // CLI11 takes them last first
    app_.parse(args);
    cli::derive_config(options_);
    graphs::validate(options_.config);
    return options_.config;
  }

 private:
  CLI::App app_;
  cli::TrainOptions options_;
};

inline graphs::TrainerConfig parse_train_flags(std::string_view input) {
  std::string config;
  std::string_view flags = input;
  if (const std::size_t nul = input.find('\0'); nul != std::string_view::npos) {
    config = input.substr(0, nul);
    flags = input.substr(nul + 1);
  }
  std::vector<std::string> args{"train"};
  for (std::size_t begin = 0; begin < flags.size();) {
    std::size_t end = flags.find('\n', begin);
    if (end == std::string_view::npos) end = flags.size();
    args.emplace_back(flags.substr(begin, end - begin));
    begin = end + 1;
  }
  static TrainCommandLine command_line;
  return command_line.parse(std::move(args), config);
}

}  // namespace weave::fuzz
