#include "weave/graphs/pipeline_transfers.hpp"

#include <fmt/format.h>

#include <cstddef>
#include <optional>
#include <stdexcept>
#include <utility>

namespace weave::graphs {

namespace {

// Cells are (stage, micro-batch) pairs, numbered stage-major.
std::size_t cell_of(const PipelineSchedule& s, int stage, int micro_batch) {
  return static_cast<std::size_t>(stage * s.micro_batches + micro_batch);
}

bool makes_input_gradient(ActionType type) {
  return type == ActionType::Backward || type == ActionType::BackwardInput;
}

// The cell whose output `a` on `stage` waits for from another stage, if any: the previous
// stage's forward for a forward, the next stage's input gradient for a full or input-gradient
// backward.
std::optional<std::size_t> input_cell(const PipelineSchedule& s, const Action& a, int stage) {
  if (a.type == ActionType::Forward && stage > 0) return cell_of(s, stage - 1, a.micro_batch);
  if (makes_input_gradient(a.type) && stage + 1 < s.stages())
    return cell_of(s, stage + 1, a.micro_batch);
  return std::nullopt;
}

// What `a` on `stage` sends to a neighbouring stage, if anything: a forward's output to the next
// stage, a full or input-gradient backward's input gradient to the previous one.
std::optional<StageTransfer> output_of(const PipelineSchedule& s, const Action& a, int rank,
                                       int stage) {
  int to = -1;
  TransferDirection direction = TransferDirection::Activations;
  if (a.type == ActionType::Forward && stage + 1 < s.stages()) {
    to = stage + 1;
  } else if (makes_input_gradient(a.type) && stage > 0) {
    to = stage - 1;
    direction = TransferDirection::Gradients;
  }
  if (to < 0) return std::nullopt;
  return StageTransfer{.direction = direction,
                       .micro_batch = a.micro_batch,
                       .from_stage = stage,
                       .to_stage = to,
                       .from_rank = rank,
                       .to_rank = s.rank_of(to)};
}

// The pass: each action's receive before it, the action, and its send after it. Per cell, the
// transfer its forward and its gradient-making backward send.
class TransferPlacement {
 public:
  explicit TransferPlacement(const PipelineSchedule& s)
      : s_(s),
        activations_(static_cast<std::size_t>(s.stages() * s.micro_batches), -1),
        gradients_(activations_.size(), -1) {}

  LoweredPipeline run() {
    for (const ScheduledAction& at : emission_order(s_))
      place(at, s_.actions[static_cast<std::size_t>(at.rank)][static_cast<std::size_t>(at.index)]);
    return std::move(out_);
  }

 private:
  void place(const ScheduledAction& at, const Action& a) {
    if (a.type == ActionType::Idle) {
      out_.steps.push_back({LoweredStepType::Compute, at});
      return;
    }
    const int stage = s_.stage(at.rank, a.chunk);
    if (const auto input = input_cell(s_, a, stage)) {
      const int transfer = (a.type == ActionType::Forward ? activations_ : gradients_)[*input];
      if (transfer < 0) throw std::logic_error("emission_order placed an action before its input");
      out_.steps.push_back({LoweredStepType::Receive, at, transfer});
    }
    out_.steps.push_back({LoweredStepType::Compute, at});
    if (const auto output = output_of(s_, a, at.rank, stage)) {
      const int transfer = static_cast<int>(out_.transfers.size());
      out_.transfers.push_back(*output);
      const std::size_t own = cell_of(s_, stage, a.micro_batch);
      (a.type == ActionType::Forward ? activations_ : gradients_)[own] = transfer;
      out_.steps.push_back({LoweredStepType::Send, at, transfer});
    }
  }

  const PipelineSchedule& s_;
  std::vector<int> activations_, gradients_;
  LoweredPipeline out_;
};

}  // namespace

std::vector<ScheduledAction> emission_order(const PipelineSchedule& s) {
  const auto cells = static_cast<std::size_t>(s.stages() * s.micro_batches);
  std::vector<bool> forward_done(cells, false), gradient_done(cells, false);
  // Whether the input `a` waits for from another stage is there.
  auto ready = [&](const Action& a, int stage) {
    const auto input = input_cell(s, a, stage);
    if (!input) return true;
    return static_cast<bool>(a.type == ActionType::Forward ? forward_done[*input]
                                                           : gradient_done[*input]);
  };
  std::vector<ScheduledAction> order;
  std::vector<std::size_t> next(static_cast<std::size_t>(s.ranks), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < s.ranks; ++r) {
      const auto& list = s.actions[static_cast<std::size_t>(r)];
      while (next[r] < list.size()) {
        const Action& a = list[next[r]];
        if (a.type != ActionType::Idle) {
          const int stage = s.stage(r, a.chunk);
          if (!ready(a, stage)) break;
          if (a.type == ActionType::Forward) forward_done[cell_of(s, stage, a.micro_batch)] = true;
          if (makes_input_gradient(a.type)) gradient_done[cell_of(s, stage, a.micro_batch)] = true;
        }
        order.push_back({r, static_cast<int>(next[r])});
        ++next[r];
        progress = true;
      }
    }
  }
  for (int r = 0; r < s.ranks; ++r)
    if (next[r] != s.actions[static_cast<std::size_t>(r)].size())
      throw ScheduleError(
          fmt::format("cannot order schedule '{}': rank {} cannot get past step {}; check it with "
                      "simulate_schedule (weave schedule --load-csv) first",
                      s.name, r, next[r]));
  return order;
}

LoweredPipeline lower_transfers(const PipelineSchedule& schedule) {
  return TransferPlacement(schedule).run();
}

}  // namespace weave::graphs
