#include <fmt/format.h>

#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "commands.hpp"
#include "weave/runtime/closest_match.hpp"

namespace weave::cli {

namespace {

std::vector<std::string> flag_names(const CLI::App& cmd) {
  std::vector<std::string> names{"--help"};
  for (const CLI::Option* opt : cmd.get_options())
    for (const std::string& n : opt->get_lnames())
      names.push_back("--" + n);
  return names;
}

std::string unknown(const std::string& what, const std::string& flag, const std::string& command,
                    const std::vector<std::string>& known) {
  const std::string guess = rt::closest_match(flag, known);
  return fmt::format("unknown {} '{}' for `weave {}`{}; `weave {} --help` lists them", what, flag,
                     command, guess.empty() ? "" : fmt::format(" (did you mean '{}'?)", guess),
                     command);
}

}  // namespace

std::optional<std::string> read_config_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::vector<std::string> prepare_arguments(CLI::App& app, std::vector<std::string> args,
                                           const ConfigReader& read) {
  if (args.empty()) return args;
  CLI::App* cmd = nullptr;
  for (CLI::App* sub : app.get_subcommands({}))
    if (sub->get_name() == args[0]) cmd = sub;
  if (!cmd) return args;
  const std::vector<std::string> known = flag_names(*cmd);
  std::string config;
  for (std::size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0) continue;
    const std::string name = a.substr(0, a.find('='));
    if (std::find(known.begin(), known.end(), name) == known.end())
      throw std::invalid_argument(unknown("flag", name, cmd->get_name(), known));
    if (name == "--config")
      config = a.find('=') != std::string::npos ? a.substr(a.find('=') + 1)
                                                : (i + 1 < args.size() ? args[i + 1] : "");
  }
  if (config.empty()) return args;
  const std::optional<std::string> text = read(config);
  if (!text) throw std::invalid_argument(fmt::format("--config: cannot read '{}'", config));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(*text);
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(
        fmt::format("--config '{}' is not valid JSON: {}", config, e.what()));
  }
  if (!j.is_object())
    throw std::invalid_argument(
        fmt::format("--config '{}' must hold a JSON object of flag names and values, like "
                    "{{\"num-layers\": 4}}",
                    config));
  std::vector<std::string> expanded{args[0]};
  for (const auto& [key, value] : j.items()) {
    std::string flag = "--" + key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    if (flag == "--config" || std::find(known.begin(), known.end(), flag) == known.end())
      throw std::invalid_argument(unknown("key", flag, cmd->get_name(), known) +
                                  fmt::format(" (in --config '{}')", config));
    if (value.is_boolean()) {
      if (value.get<bool>()) expanded.push_back(flag);
    } else if (value.is_number() || value.is_string()) {
      expanded.push_back(flag);
      expanded.push_back(value.is_string() ? value.get<std::string>() : value.dump());
    } else {
      throw std::invalid_argument(
          fmt::format("--config '{}': '{}' must be a number, a string or true/false, got {}",
                      config, key, value.dump()));
    }
  }
  expanded.insert(expanded.end(), args.begin() + 1, args.end());
  return expanded;
}

}  // namespace weave::cli
