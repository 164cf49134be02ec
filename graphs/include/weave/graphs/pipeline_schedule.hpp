// A pipeline-parallel schedule as data: for each rank, the ordered compute actions it runs.
//
// p ranks hold p * v pipeline stages (v chunks, or virtual stages, per rank) and run m
// micro-batches through them. Only compute is listed: a stage's output always goes to the next
// stage's rank and its input gradient to the previous stage's rank, so every send and receive
// follows from the layout and need not be stored (lower_transfers in pipeline_transfers.hpp
// places them).
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace weave::graphs {

// A parameter or input that breaks a schedule rule. The message names the rule, the values and
// what to change.
class ScheduleError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

enum class ActionType {
  Forward,         // F: the forward of one micro-batch through one chunk
  Backward,        // B: the full backward (input and weight gradients together)
  BackwardInput,   // I: the input-gradient half of a split backward (zero-bubble's "B")
  BackwardWeight,  // W: the weight-gradient half, which nothing downstream waits for
  Idle,            // a deliberate idle slot (an empty cell in a hand-written schedule)
};

// The letter of the text form: F, B, I, W, or '.' for an idle slot.
char action_letter(ActionType type);

struct Action {
  ActionType type = ActionType::Forward;
  int micro_batch = 0;
  int chunk = 0;  // which of the rank's v stages

  bool operator==(const Action&) const = default;
};

// Where the stages sit. Interleaved: rank r holds stages r, r + p, ..., r + (v - 1) p, so a
// micro-batch passes every rank v times in the same direction. V (zero-bubble ZB-V, v = 2):
// rank r holds stages r and 2p - 1 - r, so rank 0 holds the first and the last stage.
enum class StageLayout { Interleaved, V };

struct PipelineSchedule {
  std::string name;  // the generator's name, e.g. "1f1b", or where it was read from
  int ranks = 1;
  int micro_batches = 1;
  int chunks = 1;
  StageLayout layout = StageLayout::Interleaved;
  std::vector<std::vector<Action>> actions;  // per rank, in the order the rank runs them

  int stages() const { return ranks * chunks; }
  // The global stage number of `chunk` on `rank`.
  int stage(int rank, int chunk) const;
  // The rank and chunk that hold global `stage`.
  int rank_of(int stage) const;
  int chunk_of(int stage) const;
  // The number of compute actions (idle slots excluded) over all ranks.
  int compute_actions() const;
};

// The short form used in the reference's orders: type letter, micro-batch, then one prime per
// chunk after the first ("F3" chunk 0, "B3'" chunk 1, "W3''" chunk 2); "." for idle.
std::string to_string(const Action& action);

// The stage-prefixed form of PyTorch's text and of the CSV files: "2F0" is stage 2's forward of
// micro-batch 0; "" for idle.
std::string to_stage_string(const PipelineSchedule& schedule, int rank, const Action& action);

// One rank's actions in the short form, separated by single spaces.
std::string format_rank(const PipelineSchedule& schedule, int rank);

// The text view: one line per rank, "r0: F0 F1 ...".
std::string format_schedule(const PipelineSchedule& schedule);

}  // namespace weave::graphs
