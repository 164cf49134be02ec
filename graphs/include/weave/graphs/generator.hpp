// Sampling text from a trained model under the parallel layout it was trained with.
//
// Every device of the layout decodes: one token a step, each layer's keys and values kept in a
// cache on the device that holds the layer's heads, so a step attends to the cache instead of
// recomputing the sequence. Tensor-parallel ranks hold their heads, MLP columns and vocabulary
// shard (their partial sums all-reduced, the logits all-gathered); expert-parallel ranks each
// run the experts they hold for the token and the expert group sums the weighted outputs;
// pipeline stages pass the hidden state on, and the last stage's sampled token is broadcast to
// every stage, as MindSpore's pipeline inference does. Data- and context-parallel replicas
// decode the same tokens side by side (they hold the same weights; expert groups span them).
// Sequence parallelism has nothing to split in a one-token step: its ranks all-reduce instead.
// Dropout is off.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "weave/devices/communicator.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/graphs/model_config.hpp"
#include "weave/graphs/parallel_plan.hpp"
#include "weave/graphs/training_step.hpp"

namespace weave::graphs {

struct SamplingOptions {
  int max_new_tokens = 64;
  double temperature = 1.0;  // 0: always the most likely token
  int top_k = 0;             // sample among the k most likely tokens; 0: among all
  std::uint64_t seed = 1234;
};

class Generator {
 public:
  // Decodes with the parameters of `step`'s shards (loaded from a checkpoint, say), on its
  // devices. `plan` must have passed validate() and be the step's. Every rank must be built in
  // this process.
  Generator(const ModelConfig& model, const ParallelPlan& plan, TrainingStep& step,
            devices::DeviceSet& devices, devices::Communicator& comm);
  ~Generator();
  Generator(const Generator&) = delete;
  Generator& operator=(const Generator&) = delete;

  // The longest prompt plus new tokens: the model's positions (--max-position-embeddings).
  int max_length() const;

  // Clears the cache and feeds `prompt` (at least one token), then samples up to
  // options.max_new_tokens tokens, each passed to on_token (return false to stop). Returns the
  // sampled tokens. Throws std::invalid_argument for an empty prompt, a token outside the
  // vocabulary, a length beyond max_length() or bad options.
  std::vector<std::int32_t> generate(std::span<const std::int32_t> prompt,
                                     const SamplingOptions& options,
                                     const std::function<bool(std::int32_t)>& on_token = {});

  // One step: appends `token` at the next position and returns the next-token logits over the
  // padded vocabulary (ModelConfig::padded_vocab_size entries, the ones a training step's loss
  // normalises over; sampling draws from the first vocab_size), as the last stage computed them.
  // For tests and scoring.
  std::vector<float> feed(std::int32_t token);
  // Empties the cache: the next token fed is at position 0.
  void reset();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The token `options` draw from `logits` for the step at `position` (a pure function of them:
// the same on every rank that holds the logits).
std::int32_t sample_token(std::span<const float> logits, const SamplingOptions& options,
                          std::int64_t position);

}  // namespace weave::graphs
