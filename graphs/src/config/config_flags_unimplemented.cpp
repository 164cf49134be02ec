// Megatron-LM's and MindSpeed's flags that weave does not implement but that training scripts
// carry, and weave's own older ones: those accepted without effect (they name a kernel, a
// backend, a logger or a file format that has no counterpart here, so the run is the same without
// them) and those refused (they would change what is trained in a way weave cannot), each with
// the reason. weave predict models some of the refused ones (kModelledByPredict).
#include "config/config_flag_groups.hpp"

namespace weave::graphs::flag_groups {

namespace {

// A flag accepted without effect, with the values that follow it and why it has none.
constexpr ConfigFlag without_effect(std::string_view name, int values, std::string_view why,
                                    unsigned properties = 0) {
  return {.name = name,
          .group = FlagGroup::not_implemented,
          .status = FlagStatus::no_effect,
          .values = values,
          .help = why,
          .properties = properties};
}

// A flag refused, with the values that follow it, why, and what to do instead.
constexpr ConfigFlag refused(std::string_view name, int values, std::string_view why) {
  return {.name = name,
          .group = FlagGroup::not_implemented,
          .status = FlagStatus::refused,
          .values = values,
          .help = why};
}

constexpr std::string_view kFusion =
    "a kernel fusion switch: weave's kernels are its own and compute the same values either way";
constexpr std::string_view kAmpipeRule =
    "a MindSpeed memory or pipeline switch for NPUs: the run is the same without it (refused "
    "beside --ampipe-degree, as MindSpeed does)";
constexpr std::string_view kLoggers =
    "weave writes no TensorBoard or Weights & Biases logs: --log-json writes every iteration's "
    "metrics as JSON lines";
constexpr std::string_view kReports =
    "the progress line and --log-json report what weave measures (tokens/s, grad norm, exposed "
    "communication, pipeline bubble)";
constexpr std::string_view kTokenizerModel =
    "weave's tokenizers (--tokenizer-type GPT2BPETokenizer, ByteTokenizer) read no "
    "SentencePiece or Hugging Face model";
constexpr std::string_view kDataLoader =
    "weave reads --data-path itself, memory-mapped in the training process: there is no "
    "dataloader to configure";
constexpr std::string_view kDocuments =
    "weave neither masks the loss nor resets positions or attention at end-of-document tokens: "
    "the run is the one Megatron makes without it";
constexpr std::string_view kCheckpoints =
    "weave writes its own checkpoint format, one file written atomically when --save is due";
constexpr std::string_view kRandomness =
    "weave's randomness is keyed by the seed and the iteration: a checkpoint needs no generator "
    "state";
constexpr std::string_view kTpOverlap =
    "tensor-parallel collectives are tasks on their group's stream: they overlap the compute "
    "wherever the data allows";
constexpr std::string_view kMoeOverlap =
    "MoE all-to-alls are tasks on their group's stream: they overlap the compute wherever the "
    "data allows";
constexpr std::string_view kContextParallel =
    "context parallelism is ring attention, key/value blocks passed round the ring by send and "
    "receive (Megatron's p2p, MindSpeed's megatron_cp_algo)";
constexpr std::string_view kContextParallelAlgo =
    "context parallelism is ring attention whichever algorithm is named (MindSpeed's "
    "megatron_cp_algo); MindSpeed's rules are kept: one of its five algorithms, and "
    "megatron_cp_algo with --ampipe-degree > 1 under --context-parallel-size > 1";
constexpr std::string_view kDeterministic =
    "weave's runs are always deterministic: the same flags give bitwise the same losses";
constexpr std::string_view kPython = "Python memory management: weave has none to tune";
constexpr std::string_view kImplementation =
    "weave has one implementation of the model, its own CPU kernels: the flag chooses among "
    "Megatron's GPU implementations";
constexpr std::string_view kBackend =
    "collectives go through shared memory (or MPI under mpirun), not NCCL or Gloo";

// --ampipe-advise-fast once skipped the kernels of --ampipe-advise's replays; none run now.
constexpr std::string_view kFastAmpipeAdvice =
    "accepted for old scripts: --ampipe-advise always predicts without running the kernels now, "
    "all-to-alls timed as for balanced routing";

constexpr ConfigFlag kNoEffect[] = {
    without_effect("--use-flash-attn", 0, "attention is always blockwise with online softmax here"),
    without_effect("--ampipe-advise-fast", 0, kFastAmpipeAdvice, kNotRepeatedByAdvice),
    without_effect("--use-mcore-models", 0, kImplementation),
    without_effect("--use-legacy-models", 0, kImplementation),
    without_effect("--transformer-impl", 1, kImplementation),
    without_effect("--distributed-backend", 1, kBackend),
    without_effect(
        "--deepspeed-activation-checkpointing", 0,
        "Megatron-DeepSpeed then runs the recomputation --checkpoint-activations or "
        "--recompute-granularity full asks for with DeepSpeed's checkpoint function; weave's "
        "recomputation is its own: --recompute-granularity full --recompute-method uniform "
        "--recompute-num-layers N (its --checkpoint-num-layers) recomputes the same groups of "
        "layers"),
    without_effect("--DDP-impl", 1,
                   "gradients are reduced by weave's own tasks (after the backward, or during it "
                   "with --overlap-grad-reduce)"),
    without_effect("--distributed-timeout-minutes", 1,
                   "weave's collectives have no process-group timeout"),
    without_effect("--no-masked-softmax-fusion", 0, kFusion),
    without_effect("--no-bias-gelu-fusion", 0, kFusion),
    without_effect("--no-bias-dropout-fusion", 0, kFusion),
    without_effect("--no-bias-swiglu-fusion", 0, kFusion),
    without_effect("--no-rope-fusion", 0, kFusion),
    without_effect("--no-gradient-accumulation-fusion", 0, kFusion),
    without_effect("--moe-grouped-gemm", 0, kFusion),
    without_effect("--moe-permute-fusion", 0, kFusion),
    without_effect("--use-fused-rmsnorm", 0, kFusion),
    without_effect("--use-fused-swiglu", 0, kFusion),
    without_effect("--use-fused-rotary-pos-emb", 0, kFusion),
    without_effect("--use-fused-ring-attention-update", 0, kFusion),
    without_effect("--attention-softmax-in-fp32", 0,
                   "the softmax computes in fp32 in every precision here"),
    without_effect("--accumulate-allreduce-grads-in-fp32", 0,
                   "gradients are accumulated and reduced in fp32 in every precision here"),
    without_effect(
        "--reuse-fp32-param", 0,
        "MindSpeed's memory saving for bf16 runs (its optimizer frees the fp32 parameter "
        "copies); weave keeps fp32 main parameters and their bf16 copies apart"),
    without_effect("--apply-query-key-layer-scaling", 0,
                   "a guard against fp16 overflow of the attention scores, which are fp32 in "
                   "every precision here: the attention is the same"),
    without_effect("--use-nanopipe", 0, kAmpipeRule, kRefusedBesideAmpipe),
    without_effect("--recompute-in-bubble", 0, kAmpipeRule, kRefusedBesideAmpipe),
    without_effect("--recompute-in-advance", 0, kAmpipeRule, kRefusedBesideAmpipe),
    without_effect("--adaptive-recompute-device-swap", 0, kAmpipeRule, kRefusedBesideAmpipe),
    without_effect("--swap-attention", 0,
                   "a MindSpeed memory switch for NPUs: the run is the same without it"),
    without_effect("--memory-fragmentation", 0,
                   "a MindSpeed memory switch for NPUs: the run is the same without it"),
    without_effect(
        "--use-cpu-initialization", 0,
        "parameters are always initialised on the host, by a seeded counter-based generator"),
    without_effect("--check-for-nan-in-loss-and-grad", 0,
                   "weave always stops at a loss that is not finite, and at a gradient that is "
                   "not finite before its bucket's data-parallel reduction (unless a loss scaler "
                   "skips the step)"),
    without_effect("--deterministic-mode", 0, kDeterministic),
    without_effect("--npu-deterministic", 0, kDeterministic),
    without_effect("--manual-gc", 0, kPython),
    without_effect("--empty-unused-memory-level", 1, kPython),
    without_effect("--jit-compile", 0, "weave's kernels are compiled ahead of time"),
    without_effect("--tensorboard-dir", 1, kLoggers),
    without_effect("--tensorboard-log-interval", 1, kLoggers),
    without_effect("--tensorboard-queue-size", 1, kLoggers),
    without_effect("--log-timers-to-tensorboard", 0, kLoggers),
    without_effect("--log-validation-ppl-to-tensorboard", 0, kLoggers),
    without_effect("--log-memory-to-tensorboard", 0, kLoggers),
    without_effect("--log-batch-size-to-tensorboard", 0, kLoggers),
    without_effect("--wandb-project", 1, kLoggers),
    without_effect("--wandb-exp-name", 1, kLoggers),
    without_effect("--wandb-save-dir", 1, kLoggers),
    without_effect("--log-throughput", 0, kReports),
    without_effect("--log-num-zeros-in-grad", 0, kReports),
    without_effect("--log-params-norm", 0, kReports),
    without_effect("--timing-log-level", 1, kReports),
    without_effect("--timing-log-option", 1, kReports),
    without_effect("--moe-per-layer-logging", 0, kReports),
    without_effect("--tokenizer-model", 1, kTokenizerModel),
    without_effect("--data-impl", 1, kDataLoader),
    without_effect("--num-workers", 1, kDataLoader),
    without_effect("--no-mmap-bin-files", 0, kDataLoader),
    without_effect("--no-create-attention-mask-in-dataloader", 0, kDataLoader),
    without_effect("--eod-mask-loss", 0, kDocuments),
    without_effect("--reset-position-ids", 0, kDocuments),
    without_effect("--reset-attention-mask", 0, kDocuments),
    without_effect("--ckpt-format", 1, kCheckpoints),
    without_effect("--use-dist-ckpt", 0, kCheckpoints),
    without_effect("--async-save", 0, kCheckpoints),
    without_effect("--no-load-rng", 0, kRandomness),
    without_effect("--no-save-rng", 0, kRandomness),
    without_effect("--moe-token-dispatcher-type", 1,
                   "tokens always reach their experts by all-to-all (Megatron's alltoall)"),
    without_effect("--cp-comm-type", 1, kContextParallel),
    without_effect("--context-parallel-algo", 1, kContextParallelAlgo),
    without_effect("--use-cp-send-recv-overlap", 0,
                   "the ring's sends and receives always overlap the attention blocks"),
    without_effect("--async-tensor-model-parallel-allreduce", 0, kTpOverlap),
    without_effect("--no-async-tensor-model-parallel-allreduce", 0, kTpOverlap),
    without_effect("--use-mc2", 0, kTpOverlap),
    without_effect("--use-ascend-mc2", 0, kTpOverlap),
    without_effect("--use-ascend-coc", 0, kTpOverlap),
    without_effect("--moe-pad-expert-input-to-capacity", 0,
                   "Megatron-Core pads each expert's rows to the capacity with picks of weight "
                   "0, whose outputs and gradients are 0: the same training without it"),
    without_effect(
        "--moe-dynamic-padding", 0,
        "with --moe-no-drop, MindSpeed pads each expert's buffer to a capacity it "
        "estimates over a sliding window; nothing is dropped either way, and weave sends "
        "only the routed rows (it needs --moe-no-drop, MindSpeed's rule)"),
    without_effect("--no-use-rts", 0,
                   "MindSpeed's parser leaves random token selection off with or without it "
                   "(store_false onto a default of False); weave's top-1 gate keeps each expert's "
                   "earliest tokens"),
    without_effect("--moe-permutation-async-comm", 0, kMoeOverlap),
    without_effect("--moe-alltoall-overlap-comm", 0, kMoeOverlap),
    without_effect("--calculate-per-token-loss", 0,
                   "the loss is already the mean over the global batch's tokens"),
    without_effect("--optimizer-selection", 1, "the optimizer is weave's AdamW kernel"),
    {.name = "--vocab-size",
     .group = FlagGroup::not_implemented,
     .status = FlagStatus::no_effect,
     .values = 1,
     .help = "Megatron-LM reads it only for its NullTokenizer and TikTokenizer, which weave does "
             "not have: the vocabulary is the data's tokenizer's (--tokenizer-type; text files: "
             "256 bytes), padded to --make-vocab-size-divisible-by x tp, as Megatron-LM's other "
             "tokenizers give theirs; weave predict models a vocabulary of this size",
     .field = model_field<&ModelConfig::vocab_size>(),
     .check = at_least(1),
     .description = described(DescribedSection::model, "vocab_size", true),
     .properties = kModelledByPredict | kShowsDefault,
     .predicted_help = "A tokenizer's vocabulary (weave train takes --tokenizer-type's), padded to "
                       "a multiple of --make-vocab-size-divisible-by x tp as Megatron-LM pads "
                       "it"},
};

constexpr ConfigFlag kRefused[] = {
    refused("--fp8-format", 1,
            "weave trains fp32, bf16 (--bf16) and fp16 (--fp16) runs; fp8 is none of them: drop "
            "it"),
    refused("--lr-warmup-fraction", 1,
            "give --lr-warmup-iters instead (the fraction x --lr-decay-iters)"),
    refused("--noisy-gate-policy", 1, "weave's router adds no noise to its gate: drop it"),
    refused("--moe-input-jitter-eps", 1, "weave's router adds no jitter to its input: drop it"),
    refused(
        "--no-load-optim", 0,
        "--load resumes the optimizer state with the weights, as an uninterrupted run would have "
        "it: drop it"),
    refused("--no-save-optim", 0, "a checkpoint always holds the optimizer state: drop it"),
    refused(
        "--finetune", 0,
        "--load resumes a run where it stopped (iteration, optimizer, data); a new run from loaded "
        "weights is not possible: drop it"),
    refused("--exit-interval", 1,
            "a run stops at --train-iters: set that to the iteration to stop at"),
    refused("--exit-duration-in-mins", 1, "a run stops at --train-iters only: drop it"),
    refused("--account-for-embedding-in-pipeline-split", 0,
            "balance the first and last stages with --decoder-first-pipeline-num-layers and "
            "--decoder-last-pipeline-num-layers instead"),
    refused("--account-for-loss-in-pipeline-split", 0,
            "balance the first and last stages with --decoder-first-pipeline-num-layers and "
            "--decoder-last-pipeline-num-layers instead"),
};

}  // namespace

std::span<const ConfigFlag> no_effect_flags() {
  return kNoEffect;
}

std::span<const ConfigFlag> refused_flags() {
  return kRefused;
}

}  // namespace weave::graphs::flag_groups
