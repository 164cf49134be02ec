// weave generate: samples text from a checkpoint, under the parallel layout it was saved with.
#include <fmt/format.h>

#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "commands.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/checkpoint.hpp"
#include "weave/graphs/generator.hpp"
#include "weave/graphs/parallel_plan.hpp"
#include "weave/graphs/tokenizer.hpp"

namespace weave::cli {

namespace {

struct GenerateOptions {
  std::string load;
  std::string prompt;
  graphs::SamplingOptions sampling;
};

void generate(const GenerateOptions& o) {
  graphs::SavedConfiguration saved = graphs::read_checkpoint_config(o.load);
  if (saved.processes > 1)
    throw std::runtime_error(fmt::format(
        "checkpoint '{}' was saved by {} processes (mpirun); weave generate runs every rank in one "
        "process and reads one-process checkpoints: save one from a run without mpirun",
        o.load, saved.processes));
  const graphs::ModelConfig& model = saved.model;
  graphs::ParallelPlan plan = saved.plan;
  // One micro-batch per replica and stage: the step only holds the shards here.
  plan.micro_batch_size = 1;
  plan.global_batch_size = plan.data_parallel * plan.pipeline_parallel;
  graphs::validate(model, plan);
  const auto tokenizer = graphs::make_tokenizer({.type = model.tokenizer_type,
                                                 .vocab_file = model.vocab_file,
                                                 .merge_file = model.merge_file});
  const std::vector<std::int32_t> prompt = tokenizer->encode(o.prompt);
  for (const std::int32_t id : prompt)
    if (id >= model.vocab_size)
      throw std::invalid_argument(fmt::format(
          "--prompt holds token {} ({}) and the model's vocabulary has {} tokens: use text the "
          "model was trained on",
          id, tokenizer->type(), model.vocab_size));
  if (prompt.empty()) throw std::invalid_argument("--prompt must hold at least one character");
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  graphs::TrainingStep step(model, plan, {}, set, comm);
  const graphs::CheckpointState state = graphs::load_checkpoint(o.load, model, plan, step);
  graphs::Generator generator(model, plan, step, set, comm);
  fmt::print(stderr,
             "weave generate: {} after {} iterations, {} layers, hidden {}, on {} devices (tp {}, "
             "pp {}, ep {}, cp {}, dp {}), {}\n",
             o.load, state.iteration, model.num_layers, model.hidden_size, plan.devices(),
             plan.tensor_parallel, plan.pipeline_parallel, plan.expert_parallel,
             plan.context_parallel, plan.data_parallel, tokenizer->type());
  std::fwrite(o.prompt.data(), 1, o.prompt.size(), stdout);
  std::fflush(stdout);
  generator.generate(prompt, o.sampling, [&](std::int32_t token) {
    // A byte-level token is whole bytes: each is written as it comes. Ids of the padded
    // vocabulary beyond the tokenizer's have no text.
    if (token < tokenizer->vocab_size()) {
      const std::string text = tokenizer->decode(std::span<const std::int32_t>(&token, 1));
      std::fwrite(text.data(), 1, text.size(), stdout);
    }
    std::fflush(stdout);
    return true;
  });
  std::fputc('\n', stdout);
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto options = std::make_shared<GenerateOptions>();
  CLI::App* cmd = app.add_subcommand(
      "generate",
      "Sample text from a checkpoint, decoding with a key/value cache under the parallel layout "
      "it was saved with");
  cmd->footer(
      "Example:\n  weave train --save model.ckpt --train-iters 300\n"
      "  weave generate --load model.ckpt --prompt \"The \" --max-new-tokens 80 --top-k 5");
  cmd->add_option("--load", options->load, "Checkpoint to sample from (weave train --save)")
      ->required();
  cmd->add_option("--prompt", options->prompt,
                  "Text the sample continues, tokenised by the checkpoint's tokenizer")
      ->required();
  cmd->add_option("--max-new-tokens", options->sampling.max_new_tokens, "Tokens to sample")
      ->check(at_least(0))
      ->capture_default_str();
  cmd->add_option("--temperature", options->sampling.temperature,
                  "Softmax temperature; 0: always the most likely token")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--top-k", options->sampling.top_k,
                  "Sample among the k most likely tokens; 0: among all")
      ->check(at_least(0))
      ->capture_default_str();
  cmd->add_option("--seed", options->sampling.seed, "Seed of the sampling draws")
      ->capture_default_str();
  cmd->callback([options] { generate(*options); });
}

}  // namespace weave::cli
