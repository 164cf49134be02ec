// weave: run, check and look at distributed training on one host.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <exception>

#include "commands.hpp"

int main(int argc, char** argv) {
  CLI::App app{"weave: distributed training as a task graph over simulated devices on one host",
               "weave"};
  app.footer(
      "Example:\n  weave train --num-layers 4 --hidden-size 128 --num-attention-heads 8 "
      "--mock-data\n"
      "`weave COMMAND --help` describes a command's flags.");
  app.set_version_flag("--version", WEAVE_VERSION);
  app.require_subcommand(1);
  weave::cli::add_topo_command(app);
  weave::cli::add_simulate_command(app);
  weave::cli::add_train_command(app);
  weave::cli::add_schedule_command(app);
  weave::cli::add_generate_command(app);
  weave::cli::add_predict_command(app);
  weave::cli::add_calibrate_command(app);
  weave::cli::add_preprocess_command(app);
  try {
    std::vector<std::string> args =
        weave::cli::prepare_arguments(app, std::vector<std::string>(argv + 1, argv + argc));
    std::reverse(args.begin(), args.end());  // CLI11 takes them last first
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const weave::cli::CommandExit& e) {
    return e.code;
  } catch (const std::exception& e) {
    fmt::print(stderr, "weave: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
