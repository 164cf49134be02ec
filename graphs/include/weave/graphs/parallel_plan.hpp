// How a model is split over devices: Megatron's parallel sizes, checked against the model.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "weave/graphs/model_config.hpp"

namespace weave::graphs {

struct ParallelPlan {
  int tensor_parallel = 1;         // --tensor-model-parallel-size
  bool sequence_parallel = false;  // --sequence-parallel
  int context_parallel = 1;        // --context-parallel-size
  int expert_parallel = 1;         // --expert-model-parallel-size
  int data_parallel = 1;           // devices / (tp * cp * pp)
  int pipeline_parallel = 1;       // --pipeline-model-parallel-size
  // Model chunks (virtual stages) per pipeline rank: --virtual-pipeline-model-parallel-size, or
  // derived by validate() from --num-layers-per-virtual-pipeline-stage (layers_per_virtual_stage).
  int virtual_pipeline = 1;
  int layers_per_virtual_stage = 0;
  // --pipeline-scheduler: gpipe, 1f1b, interleaved, interleaved-mem, zb-h1, zb-v; empty: 1f1b,
  // or interleaved with virtual stages.
  std::string pipeline_scheduler;
  int microbatch_group_size = 0;  // --microbatch-group-size-per-virtual-pipeline-stage (0: pp)
  // --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers: the layers of the
  // first and last model chunk (0: an even split), so the stages holding the embedding and the
  // loss can take fewer.
  int first_stage_layers = 0;
  int last_stage_layers = 0;
  int micro_batch_size = 1;            // --micro-batch-size
  int global_batch_size = 1;           // --global-batch-size
  bool distributed_optimizer = false;  // --use-distributed-optimizer: shard optimizer state over dp
  int ampipe_degree = 1;  // --ampipe-degree: sequence chunks of the attention-to-MoE region
  // --ampipe-tp-sp-comm-overlap: pipeline the experts' tensor-parallel collectives (validate()
  // switches it off with a warning: weave's experts are not tensor-parallel).
  bool ampipe_tp_sp_comm_overlap = false;
  // --use-pipe-experts: each MoE slot's work as items (local expert x capacity slice), each with
  // its own dispatch and combine all-to-all, so one item's experts run while another's rows move.
  bool pipe_experts = false;
  bool pipe_experts_multi_stream = false;  // --pipe-experts-multi-stream: dispatch, combine apart
  int pipe_experts_multi_data = 1;  // --pipe-experts-multi-data N: capacity slices (N / degree)

  int devices() const {
    return tensor_parallel * context_parallel * data_parallel * pipeline_parallel;
  }
  // Micro-batches each data-parallel rank runs per step.
  int micro_batches() const { return global_batch_size / (micro_batch_size * data_parallel); }
  // Capacity slices per local expert in each MoE slot under --use-pipe-experts.
  int pipe_experts_slices() const { return pipe_experts_multi_data / ampipe_degree; }
};

// The most devices a plan may span (tensor x context x data x pipeline parallel): far beyond
// any machine weave lays out or replays, and small enough that sizes multiplied by it fit an
// int.
inline constexpr int kMaxDevices = 1 << 20;

// A configuration that breaks one of the size rules. The message names the rule, the values and
// the flag to change.
class ConfigError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Checks every size rule and returns the warnings (e.g. sequence parallelism switched off at
// tp = 1, as Megatron does, which also clears plan.sequence_parallel). Throws ConfigError for
// the first rule broken. Sizes are checked before they are multiplied, so no value overflows.
std::vector<std::string> validate(const ModelConfig& model, ParallelPlan& plan);

}  // namespace weave::graphs
