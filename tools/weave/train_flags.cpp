// `weave train`'s flags on the command line: every entry of the flag table (config_flags.hpp)
// bound to CLI11, its value going to the TrainerConfig field the table names or to the program's
// own setting of the same name.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <optional>
#include <stdexcept>
#include <type_traits>
#include <variant>

#include "commands.hpp"
#include "train_options.hpp"
#include "weave/graphs/config_flags.hpp"

namespace weave::cli {

namespace {

using graphs::ConfigFlag;

struct ProgramFlag {
  std::string_view name;
  ProgramSetting (*setting)(TrainOptions&);
};

// The table's flags whose value is the program's: words it maps onto the configuration
// (derive_config), files it reads or writes, and the machine it models.
constexpr ProgramFlag kProgramFlags[] = {
    {"--config", [](TrainOptions& o) -> ProgramSetting { return &o.config_file; }},
    {"--swiglu", [](TrainOptions& o) -> ProgramSetting { return &o.swiglu; }},
    {"--bf16", [](TrainOptions& o) -> ProgramSetting { return &o.bf16; }},
    {"--fp16", [](TrainOptions& o) -> ProgramSetting { return &o.fp16; }},
    {"--position-embedding-type",
     [](TrainOptions& o) -> ProgramSetting { return &o.position_embedding_type; }},
    {"--use-rotary-position-embeddings",
     [](TrainOptions& o) -> ProgramSetting { return &o.use_rotary_position_embeddings; }},
    {"--no-position-embedding",
     [](TrainOptions& o) -> ProgramSetting { return &o.no_position_embedding; }},
    {"--normalization", [](TrainOptions& o) -> ProgramSetting { return &o.normalization; }},
    {"--attention-backend", [](TrainOptions& o) -> ProgramSetting { return &o.attention_backend; }},
    {"--cross-entropy-loss-fusion",
     [](TrainOptions& o) -> ProgramSetting { return &o.cross_entropy_loss_fusion; }},
    {"--cross-entropy-fusion-impl",
     [](TrainOptions& o) -> ProgramSetting { return &o.cross_entropy_fusion_impl; }},
    {"--moe-layer-freq", [](TrainOptions& o) -> ProgramSetting { return &o.moe_layer_freq; }},
    {"--moe-router-pre-softmax",
     [](TrainOptions& o) -> ProgramSetting { return &o.moe_router_pre_softmax; }},
    {"--moe-token-drop-policy",
     [](TrainOptions& o) -> ProgramSetting { return &o.moe_token_drop_policy; }},
    {"--moe-router-load-balancing-type",
     [](TrainOptions& o) -> ProgramSetting { return &o.moe_router_load_balancing_type; }},
    {"--group-query-attention",
     [](TrainOptions& o) -> ProgramSetting { return &o.group_query_attention; }},
    {"--num-query-groups", [](TrainOptions& o) -> ProgramSetting { return &o.num_query_groups; }},
    {"--disable-bias-linear",
     [](TrainOptions& o) -> ProgramSetting { return &o.disable_bias_linear; }},
    {"--recompute-granularity",
     [](TrainOptions& o) -> ProgramSetting { return &o.recompute_granularity; }},
    {"--recompute-method", [](TrainOptions& o) -> ProgramSetting { return &o.recompute_method; }},
    {"--recompute-activations",
     [](TrainOptions& o) -> ProgramSetting { return &o.recompute_activations; }},
    {"--recompute-modules", [](TrainOptions& o) -> ProgramSetting { return &o.recompute_modules; }},
    {"--devices", [](TrainOptions& o) -> ProgramSetting { return &o.devices; }},
    {"--optimizer", [](TrainOptions& o) -> ProgramSetting { return &o.optimizer; }},
    {"--data-path", [](TrainOptions& o) -> ProgramSetting { return &o.data_path; }},
    {"--split", [](TrainOptions& o) -> ProgramSetting { return &o.split; }},
    {"--data-cache-path", [](TrainOptions& o) -> ProgramSetting { return &o.data_cache_path; }},
    {"--mock-data", [](TrainOptions& o) -> ProgramSetting { return &o.mock_data; }},
    {"--log-json", [](TrainOptions& o) -> ProgramSetting { return &o.log_json; }},
    {"--dump-graph", [](TrainOptions& o) -> ProgramSetting { return &o.dump_graph; }},
    {"--graph-filter", [](TrainOptions& o) -> ProgramSetting { return &o.graph_filter; }},
    {"--graph-level", [](TrainOptions& o) -> ProgramSetting { return &o.graph_level; }},
    {"--critical-path", [](TrainOptions& o) -> ProgramSetting { return &o.critical_path; }},
    {"--what-if", [](TrainOptions& o) -> ProgramSetting { return &o.what_if; }},
    {"--report", [](TrainOptions& o) -> ProgramSetting { return &o.report; }},
    {"--figure", [](TrainOptions& o) -> ProgramSetting { return &o.figure; }},
    {"--figure-out", [](TrainOptions& o) -> ProgramSetting { return &o.figure_out; }},
    {"--layer", [](TrainOptions& o) -> ProgramSetting { return &o.figure_layer; }},
    {"--figure-device", [](TrainOptions& o) -> ProgramSetting { return &o.figure_device; }},
    {"--timing", [](TrainOptions& o) -> ProgramSetting { return &o.timing; }},
    {"--accelerator", [](TrainOptions& o) -> ProgramSetting { return &o.accelerator; }},
    {"--devices-per-node",
     [](TrainOptions& o) -> ProgramSetting { return &o.cluster.devices_per_node; }},
    {"--node-link", [](TrainOptions& o) -> ProgramSetting { return &o.cluster.node_link; }},
    {"--network", [](TrainOptions& o) -> ProgramSetting { return &o.cluster.network; }},
    {"--ampipe-advise", [](TrainOptions& o) -> ProgramSetting { return &o.ampipe_advise; }},
    {"--pipeline-advise", [](TrainOptions& o) -> ProgramSetting { return &o.pipeline_advise; }},
    {"--rampup-batch-size", [](TrainOptions& o) -> ProgramSetting { return &o.rampup_batch_size; }},
    {"--deepspeed", [](TrainOptions& o) -> ProgramSetting { return &o.deepspeed; }},
    {"--deepspeed_config", [](TrainOptions& o) -> ProgramSetting { return &o.deepspeed_config; }},
    {"--zero-stage", [](TrainOptions& o) -> ProgramSetting { return &o.zero_stage; }},
    {"--use-custom-fsdp", [](TrainOptions& o) -> ProgramSetting { return &o.use_custom_fsdp; }},
    {"--data-parallel-sharding-strategy",
     [](TrainOptions& o) -> ProgramSetting { return &o.data_parallel_sharding_strategy; }},
};

ProgramSetting program_setting(const ConfigFlag& f, TrainOptions& o) {
  for (const ProgramFlag& p : kProgramFlags)
    if (p.name == f.name) return p.setting(o);
  throw std::logic_error(fmt::format(
      "the flag table's {} has no field and weave train keeps no setting of that name: give the "
      "entry a field (graphs::config_field) or bind it in kProgramFlags",
      f.name));
}

CLI::Validator value_check(const graphs::ValueCheck& c) {
  switch (c.kind) {
    case graphs::ValueCheck::at_least:
      return at_least(c.minimum);
    case graphs::ValueCheck::positive:
      return positive();
    case graphs::ValueCheck::non_negative:
      return CLI::NonNegativeNumber;
    case graphs::ValueCheck::one_of: {
      std::vector<std::string> choices;
      for (std::size_t at = 0; at < c.choices.size();) {
        const std::size_t comma = std::min(c.choices.find(',', at), c.choices.size());
        choices.emplace_back(c.choices.substr(at, comma - at));
        at = comma + 1;
      }
      return CLI::IsMember(choices);
    }
    case graphs::ValueCheck::none:
      break;
  }
  return CLI::Validator();
}

// Megatron-LM's whole-number flags are read by Python's int(), which takes underscores between
// digits ("9_765_625"): they are dropped before CLI11 reads the number.
CLI::Validator digit_separators() {
  return CLI::Validator(
      [](std::string& word) {
        const std::size_t first = !word.empty() && (word[0] == '-' || word[0] == '+') ? 1 : 0;
        bool digit_before = false;
        for (std::size_t i = first; i < word.size(); ++i) {
          const bool digit = std::isdigit(static_cast<unsigned char>(word[i])) != 0;
          const bool separator = word[i] == '_' && digit_before && i + 1 < word.size() &&
                                 std::isdigit(static_cast<unsigned char>(word[i + 1])) != 0;
          if (!digit && !separator) return std::string();  // not a number: left to CLI11
          digit_before = digit;
        }
        word.erase(std::remove(word.begin(), word.end(), '_'), word.end());
        return std::string();
      },
      "", "digit separators");
}

// The option of a flag, writing into `target` (a pointer to its value).
template <typename Value>
CLI::Option* add_value(CLI::App& cmd, const std::string& names, std::string_view help,
                       Value* target) {
  if constexpr (std::is_same_v<Value, bool>)
    return cmd.add_flag(names, *target, std::string(help));
  else if constexpr (std::is_integral_v<Value>)
    return cmd.add_option(names, *target, std::string(help))->transform(digit_separators());
  else
    return cmd.add_option(names, *target, std::string(help));
}

CLI::Option* add_implemented(CLI::App& cmd, const ConfigFlag& f, TrainOptions& o) {
  return add_config_flag(cmd, f, f.help, o.config,
                         std::holds_alternative<std::monostate>(f.field)
                             ? std::optional<ProgramSetting>(program_setting(f, o))
                             : std::nullopt);
}

// A flag without effect: parsed, values and all, and named once when the run starts.
CLI::Option* add_without_effect(CLI::App& cmd, const ConfigFlag& f, TrainOptions& o) {
  const std::string name(f.name);
  CLI::Option* opt = f.values == 0 ? cmd.add_flag(name)
                                   : cmd.add_option(name)->expected(f.values)->type_name("VALUE");
  opt->description(std::string(f.help));
  const bool valued = f.values > 0;
  opt->each([&o, name, valued](const std::string& value) {
    if (std::find(o.no_effect.begin(), o.no_effect.end(), name) == o.no_effect.end())
      o.no_effect.push_back(name);
    if (valued) o.no_effect_values[name] = value;
  });
  return opt;
}

}  // namespace

CLI::Option* add_config_flag(CLI::App& cmd, const ConfigFlag& f, std::string_view help,
                             graphs::TrainerConfig& config, std::optional<ProgramSetting> setting) {
  const std::vector<std::string> all = f.names();
  const std::string names = fmt::format("{}", fmt::join(all, ","));
  CLI::Option* opt =
      setting
          ? std::visit([&](auto* target) { return add_value(cmd, names, help, target); }, *setting)
          : std::visit(
                [&](auto ref) -> CLI::Option* {
                  if constexpr (std::is_same_v<decltype(ref), std::monostate>)
                    throw std::logic_error(fmt::format(
                        "the flag table's {} has no field: bind it to a setting", f.name));
                  else
                    return add_value(cmd, names, help, &ref(config));
                },
                f.field);
  if (f.values > 1) opt->expected(f.values);
  if (f.check.kind != graphs::ValueCheck::none) opt->check(value_check(f.check));
  if (f.has(graphs::kShowsDefault)) opt->capture_default_str();
  if (!f.type_name.empty()) opt->type_name(std::string(f.type_name));
  return opt;
}

void add_train_flags(CLI::App& cmd, TrainOptions& o) {
  // --config's values come first on the command line; a flag given again overrides them.
  cmd.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  for (const ConfigFlag& f : graphs::config_flags()) {
    // Refused flags are refused by name before parsing (prepare_arguments); `weave predict`
    // registers its own.
    if (f.status == graphs::FlagStatus::refused || f.command != graphs::FlagCommand::train)
      continue;
    CLI::Option* opt = f.status == graphs::FlagStatus::implemented ? add_implemented(cmd, f, o)
                                                                   : add_without_effect(cmd, f, o);
    if (f.status == graphs::FlagStatus::implemented)
      opt->each([&o, name = std::string(f.name)](const std::string&) {
        if (std::find(o.given.begin(), o.given.end(), name) == o.given.end())
          o.given.push_back(name);
      });
    opt->group(std::string(graphs::flag_group_title(f.group)));
  }
  cmd.get_option("--trace-iteration")->each([&o](const std::string&) {
    o.trace_iteration_given = true;
  });
}

}  // namespace weave::cli
