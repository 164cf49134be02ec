// weave: run, check and look at distributed training on one host.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>

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

int main(int argc, char** argv) {
  CLI::App app{"weave: distributed training as a task graph over simulated devices on one host"};
  app.set_version_flag("--version", WEAVE_VERSION);
  app.require_subcommand(1);
  weave::cli::add_topo_command(app);
  weave::cli::add_simulate_command(app);
  weave::cli::add_train_command(app);
  weave::cli::add_schedule_command(app);
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
