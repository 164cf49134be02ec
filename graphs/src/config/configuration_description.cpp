// A configuration as the checkpoint's header and the run record describe it, from the flag table.
#include <type_traits>

#include "weave/graphs/config_flags.hpp"

namespace weave::graphs {

namespace {

using enum DescribedSection;

DescribedValue whole(std::int64_t v) {
  return v;
}

// The values a description holds that no flag sets: derived from the flags' values.
struct DerivedSetting {
  DescribedSection section;
  std::string_view key;
  bool checkpointed;
  DescribedValue (*value)(const TrainerConfig&);
};

constexpr DerivedSetting kDerived[] = {
    {model, "padded_vocab_size", false,
     [](const TrainerConfig& c) {
       return whole(c.model.padded_vocab_size(c.plan.tensor_parallel));
     }},
    {plan, "data_parallel_size", true,
     [](const TrainerConfig& c) { return whole(c.plan.data_parallel); }},
    {plan, "micro_batches", false,
     [](const TrainerConfig& c) { return whole(c.plan.micro_batches()); }},
};

// The value of `field` in `config`, widened to a described value.
DescribedValue field_value(const ConfigField& field, TrainerConfig& config) {
  return std::visit(
      [&](auto ref) -> DescribedValue {
        if constexpr (std::is_same_v<decltype(ref), std::monostate>) {
          return false;  // never reached: such a flag describes itself by its value function
        } else {
          using Value = std::remove_cvref_t<decltype(ref(config))>;
          if constexpr (std::is_same_v<Value, int>)
            return std::int64_t{ref(config)};
          else
            return ref(config);
        }
      },
      field);
}

}  // namespace

std::vector<DescribedSetting> describe_configuration(const TrainerConfig& config,
                                                     DescribedSettings which) {
  TrainerConfig fields = config;  // read through the fields' references
  const bool all = which == DescribedSettings::all;
  std::vector<DescribedSetting> out;
  for (const ConfigFlag& f : config_flags()) {
    const FlagDescription& d = f.description;
    if (d.section == none || !(all || d.checkpointed)) continue;
    out.push_back({d.section, std::string(d.key),
                   d.value ? d.value(config) : field_value(f.field, fields), d.checkpointed});
  }
  for (const DerivedSetting& d : kDerived)
    if (all || d.checkpointed)
      out.push_back({d.section, std::string(d.key), d.value(config), d.checkpointed});
  return out;
}

}  // namespace weave::graphs
