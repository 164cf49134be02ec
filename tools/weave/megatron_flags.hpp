// Megatron-LM's and MindSpeed's flags that `weave train` does not implement but that training
// scripts carry: those accepted without effect (they name a kernel, a backend, a logger or a file
// format that has no counterpart here, so the run is the same without them) and those refused
// (they would change what is trained in a way weave cannot). docs/flags.md lists them beside the
// implemented ones, each with the reason given here; a test keeps the two in agreement.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace weave::cli {

struct MegatronFlag {
  std::string_view name;  // "--transformer-impl"
  int values;             // how many values follow it on a command line (0: a switch)
  std::string_view why;   // why it has no effect, or why it is refused and what to do instead
};

// Accepted, parsed (with their values) and reported once in a line "no effect here: ...".
std::span<const MegatronFlag> no_effect_flags();
// Refused before anything runs, each with its reason.
std::span<const MegatronFlag> refused_flags();

// The refusal of `flag` by `weave command` ("--bf16 is refused: ..."), or nothing when the flag
// is not one of refused_flags() or the command is neither `train` nor `predict` (which registers
// the refused flags it models, so that they are never refused there).
std::optional<std::string> refusal(std::string_view command, std::string_view flag);

}  // namespace weave::cli
