#include "weave/graphs/config_flags.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "config/config_flag_groups.hpp"

namespace weave::graphs {

namespace {

// The table, group by group in --help's order; tests may add to it.
std::vector<ConfigFlag>& table() {
  static std::vector<ConfigFlag> flags = [] {
    std::vector<ConfigFlag> all;
    for (const std::span<const ConfigFlag> group :
         {flag_groups::config_file_flags(), flag_groups::model_flags(), flag_groups::moe_flags(),
          flag_groups::parallelism_flags(), flag_groups::pipeline_flags(),
          flag_groups::ampipe_flags(), flag_groups::optimizer_flags(),
          flag_groups::training_flags(), flag_groups::output_flags(), flag_groups::machine_flags(),
          flag_groups::prediction_flags(), flag_groups::no_effect_flags(),
          flag_groups::refused_flags()})
      all.insert(all.end(), group.begin(), group.end());
    return all;
  }();
  return flags;
}

}  // namespace

std::string_view flag_status_name(FlagStatus s) {
  switch (s) {
    case FlagStatus::implemented:
      return "implemented";
    case FlagStatus::no_effect:
      return "no effect";
    case FlagStatus::refused:
      return "refused";
  }
  return "";
}

std::string_view flag_group_title(FlagGroup g) {
  switch (g) {
    case FlagGroup::config_file:
      return "Configuration file";
    case FlagGroup::model:
      return "Model";
    case FlagGroup::moe:
      return "Mixture of Experts";
    case FlagGroup::parallelism:
      return "Parallelism and batch";
    case FlagGroup::pipeline:
      return "Pipeline parallelism";
    case FlagGroup::ampipe:
      return "Ampipe and pipelined experts";
    case FlagGroup::optimizer:
      return "Optimizer";
    case FlagGroup::learning_rate:
      return "Learning rate";
    case FlagGroup::training:
      return "Training and evaluation";
    case FlagGroup::data:
      return "Data";
    case FlagGroup::checkpoint:
      return "Checkpoints";
    case FlagGroup::logging:
      return "Logging and output";
    case FlagGroup::machine:
      return "Modelled machine";
    case FlagGroup::advice:
      return "Advice";
    case FlagGroup::prediction:
      return "Prediction";
    case FlagGroup::not_implemented:
      return "Flags accepted without effect (Megatron-LM's, MindSpeed's, older weave's)";
  }
  return "";
}

std::string_view described_section_name(DescribedSection s) {
  switch (s) {
    case DescribedSection::model:
      return "model";
    case DescribedSection::plan:
      return "plan";
    case DescribedSection::optimizer:
      return "optimizer";
    case DescribedSection::learning_rate:
      return "learning_rate";
    case DescribedSection::run:
    case DescribedSection::none:
      break;
  }
  return "";
}

std::vector<std::string> ConfigFlag::names() const {
  std::vector<std::string> out{std::string(name)};
  for (std::size_t at = 0; at < aliases.size();) {
    const std::size_t comma = std::min(aliases.find(',', at), aliases.size());
    out.emplace_back(aliases.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

std::span<const ConfigFlag> config_flags() {
  return table();
}

const ConfigFlag* find_config_flag(std::string_view name) {
  for (const ConfigFlag& f : table()) {
    const std::vector<std::string> names = f.names();
    if (std::find(names.begin(), names.end(), name) != names.end()) return &f;
  }
  return nullptr;
}

void add_config_flag_for_testing(const ConfigFlag& flag) {
  table().push_back(flag);
}

void check_flag_rules(const ParallelPlan& plan, std::span<const std::string> given) {
  if (plan.ampipe_degree <= 1) return;
  // The flags the plan holds, beside those given without effect.
  std::vector<std::string> named(given.begin(), given.end());
  if (plan.overlap_grad_reduce) named.emplace_back("--overlap-grad-reduce");
  if (plan.overlap_param_gather) named.emplace_back("--overlap-param-gather");
  for (const std::string& name : named) {
    const ConfigFlag* f = find_config_flag(name);
    if (f && f->has(kRefusedBesideAmpipe))
      throw ConfigError(fmt::format(
          "--ampipe-degree ({}) cannot run with {}: MindSpeed's Ampipe refuses it (its chunks' "
          "schedule and that feature's reorder the same communication); drop one of them",
          plan.ampipe_degree, name));
  }
}

}  // namespace weave::graphs
