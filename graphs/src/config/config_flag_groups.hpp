// The groups of the flag table (config_flags.hpp), each declared in the file of its concern, and
// the shorthands the declarations share.
#pragma once

#include <span>

#include "weave/graphs/config_flags.hpp"

namespace weave::graphs::flag_groups {

template <auto Member>
constexpr ConfigField model_field() {
  return config_field<&TrainerConfig::model, Member>();
}
template <auto Member>
constexpr ConfigField plan_field() {
  return config_field<&TrainerConfig::plan, Member>();
}
template <auto Member>
constexpr ConfigField run_field() {
  return config_field<Member>();
}
template <auto Member>
constexpr ConfigField learning_rate_field() {
  return config_field<&TrainerConfig::learning_rate, Member>();
}
template <auto Member>
constexpr ConfigField machine_field() {
  return config_field<&TrainerConfig::machine, Member>();
}

constexpr ValueCheck at_least(long minimum) {
  return {.kind = ValueCheck::at_least, .minimum = minimum};
}
inline constexpr ValueCheck kPositive{.kind = ValueCheck::positive};
inline constexpr ValueCheck kNonNegative{.kind = ValueCheck::non_negative};
constexpr ValueCheck one_of(std::string_view choices) {
  return {.kind = ValueCheck::one_of, .choices = choices};
}

// A described value: `saved` when a checkpoint's header holds it.
constexpr FlagDescription described(DescribedSection section, std::string_view key,
                                    bool saved = false) {
  return {.section = section, .key = key, .checkpointed = saved};
}

// A checkpointed description that checkpoints saved before it existed lack.
constexpr FlagDescription added_to_checkpoints(FlagDescription d) {
  d.absent_from_older_checkpoints = true;
  return d;
}

// Implemented flags, group by group (config_flags_model.cpp, config_flags_parallel.cpp,
// config_flags_run.cpp).
std::span<const ConfigFlag> config_file_flags();
std::span<const ConfigFlag> model_flags();
std::span<const ConfigFlag> moe_flags();
std::span<const ConfigFlag> parallelism_flags();
std::span<const ConfigFlag> pipeline_flags();
std::span<const ConfigFlag> ampipe_flags();
std::span<const ConfigFlag> optimizer_flags();
std::span<const ConfigFlag> training_flags();
std::span<const ConfigFlag> output_flags();
std::span<const ConfigFlag> machine_flags();
// `weave predict`'s own (config_flags_predict.cpp).
std::span<const ConfigFlag> prediction_flags();
// Megatron-LM's and MindSpeed's flags weave accepts without effect or refuses
// (config_flags_unimplemented.cpp).
std::span<const ConfigFlag> no_effect_flags();
std::span<const ConfigFlag> refused_flags();

}  // namespace weave::graphs::flag_groups
