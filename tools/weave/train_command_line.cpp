#include "train_command_line.hpp"

#include <algorithm>

namespace weave::cli {

TrainCommandLine::TrainCommandLine() {
  add_train_flags(*app_.add_subcommand("train"), options_);
}

TrainOptions TrainCommandLine::parse(const std::vector<std::string>& flags,
                                     const ConfigReader& read) {
  options_ = TrainOptions{};
  app_.clear();
  std::vector<std::string> args{"train"};
  args.insert(args.end(), flags.begin(), flags.end());
  args = prepare_arguments(app_, args, read);
  std::reverse(args.begin(), args.end());  // CLI11 takes them last first
  app_.parse(args);
  return options_;
}

}  // namespace weave::cli
