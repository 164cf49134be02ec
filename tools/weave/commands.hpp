// The subcommands of the `weave` program, each in its own file.
#pragma once

#include <CLI/CLI.hpp>

namespace weave::cli {

// Thrown by a subcommand's callback to end the program with this exit code.
struct CommandExit {
  int code;
};

// A validator for counts: "--devices must be at least 1 (got 0)".
CLI::Validator at_least(long minimum);
// A validator for rates and sizes: a finite number > 0.
CLI::Validator positive();

void add_topo_command(CLI::App& app);
void add_simulate_command(CLI::App& app);

}  // namespace weave::cli
