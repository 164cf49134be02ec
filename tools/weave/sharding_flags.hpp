// DeepSpeed's and Megatron-Core's names for sharded data parallelism, and the DeepSpeed
// configuration file, onto weave's configuration: --zero-stage, --use-custom-fsdp with
// --data-parallel-sharding-strategy, --deepspeed with --deepspeed_config FILE. weave shards the
// optimizer state over the data-parallel group (its distributed optimizer: ZeRO stage 1, the
// "optim" strategy), the gradients beside it (stage 2, "optim_grads") and the parameters too
// (stage 3, "optim_grads_params").
#pragma once

#include <string>
#include <vector>

#include "train_options.hpp"

namespace weave::cli {

// Reads --deepspeed_config (with --deepspeed) and applies it and the sharding flags to
// o.config, after the data-parallel size is known: each JSON value weave maps is set where the
// command line left the flag out and checked where it gave it (a disagreement is refused naming
// both), DeepSpeed's batch rule (train_batch_size = train_micro_batch_size_per_gpu x
// gradient_accumulation_steps x data-parallel size) checked as DeepSpeed checks it, the fields
// that would change what is trained refused in one error, and those without effect here listed in
// o.deepspeed_unhonoured. Throws graphs::ConfigError naming the rule and the fix.
void apply_sharding_flags(TrainOptions& o);

}  // namespace weave::cli
