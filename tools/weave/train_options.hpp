// `weave train`'s flags (Megatron-LM's names) and how they become a training run's
// configuration. The command runs the configuration; the flag parser's fuzz target
// (tests/fuzz) parses and validates it without running.
#pragma once

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "weave/devices/cluster.hpp"
#include "weave/graphs/config_flags.hpp"
#include "weave/graphs/trainer_config.hpp"

namespace weave::cli {

// The Debian package `fortunes` (installed by tools/dev) puts its text here.
inline constexpr const char* kDefaultCorpus = "/usr/share/games/fortunes";

struct TrainOptions {
  // global_batch_size 0: micro-batch x data-parallel size
  graphs::TrainerConfig config{.plan = {.global_batch_size = 0}};
  bool swiglu = false;
  bool bf16 = false;        // --bf16
  bool fp16 = false;        // --fp16
  std::string accelerator;  // --accelerator: a preset's name or a JSON file
  // --devices-per-node, --node-link, --network: the cluster's figures over --accelerator's.
  devices::ClusterOverrides cluster;
  std::string position_embedding_type = "learned_absolute";  // or rope, none
  std::string normalization = "LayerNorm";                   // or RMSNorm
  std::string attention_backend = "flash";  // or fused, unfused, local, auto (Megatron-Core's)
  bool cross_entropy_loss_fusion = false;   // --cross-entropy-loss-fusion
  std::string cross_entropy_fusion_impl = "native";  // or te (Megatron-Core's names)
  bool moe_router_pre_softmax = false;
  std::string moe_layer_freq = "1";  // --moe-layer-freq: N or a pattern (moe_layer_freq.hpp)
  std::string moe_token_drop_policy = "probs";              // or position (Megatron-Core's names)
  std::string moe_router_load_balancing_type = "aux_loss";  // or seq_aux_loss, sinkhorn, none
  bool use_rotary_position_embeddings = false, no_position_embedding = false;
  bool group_query_attention = false;
  int num_query_groups = 0;
  bool disable_bias_linear = false;
  // --recompute-granularity (full, selective) and --recompute-method (uniform, block); "": none.
  std::string recompute_granularity, recompute_method;
  bool recompute_activations = false;          // Megatron-LM's shorthand for selective
  std::vector<std::string> recompute_modules;  // --recompute-modules: Megatron-Core's names
  int devices = 0;                             // 0: tp x cp x pp (one data-parallel replica)
  // --data-path's words: a prefix, weight-prefix pairs or a text path; one word holding spaces
  // (from --config) is split into words.
  std::vector<std::string> data_path{kDefaultCorpus};
  std::string data_cache_path;  // --data-cache-path
  bool mock_data = false;
  double valid_fraction = 0.05;
  std::string log_json, dump_graph;
  std::string report;                                       // --report: the step as one HTML page
  std::string graph_filter, graph_level = "auto", what_if;  // --graph-filter, --graph-level
  bool critical_path = false;                               // --critical-path
  // --figure ampipe|pipeline drawn from the step's replay into --figure-out; --layer and
  // --figure-device choose the Ampipe figure's layer and device (-1: not given).
  std::string figure, figure_out;
  int figure_layer = -1, figure_device = -1;
  std::string timing = "wall";
  std::string config_file;  // read before parsing (see prepare_arguments)
  bool ampipe_advise = false;
  bool pipeline_advise = false;
  std::string optimizer = "adam";
  std::string split;  // --split: train,valid,test weights ("" keeps valid_fraction)
  bool trace_iteration_given = false;
  // --rampup-batch-size's three words (Python's int() syntax: 9_765_625 is a number).
  std::vector<std::string> rampup_batch_size;
  bool deepspeed = false;        // --deepspeed
  std::string deepspeed_config;  // --deepspeed_config: DeepSpeed's JSON (sharding_flags.hpp)
  int zero_stage = -1;           // --zero-stage; -1: not given
  bool use_custom_fsdp = false;  // --use-custom-fsdp, --use-megatron-fsdp
  std::string data_parallel_sharding_strategy;  // "": not given
  // The implemented flags the command line (with --config's) gave, by their table names, so
  // that a DeepSpeed file's values fill only what it left out.
  std::vector<std::string> given;
  // Whether `flag` (a table name) is among them.
  bool gave(std::string_view flag) const {
    return std::find(given.begin(), given.end(), flag) != given.end();
  }
  // The DeepSpeed file's fields without effect here, named once when the run starts.
  std::vector<std::string> deepspeed_unhonoured;
  // The flags given that are accepted without effect (graphs/config_flags.hpp), each once.
  std::vector<std::string> no_effect;
  // The last value given to each of them that takes one: MindSpeed's rules read some.
  std::map<std::string, std::string, std::less<>> no_effect_values;
};

// Where a flag of the table without a field of its own writes its value: a setting the program
// keeps for itself (a word it maps onto the configuration, a file it reads or writes).
using ProgramSetting = std::variant<int*, double*, bool*, std::string*, std::vector<std::string>*>;

// Registers the flag table's entry `f` on cmd with `help`, with its names, the check of its value
// and its default: its value goes to `setting` when given, else to its field of `config`.
CLI::Option* add_config_flag(CLI::App& cmd, const graphs::ConfigFlag& f, std::string_view help,
                             graphs::TrainerConfig& config, std::optional<ProgramSetting> setting);

// Registers every flag of `weave train` on cmd from the flag table (graphs/config_flags.hpp),
// each writing into o: implemented flags into o.config's field or o's setting of that name, flags
// without effect into o.no_effect. Refused flags are left to prepare_arguments.
void add_train_flags(CLI::App& cmd, TrainOptions& o);

// The flags' meaning that is the command line's own: --devices sets the data-parallel size, a
// missing --global-batch-size is one micro-batch per replica, --swiglu and --timing are words,
// --split's weights give the validation share, a --trace of a run shorter than the default
// --trace-iteration records its last iteration.
void derive_config(TrainOptions& o);

// The memory of a modelled device in bytes: `given_gib` when > 0 (--device-memory), else the
// --accelerator's, else 80 GiB (the largest common accelerator's).
std::int64_t modelled_device_memory(const TrainOptions& o, double given_gib);

}  // namespace weave::cli
