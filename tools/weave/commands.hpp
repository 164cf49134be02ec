// The subcommands of the `weave` program, each in its own file.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "weave/graphs/model_config.hpp"

namespace weave::cli {

// Thrown by a subcommand's callback to end the program with this exit code.
struct CommandExit {
  int code;
};

// A validator for counts: "--devices must be at least 1 (got 0)".
CLI::Validator at_least(long minimum);
// A validator for rates and sizes: a finite number > 0.
CLI::Validator positive();

// The model's MLPs as a run's first line names them: "dense", or "8 experts top-2, 512 wide, in
// 3 of 4 layers".
std::string moe_text(const graphs::ModelConfig& m);
// The heads' width after their count when --kv-channels sets it (" of 128"), else "".
std::string heads_width_text(const graphs::ModelConfig& m);

void add_topo_command(CLI::App& app);
void add_simulate_command(CLI::App& app);
void add_train_command(CLI::App& app);
void add_schedule_command(CLI::App& app);
void add_generate_command(CLI::App& app);
void add_predict_command(CLI::App& app);
void add_calibrate_command(CLI::App& app);
void add_preprocess_command(CLI::App& app);

// Whether the command `weave predict --advise` prints for the best plan leaves `flag` out: the
// flags that choose a plan (the candidates set them themselves, config_flags.hpp marks them),
// another search, a file already read onto the command line, a trace of one step.
bool left_out_of_advice(std::string_view flag);

// The text of a --config file, or nothing when it cannot be read.
using ConfigReader = std::function<std::optional<std::string>(const std::string& path)>;
std::optional<std::string> read_config_file(const std::string& path);

// Checks the flags given to a subcommand before parsing, suggesting the closest known flag for
// an unknown one, and expands `--config FILE` (a JSON object of flag names, with - or _, and
// values) into flags placed before the ones given. Throws std::invalid_argument.
std::vector<std::string> prepare_arguments(CLI::App& app, std::vector<std::string> args,
                                           const ConfigReader& read = read_config_file);

}  // namespace weave::cli
