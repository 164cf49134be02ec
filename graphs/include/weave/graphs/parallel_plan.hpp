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
  // --expert-tensor-parallel-size: 1 keeps every expert whole on one rank (expert-parallel
  // groups folded over tp x cp x dp); tp splits each expert over the tensor-parallel group (fc1
  // by columns, fc2 by rows) with expert-parallel groups of ranks that share a tensor-parallel
  // rank: MindSpeed's deepspeed_moe layout, which --moe-model-type deepspeed_moe selects.
  int expert_tensor_parallel = 1;
  std::string moe_model_type;  // --moe-model-type: "", megatron_moe or megatron (experts
                               // whole), deepspeed_moe
  int data_parallel = 1;       // devices / (tp * cp * pp)
  int pipeline_parallel = 1;   // --pipeline-model-parallel-size
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
  // ZeRO stage 2 (--zero-stage 2, --data-parallel-sharding-strategy optim_grads; needs
  // distributed_optimizer): each replica keeps only its shard of the gradients. Every
  // micro-batch's layer buckets are reduce-scattered as the backward completes them and
  // accumulated into the shard, as DeepSpeed's stage 2 does; the full buckets are written into a
  // few gradient slots shared by the layers in turn (ModelShard::kGradientSlots).
  bool shard_gradients = false;
  // ZeRO stage 3 (--zero-stage 3, optim_grads_params; needs shard_gradients): each replica keeps
  // only its shard of the layers' parameters. A layer's are all-gathered into one of
  // zero_units_in_flight parameter slots before its forward and again before its backward, the
  // gathers of the layers the pass reaches next issued (prefetched) beside them; a slot is
  // gathered into again once the layer that held it is done with it.
  bool shard_parameters = false;
  // --zero-units-in-flight (ZeRO stage 3): the layers whose gathered parameters a device holds at
  // once, the one computing and the zero_units_in_flight - 1 next ones, whose gathers run under
  // its compute. 1 gathers each layer only once the previous one is done with its slot.
  int zero_units_in_flight = 2;
  // --overlap-grad-reduce: each bucket's data-parallel gradient reduction starts once the
  // backward has produced its gradients, overlapping the rest of the backward (under 1F1B without
  // virtual stages on the first pipeline stage only, as Megatron-LM's default --delay-grad-reduce
  // has it: the later stages reduce after their last backward). Without it (as in
  // Megatron-LM, whose finish_grad_sync then starts the reductions) they wait for the rank's last
  // backward task.
  bool overlap_grad_reduce = false;
  // --overlap-param-gather (with the distributed optimizer and overlap_grad_reduce, as
  // Megatron-LM requires): the updated shards are gathered at the start of the next step, each
  // layer's forward waiting for its bucket's gather only, instead of after the update
  // (TrainingStep::parameter_gather_graph gathers them after the last step).
  bool overlap_param_gather = false;
  // --tp-comm-overlap (with sequence parallelism): the dense layers' sequence-parallel
  // all-gathers before a column-parallel product and reduce-scatters after a row-parallel one
  // run in pieces, each pipelined with the product's rows it feeds or that feed it, as
  // Transformer Engine's userbuffer overlaps do for Megatron-Core (see tp_comm_overlap.hpp).
  bool tp_comm_overlap = false;
  int ampipe_degree = 1;  // --ampipe-degree: sequence chunks of the attention-to-MoE region
  // --ampipe-tp-sp-comm-overlap: pipeline the split experts' tensor-parallel collectives over
  // (chunk, local expert) items, with or without SP (validate() switches it off, with a warning
  // naming what is missing, unless the experts are split and EP > 1).
  bool ampipe_tp_sp_comm_overlap = false;
  // --ampipe-cp-resend-kv: under context parallelism, send the key/value blocks round the ring
  // again in backward instead of keeping every block from forward: each layer and micro-batch
  // in flight keeps its own block only ((cp - 1) / cp of the blocks' memory saved), for cp - 1
  // more ring steps per layer that run under the MoE backward.
  bool ampipe_cp_resend_kv = false;
  // --use-pipe-experts: each MoE slot's work as items (local expert x capacity slice), each with
  // its own dispatch and combine all-to-all, so one item's experts run while another's rows move.
  bool pipe_experts = false;
  // --pipe-experts-multi-stream: the items' all-to-alls and tensor-parallel all-gathers and
  // reduce-scatters chained in one strict order on two streams, so expert- and tensor-parallel
  // traffic never share the links at once; needs --sequence-parallel and split experts. weave
  // keeps the order under Ampipe too; MindSpeed chains each item's dispatch after the previous
  // item's gather only without Ampipe (under Ampipe its dispatches are issued unchained).
  bool pipe_experts_multi_stream = false;
  // --pipe-experts-separate-streams (weave's): the items' dispatches and combines on streams of
  // their own (ep_dispatch, ep_combine), so a combine never waits behind a dispatch.
  bool pipe_experts_separate_streams = false;
  // --pipe-experts-multi-data N: each slot's local experts cut into N / degree capacity slices.
  int pipe_experts_multi_data = 1;

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

// Derives what the flags imply (e.g. virtual stages from --num-layers-per-virtual-pipeline-stage)
// and switches off what cannot apply (e.g. sequence parallelism at tp = 1, as Megatron does,
// which clears plan.sequence_parallel), then checks every size rule; returns the warnings. Throws
// ConfigError for the first rule broken and then leaves plan as it was. Sizes are checked before
// they are multiplied, so no value overflows.
std::vector<std::string> validate(const ModelConfig& model, ParallelPlan& plan);

}  // namespace weave::graphs
