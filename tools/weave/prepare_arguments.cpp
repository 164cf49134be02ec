#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "commands.hpp"
#include "weave/graphs/config_flags.hpp"
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

bool known(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

// The closest known name, when it differs from `word` in one short stretch only (a typo, a
// missing or doubled letter, two letters swapped): "--num-layer" is "--num-layers", but
// "--expert-tensor-parallel-size" is not "--expert-model-parallel-size" with a typo.
std::string suggestion(const std::string& word, const std::vector<std::string>& names) {
  const std::string guess = rt::closest_match(word, names);
  if (guess.empty()) return guess;
  std::size_t prefix = 0;
  while (prefix < word.size() && prefix < guess.size() && word[prefix] == guess[prefix])
    ++prefix;
  std::size_t suffix = 0;
  while (suffix < word.size() - prefix && suffix < guess.size() - prefix &&
         word[word.size() - 1 - suffix] == guess[guess.size() - 1 - suffix])
    ++suffix;
  constexpr std::size_t kTypo = 3;  // characters
  return word.size() - prefix - suffix <= kTypo && guess.size() - prefix - suffix <= kTypo ? guess
                                                                                           : "";
}

// The refusal of `flag` by `weave command` ("--bf16 is refused: ..."), or nothing when the flag
// table does not refuse it or the command is neither `train` nor `predict`: predict takes train's
// flags and registers the refused ones it models, so that they are never looked up here.
std::optional<std::string> refusal(const std::string& command, const std::string& flag) {
  if (command != "train" && command != "predict") return std::nullopt;
  const graphs::ConfigFlag* f = graphs::find_config_flag(flag);
  if (!f || f->status != graphs::FlagStatus::refused) return std::nullopt;
  return fmt::format("{} is refused: {}", flag, f->help);
}

// What is wrong with flag `name` of `weave command`, or "" when the command takes it.
std::string problem(const std::string& name, const std::string& command,
                    const std::vector<std::string>& names) {
  if (known(names, name)) return {};
  if (std::optional<std::string> refused = refusal(command, name)) return *refused;
  const std::string guess = suggestion(name, names);
  return fmt::format("unknown flag '{}'{}", name,
                     guess.empty() ? "" : fmt::format(" (did you mean '{}'?)", guess));
}

// "-hidden-size": a long flag with one dash, which CLI11 would read as -h (help) and more.
bool single_dash_long_flag(const std::string& arg) {
  return arg.size() > 2 && arg[0] == '-' && std::isalpha(static_cast<unsigned char>(arg[1])) &&
         std::isalpha(static_cast<unsigned char>(arg[2]));
}

// Whether `arg` is a flag of `cmd` that takes a value given as the next argument.
bool takes_next_value(const CLI::App& cmd, const std::string& arg) {
  if (arg.rfind("--", 0) != 0 || arg.find('=') != std::string::npos) return false;
  const CLI::Option* opt = cmd.get_option_no_throw(arg);
  return opt && opt->get_items_expected_min() > 0;
}

// All of a command line's problems in one message.
[[noreturn]] void refuse(const std::vector<std::string>& problems, const std::string& command,
                         const std::string& where) {
  const std::string help = fmt::format(
      "`weave {} --help` lists the flags it takes and docs/flags.md how Megatron-LM's map",
      command);
  if (problems.size() == 1)
    throw std::invalid_argument(
        fmt::format("{}{} for `weave {}`; {}", problems[0], where, command, help));
  std::string text = fmt::format("{} flags of `weave {}`{} cannot be taken ({}):", problems.size(),
                                 command, where, help);
  for (const std::string& p : problems)
    text += "\n  " + p;
  throw std::invalid_argument(text);
}

// Drops every occurrence of `flag` and its values but the last: a flag taking several values
// (--data-path's blend) would otherwise gather them all, where a flag given again must win as
// every other flag does (--config's values come first).
std::vector<std::string> keep_last(std::vector<std::string> args, const std::string& flag) {
  std::size_t last = args.size();
  for (std::size_t i = 0; i < args.size() && args[i] != "--"; ++i)
    if (args[i] == flag || args[i].rfind(flag + "=", 0) == 0) last = i;
  std::vector<std::string> kept;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const bool earlier =
        i < last && last < args.size() && (args[i] == flag || args[i].rfind(flag + "=", 0) == 0);
    if (!earlier) {
      kept.push_back(args[i]);
      continue;
    }
    if (args[i] == flag)  // skip its values, up to the next flag
      while (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0)
        ++i;
  }
  return kept;
}

}  // namespace

std::optional<std::string> read_config_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::vector<std::string> prepare_arguments(CLI::App& app, std::vector<std::string> args,
                                           const ConfigReader& read) {
  if (args.empty() || args[0].rfind('-', 0) == 0) return args;
  CLI::App* cmd = nullptr;
  std::vector<std::string> commands;
  for (CLI::App* sub : app.get_subcommands({})) {
    commands.push_back(sub->get_name());
    if (sub->get_name() == args[0]) cmd = sub;
  }
  if (!cmd) {
    const std::string guess = rt::closest_match(args[0], commands);
    throw std::invalid_argument(
        fmt::format("unknown command '{}'{}: the commands are {}; `weave --help` describes them",
                    args[0], guess.empty() ? "" : fmt::format(" (did you mean '{}'?)", guess),
                    fmt::join(commands, ", ")));
  }
  const std::string& command = cmd->get_name();
  const std::vector<std::string> names = flag_names(*cmd);
  std::vector<std::string> problems;
  std::string config;
  for (std::size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") break;  // the rest are values
    if (a.rfind("--", 0) != 0) {
      if (single_dash_long_flag(a) && !takes_next_value(*cmd, args[i - 1]))
        problems.push_back(fmt::format("'{}' has one dash: long flags take two, '-{}'", a,
                                       a.substr(0, a.find('='))));
      continue;
    }
    const std::string name = a.substr(0, a.find('='));
    if (std::string p = problem(name, command, names); !p.empty()) problems.push_back(p);
    if (name == "--config")
      config = a.find('=') != std::string::npos ? a.substr(a.find('=') + 1)
                                                : (i + 1 < args.size() ? args[i + 1] : "");
  }
  if (!problems.empty()) refuse(problems, command, "");
  if (config.empty()) return keep_last(std::move(args), "--data-path");
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
    if (flag == "--config") {
      problems.push_back("'config' cannot name another file");
      continue;
    }
    if (std::string p = problem(flag, command, names); !p.empty()) {
      problems.push_back(p);
      continue;
    }
    if (value.is_boolean()) {
      if (value.get<bool>()) expanded.push_back(flag);
    } else if (value.is_number() || value.is_string()) {
      expanded.push_back(flag);
      expanded.push_back(value.is_string() ? value.get<std::string>() : value.dump());
    } else {
      problems.push_back(
          fmt::format("'{}' must be a number, a string or true/false, got {}", key, value.dump()));
    }
  }
  if (!problems.empty()) refuse(problems, command, fmt::format(" (in --config '{}')", config));
  expanded.insert(expanded.end(), args.begin() + 1, args.end());
  return keep_last(std::move(expanded), "--data-path");
}

}  // namespace weave::cli
