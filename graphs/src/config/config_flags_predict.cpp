// `weave predict`'s own flags: the memory a modelled device has, which ranks are replayed and
// traced, and the search of the parallel plans that replaces one prediction. `weave train` has
// none of them; `weave predict` takes these beside `weave train`'s.
#include "config/config_flag_groups.hpp"

namespace weave::graphs::flag_groups {

namespace {

constexpr ConfigFlag kPrediction[] = {
    {.name = "--device-memory",
     .group = FlagGroup::prediction,
     .command = FlagCommand::predict,
     .help = "GiB of memory a device has (default: the --accelerator's, else 80): devices that "
             "would need more are named",
     .check = kPositive,
     .properties = kShowsDefault},
    {.name = "--trace-ranks",
     .group = FlagGroup::prediction,
     .command = FlagCommand::predict,
     .help = "With --trace: write only these ranks' replay, as a list of ranks and ranges "
             "(0-7,64); a folded data-parallel replica's ranks need --every-rank"},
    // Left out of the best plan's command: the search replays folded, and the figures are the
    // same either way.
    {.name = "--every-rank",
     .group = FlagGroup::prediction,
     .command = FlagCommand::predict,
     .values = 0,
     .help = "Build and replay every rank and micro-batch instead of folding data-parallel "
             "replicas, tensor- and context-parallel peers into the first and extrapolating "
             "micro-batches (slower, the same figures; --trace and the step views build every "
             "rank of the first replica and every micro-batch)",
     .properties = kNotRepeatedByAdvice},
    {.name = "--json",
     .group = FlagGroup::prediction,
     .command = FlagCommand::predict,
     .values = 0,
     .help = "Print the prediction as one JSON object instead of text: the step, throughput, MFU, "
             "bubble, exposed communication by group, compute time by kind (products, attention, "
             "elementwise, optimizer) and peak memory",
     .properties = kNotRepeatedByAdvice},
    {.name = "--advise",
     .group = FlagGroup::advice,
     .command = FlagCommand::predict,
     .values = 0,
     .help = "Instead of one prediction: predict every parallel plan over --devices (tp dividing "
             "the heads and query groups, at most a node's devices with a modelled cluster; pp "
             "dividing the layers; cp where the sequence allows; ep dividing the experts; dp the "
             "rest, dividing --global-batch-size; for pp > 1 1f1b, interleaved and zb-h1; Ampipe "
             "degree 1 and 2 with MoE; recomputation none or full uniform 1; "
             "--sequence-parallel with tp > 1), discard what the rules refuse (counted by "
             "reason) and what does not fit --device-memory, and print the fastest with the "
             "flags that run the best",
     .properties = kNotRepeatedByAdvice},
    {.name = "--advise-top",
     .group = FlagGroup::advice,
     .command = FlagCommand::predict,
     .help = "With --advise: the plans printed",
     .check = at_least(1),
     .properties = kShowsDefault | kNotRepeatedByAdvice},
    {.name = "--advise-limit",
     .group = FlagGroup::advice,
     .command = FlagCommand::predict,
     .help = "With --advise: the most candidates predicted, those that build the fewest ranks "
             "first; the rest are counted",
     .check = at_least(1),
     .properties = kShowsDefault | kNotRepeatedByAdvice},
    {.name = "--advise-memory-budget",
     .group = FlagGroup::advice,
     .command = FlagCommand::predict,
     .help = "With --advise: GiB the candidates predicted side by side may hold together, each "
             "estimated before it is built from the tasks its step builds (default: the memory "
             "this machine has available); one runs alone whatever its estimate",
     .check = kPositive,
     .properties = kNotRepeatedByAdvice},
};

}  // namespace

std::span<const ConfigFlag> prediction_flags() {
  return kPrediction;
}

}  // namespace weave::graphs::flag_groups
