// The flags of a training run's configuration, each declared once: its Megatron-LM name and
// aliases, where its value goes in a TrainerConfig, the check of its value, its help, whether
// weave implements it, accepts it without effect or refuses it (and why), the rule it takes part
// in, and the key under which a checkpoint's header and a run's record describe it. A program's
// command line, its JSON configuration file, the checkpoint's description, a run's record,
// `weave predict`'s plan flags and docs/flags.md all derive from this table, as Megatron-LM's
// `_add_*_args` groups over its arguments serve its parser, its checkpoints and its logs.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "weave/graphs/trainer_config.hpp"

namespace weave::graphs {

// What a flag does under `weave train`.
enum class FlagStatus {
  implemented,  // it does what it does in Megatron-LM or MindSpeed
  no_effect,    // accepted, values and all, and named once: the run is the same without it
  refused,      // refused before anything runs, saying why and what to do instead
};
// "implemented", "no effect" or "refused", as docs/flags.md writes them.
std::string_view flag_status_name(FlagStatus s);

// The concern a flag belongs to, as `weave train --help` groups them.
enum class FlagGroup {
  config_file,
  model,
  moe,
  parallelism,
  pipeline,
  ampipe,
  optimizer,
  learning_rate,
  training,
  data,
  checkpoint,
  logging,
  machine,
  advice,
  prediction,  // what `weave predict` replays and reports
  // Megatron-LM's, MindSpeed's and older weave flags accepted without effect or refused.
  not_implemented,
};
// The group's title in --help ("Model", "Mixture of Experts", ...).
std::string_view flag_group_title(FlagGroup g);

// The command a flag belongs to.
enum class FlagCommand {
  train,    // `weave train`'s, which `weave predict` takes too
  predict,  // `weave predict`'s own: what it replays, reports and searches; `weave train` lacks it
};

// Where a flag's value goes: a field of the TrainerConfig, reached by reference. std::monostate:
// a setting of the program's own (a word it maps onto an enum, a file it reads or writes), which
// the program binds itself.
using ConfigField =
    std::variant<std::monostate, int& (*)(TrainerConfig&), std::int64_t& (*)(TrainerConfig&),
                 std::uint64_t& (*)(TrainerConfig&), double& (*)(TrainerConfig&),
                 bool& (*)(TrainerConfig&), std::string& (*)(TrainerConfig&)>;

// The field at `path` (member pointers from TrainerConfig down), as a ConfigField:
// config_field<&TrainerConfig::model, &ModelConfig::num_layers>().
template <auto... Path>
constexpr ConfigField config_field() {
  return +[](TrainerConfig & c) -> auto& {
    return (c.*....*Path);
  };
}

// The check a value gets when it is read, before the configuration's own rules (validate).
struct ValueCheck {
  enum Kind { none, at_least, positive, non_negative, one_of };
  Kind kind = none;
  long minimum = 0;          // at_least
  std::string_view choices;  // one_of: "cosine,linear,constant"
};

// A value as a description holds it.
using DescribedValue = std::variant<bool, std::int64_t, std::uint64_t, double, std::string>;

// The part of a description a value sits in: the checkpoint's header and the run record hold
// "model" and "plan" objects; the run record also "optimizer", "learning_rate" and the run's own
// keys at its top level.
enum class DescribedSection { none, model, plan, optimizer, learning_rate, run };
// "model", "plan", "optimizer", "learning_rate", or "" for the top level.
std::string_view described_section_name(DescribedSection s);

struct FlagDescription {
  DescribedSection section = DescribedSection::none;  // none: not described
  std::string_view key;                               // "num_layers"
  // Whether a checkpoint's header holds it: the value fixes the saved tensors' shapes or their
  // layout over the ranks, so a checkpoint loads only where it is the same.
  bool checkpointed = false;
  // The value described, when it is not the field's own (a derived or defaulted value).
  DescribedValue (*value)(const TrainerConfig&) = nullptr;
  // Checkpointed after the first checkpoints were written: a header without it was saved before
  // it existed, and means its default.
  bool absent_from_older_checkpoints = false;
};

// Properties of a flag beyond its value.
enum FlagProperty : unsigned {
  kShowsDefault = 1u << 0,  // --help prints its default
  kChoosesPlan = 1u << 1,   // a parallel plan's choice: `weave predict --advise` sets it itself
  // Left out of the command `weave predict --advise` prints for the best plan (a file already
  // read onto the command line, a search and its settings, a trace of one step).
  kNotRepeatedByAdvice = 1u << 2,
  // Refused beside --ampipe-degree > 1, as MindSpeed's Ampipe refuses it.
  kRefusedBesideAmpipe = 1u << 3,
  // Refused by `weave train` (or without effect there) and modelled by `weave predict`, which
  // registers it itself.
  kModelledByPredict = 1u << 4,
};

struct ConfigFlag {
  std::string_view name;     // "--norm-epsilon"
  std::string_view aliases;  // "--layernorm-epsilon" (comma-separated), or ""
  FlagGroup group = FlagGroup::model;
  FlagCommand command = FlagCommand::train;
  FlagStatus status = FlagStatus::implemented;
  int values = 1;  // values that follow it on a command line; 0: a switch
  // Implemented: what it does (--help's text). No effect or refused: why, and what to do instead.
  std::string_view help;
  ConfigField field;
  ValueCheck check;
  FlagDescription description;
  unsigned properties = 0;
  std::string_view type_name;  // --help's name of the value ("" : CLI11's)
  // kModelledByPredict: what `weave predict` models (its --help), its value going to `field` or
  // to predict's setting of that name.
  std::string_view predicted_help;

  bool has(FlagProperty p) const { return (properties & p) != 0; }
  // The name and every alias: "--norm-epsilon", "--layernorm-epsilon".
  std::vector<std::string> names() const;
};

// Every flag of `weave train` and `weave predict`'s own (FlagCommand), group by group, each once.
std::span<const ConfigFlag> config_flags();
// The flag named `name` (or one of its aliases), or nullptr.
const ConfigFlag* find_config_flag(std::string_view name);

// Adds `flag` to the table that config_flags() returns, for tests of the consumers: each derives
// what it does with a flag from the table, so a flag added here reaches all of them.
void add_config_flag_for_testing(const ConfigFlag& flag);

// One value of a configuration's description.
struct DescribedSetting {
  DescribedSection section;
  std::string key;
  DescribedValue value;
  bool checkpointed;
};

// Which settings a description holds: a checkpoint's header the checkpointed ones, a run's record
// all of them.
enum class DescribedSettings { checkpointed, all };

// The configuration as a checkpoint's header and a run's record describe it: the flags' values
// after their defaults and derivations, and the values derived from them (the padded vocabulary,
// the data-parallel size, ...). Only the settings asked for are computed.
std::vector<DescribedSetting> describe_configuration(
    const TrainerConfig& config, DescribedSettings which = DescribedSettings::all);

// The rules declared with the flags, over the flags a command line gave (each by its table name):
// a flag refused beside Ampipe given with --ampipe-degree > 1. Throws ConfigError naming the rule.
void check_flag_rules(const ParallelPlan& plan, std::span<const std::string> given);

}  // namespace weave::graphs
