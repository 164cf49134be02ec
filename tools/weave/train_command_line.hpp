// `weave train`'s flags as a command line of their own, parsed as the program parses them and
// nothing run: what the flag tests and the train_flags fuzz target read a command line with.
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include "commands.hpp"
#include "train_options.hpp"

namespace weave::cli {

// Built once, it parses any number of command lines. Building it adds several hundred flags, each
// checked against those added before it (CLI11), which costs far more than a parse. Each parse
// starts from new options and a cleared command line, as a new run does: every flag binds to the
// options, so nothing of an earlier parse is left.
class TrainCommandLine {
 public:
  TrainCommandLine();
  TrainCommandLine(const TrainCommandLine&) = delete;
  TrainCommandLine& operator=(const TrainCommandLine&) = delete;

  // `weave train FLAGS`: checked and its --config expanded (prepare_arguments, the file read by
  // `read`), then parsed. Throws what the program refuses them with: CLI::Error or
  // std::invalid_argument naming the rule.
  TrainOptions parse(const std::vector<std::string>& flags,
                     const ConfigReader& read = read_config_file);

 private:
  CLI::App app_{"", "weave"};
  TrainOptions options_;
};

}  // namespace weave::cli
