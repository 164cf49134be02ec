// Checkpoints of a training step's model shards: parameters, model state (ModelState: the
// routers' expert biases) and optimizer state of every device, with the configuration they
// belong to.
//
// One file, written atomically (to "<path>.partial", flushed to disk, then renamed), so a save
// interrupted by an error, a killed process or a power loss never leaves a damaged checkpoint
// where a good one was (tests/graphs/checkpoint_crash_test kills savers). Loading checks the
// format, the model and parallel configuration, every parameter's name and shape and a checksum,
// and changes nothing unless all of it matches; a damaged header is reported as damage.
//
// A step spread over processes (TrainingStep::processes) saves one part per process, each
// holding its ranks' shards ("<path>.part<k>-of-<P>.iter<N>", written atomically), then process
// 0 writes <path> as a manifest naming the parts and their checksums, and only then are older
// parts removed: <path> always names a complete set. Every process makes the call; <path> must
// be on a file system they all reach. Loading with another process count is refused, naming
// both counts, by every process alike; a part that cannot be loaded fails every process.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "weave/graphs/loss_scaler.hpp"
#include "weave/graphs/training_step.hpp"

namespace weave::graphs {

struct CheckpointState {
  std::int64_t iteration = 0;  // iterations completed
  std::uint64_t consumed_samples = 0;
  // Of those, the iterations a loss scaler skipped (found_inf) and their samples: the learning
  // rate schedule and AdamW's step count advance on updates only, as in Megatron-LM.
  std::int64_t skipped_iterations = 0;
  std::uint64_t skipped_samples = 0;
  // The run's loss scaler, if it has one (saved with the precision that made it).
  std::optional<LossScalerState> loss_scaler;
};

void save_checkpoint(const std::string& path, const ModelConfig& model, const ParallelPlan& plan,
                     TrainingStep& step, const CheckpointState& state);

// Throws std::runtime_error naming what does not match (and the fix) for a missing, damaged or
// mismatched file; the step's state is untouched then.
CheckpointState load_checkpoint(const std::string& path, const ModelConfig& model,
                                const ParallelPlan& plan, TrainingStep& step);

// Copies what a checkpoint holds (every built rank's parameters, model state and AdamW moments)
// from `from` into `to`, a step of the same model and layout built for another global batch (a
// batch ramp-up's next step), so that `to` continues bitwise where `from` stopped. Throws
// std::invalid_argument when their ranks or tensors differ.
void copy_checkpointed_state(TrainingStep& from, TrainingStep& to);

// What a checkpoint was saved with: the model, the parallel layout (its saved fields; the rest
// as ParallelPlan's defaults), the processes that saved it and how far training had come. Reads
// the header only. Throws std::runtime_error for a missing or damaged file.
struct SavedConfiguration {
  ModelConfig model;
  ParallelPlan plan;
  int processes = 1;
  CheckpointState state;
};
SavedConfiguration read_checkpoint_config(const std::string& path);

}  // namespace weave::graphs
