#include "megatron_flags.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>

namespace weave::cli {

namespace {

constexpr std::string_view kFusion =
    "a kernel fusion switch: weave's kernels are its own and compute the same values either way";
constexpr std::string_view kFp32 = "weave computes in fp32 throughout";
constexpr std::string_view kLossScale = "loss scaling is for fp16 training; weave trains in fp32";
constexpr std::string_view kAmpipeRule =
    "a MindSpeed memory or pipeline switch for NPUs: the run is the same without it (refused "
    "beside --ampipe-degree, as MindSpeed does)";
constexpr std::string_view kLoggers =
    "weave writes no TensorBoard or Weights & Biases logs: --log-json writes every iteration's "
    "metrics as JSON lines";
constexpr std::string_view kReports =
    "the progress line and --log-json report what weave measures (tokens/s, grad norm, exposed "
    "communication, pipeline bubble)";
constexpr std::string_view kTokenizer =
    "weave's tokens are the bytes of --data-path's text (a vocabulary of 256): no tokenizer is "
    "read";
constexpr std::string_view kDataLoader =
    "weave reads --data-path as text itself: there is no dataloader or indexed dataset to "
    "configure";
constexpr std::string_view kDocuments =
    "byte tokens have no end-of-document token: there is nothing to mask or reset at";
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
constexpr std::string_view kDeterministic =
    "weave's runs are always deterministic: the same flags give bitwise the same losses";
constexpr std::string_view kPython = "Python memory management: weave has none to tune";
constexpr std::string_view kImplementation =
    "weave has one implementation of the model, its own CPU kernels: the flag chooses among "
    "Megatron's GPU implementations";
constexpr std::string_view kBackend =
    "collectives go through shared memory (or MPI under mpirun), not NCCL or Gloo";

constexpr auto kNoEffect = std::to_array<MegatronFlag>({
    {"--use-mcore-models", 0, kImplementation},
    {"--use-legacy-models", 0, kImplementation},
    {"--transformer-impl", 1, kImplementation},
    {"--attention-backend", 1,
     "attention is always weave's blockwise kernel with an online softmax"},
    {"--distributed-backend", 1, kBackend},
    {"--DDP-impl", 1, "gradients are reduced by weave's own tasks, overlapping the backward"},
    {"--distributed-timeout-minutes", 1, "weave's collectives have no process-group timeout"},
    {"--no-masked-softmax-fusion", 0, kFusion},
    {"--no-bias-gelu-fusion", 0, kFusion},
    {"--no-bias-dropout-fusion", 0, kFusion},
    {"--no-bias-swiglu-fusion", 0, kFusion},
    {"--no-rope-fusion", 0, kFusion},
    {"--no-gradient-accumulation-fusion", 0, kFusion},
    {"--cross-entropy-loss-fusion", 0, kFusion},
    {"--moe-grouped-gemm", 0, kFusion},
    {"--moe-permute-fusion", 0, kFusion},
    {"--use-fused-rmsnorm", 0, kFusion},
    {"--use-fused-swiglu", 0, kFusion},
    {"--use-fused-rotary-pos-emb", 0, kFusion},
    {"--use-fused-ring-attention-update", 0, kFusion},
    {"--attention-softmax-in-fp32", 0, kFp32},
    {"--accumulate-allreduce-grads-in-fp32", 0, kFp32},
    {"--fp32-residual-connection", 0, kFp32},
    {"--reuse-fp32-param", 0, kFp32},
    {"--apply-query-key-layer-scaling", 0,
     "a guard against fp16 overflow: in fp32 the attention is the same"},
    {"--loss-scale", 1, kLossScale},
    {"--initial-loss-scale", 1, kLossScale},
    {"--min-loss-scale", 1, kLossScale},
    {"--loss-scale-window", 1, kLossScale},
    {"--hysteresis", 1, kLossScale},
    {"--use-nanopipe", 0, kAmpipeRule},
    {"--recompute-in-bubble", 0, kAmpipeRule},
    {"--recompute-in-advance", 0, kAmpipeRule},
    {"--adaptive-recompute-device-swap", 0, kAmpipeRule},
    {"--swap-attention", 0, "a MindSpeed memory switch for NPUs: the run is the same without it"},
    {"--memory-fragmentation", 0,
     "a MindSpeed memory switch for NPUs: the run is the same without it"},
    {"--use-cpu-initialization", 0,
     "parameters are always initialised on the host, by a seeded counter-based generator"},
    {"--check-for-nan-in-loss-and-grad", 0, "weave always stops at a loss that is not finite"},
    {"--deterministic-mode", 0, kDeterministic},
    {"--npu-deterministic", 0, kDeterministic},
    {"--manual-gc", 0, kPython},
    {"--empty-unused-memory-level", 1, kPython},
    {"--jit-compile", 0, "weave's kernels are compiled ahead of time"},
    {"--tensorboard-dir", 1, kLoggers},
    {"--tensorboard-log-interval", 1, kLoggers},
    {"--tensorboard-queue-size", 1, kLoggers},
    {"--log-timers-to-tensorboard", 0, kLoggers},
    {"--log-validation-ppl-to-tensorboard", 0, kLoggers},
    {"--log-memory-to-tensorboard", 0, kLoggers},
    {"--log-batch-size-to-tensorboard", 0, kLoggers},
    {"--wandb-project", 1, kLoggers},
    {"--wandb-exp-name", 1, kLoggers},
    {"--wandb-save-dir", 1, kLoggers},
    {"--log-throughput", 0, kReports},
    {"--log-num-zeros-in-grad", 0, kReports},
    {"--log-params-norm", 0, kReports},
    {"--timing-log-level", 1, kReports},
    {"--moe-per-layer-logging", 0, kReports},
    {"--tokenizer-type", 1, kTokenizer},
    {"--tokenizer-model", 1, kTokenizer},
    {"--vocab-file", 1, kTokenizer},
    {"--merge-file", 1, kTokenizer},
    {"--data-impl", 1, kDataLoader},
    {"--num-workers", 1, kDataLoader},
    {"--data-cache-path", 1, kDataLoader},
    {"--no-mmap-bin-files", 0, kDataLoader},
    {"--no-create-attention-mask-in-dataloader", 0, kDataLoader},
    {"--eod-mask-loss", 0, kDocuments},
    {"--reset-position-ids", 0, kDocuments},
    {"--reset-attention-mask", 0, kDocuments},
    {"--ckpt-format", 1, kCheckpoints},
    {"--use-dist-ckpt", 0, kCheckpoints},
    {"--async-save", 0, kCheckpoints},
    {"--no-load-rng", 0, kRandomness},
    {"--no-save-rng", 0, kRandomness},
    {"--moe-token-dispatcher-type", 1,
     "tokens always reach their experts by all-to-all (Megatron's alltoall)"},
    {"--moe-router-load-balancing-type", 1,
     "the router is balanced by the auxiliary loss, --moe-aux-loss-coeff (Megatron's aux_loss)"},
    {"--cp-comm-type", 1, kContextParallel},
    {"--context-parallel-algo", 1, kContextParallel},
    {"--use-cp-send-recv-overlap", 0,
     "the ring's sends and receives always overlap the attention blocks"},
    {"--tp-comm-overlap", 0, kTpOverlap},
    {"--async-tensor-model-parallel-allreduce", 0, kTpOverlap},
    {"--no-async-tensor-model-parallel-allreduce", 0, kTpOverlap},
    {"--use-mc2", 0, kTpOverlap},
    {"--use-ascend-mc2", 0, kTpOverlap},
    {"--use-ascend-coc", 0, kTpOverlap},
    {"--moe-permutation-async-comm", 0, kMoeOverlap},
    {"--moe-alltoall-overlap-comm", 0, kMoeOverlap},
    {"--calculate-per-token-loss", 0,
     "the loss is already the mean over the global batch's tokens"},
    {"--optimizer-selection", 1, "the optimizer is weave's AdamW kernel"},
});

constexpr std::string_view kHalfPrecision =
    "weave's kernels compute in fp32, so weave train cannot train in half precision: drop the flag "
    "and the run trains in fp32 (4-byte values, as the memory estimate counts), or give it to "
    "weave predict, which models a 16-bit run's memory and traffic";
constexpr std::string_view kRecompute =
    "weave train keeps every activation instead of recomputing it (the losses are the same, the "
    "memory is not): drop it, or give it to weave predict, which models recomputation";
constexpr std::string_view kIterations =
    "weave counts training in iterations: give the iteration count instead (samples / "
    "--global-batch-size)";

constexpr auto kRefused = std::to_array<MegatronFlag>({
    {"--fp16", 0, kHalfPrecision},
    {"--bf16", 0, kHalfPrecision},
    {"--fp8-format", 1,
     "weave trains in fp32 and predicts fp32, bf16 (--bf16) and fp16 (--fp16) runs; fp8 is "
     "neither: drop it"},
    {"--recompute-activations", 0, kRecompute},
    {"--recompute-granularity", 1, kRecompute},
    {"--recompute-method", 1, kRecompute},
    {"--recompute-num-layers", 1, kRecompute},
    {"--rampup-batch-size", 3,
     "weave trains every iteration at --global-batch-size: drop it, or set the batch you want "
     "with --global-batch-size"},
    {"--train-samples", 1, kIterations},
    {"--lr-decay-samples", 1, kIterations},
    {"--lr-warmup-samples", 1, kIterations},
    {"--lr-warmup-fraction", 1, "give --lr-warmup-iters instead (the fraction x --lr-decay-iters)"},
    {"--moe-train-capacity-factor", 1,
     "MindSpeed's DeepSpeed-style capacity: give Megatron's --moe-expert-capacity-factor instead"},
    {"--noisy-gate-policy", 1, "weave's router adds no noise to its gate: drop it"},
    {"--moe-input-jitter-eps", 1, "weave's router adds no jitter to its input: drop it"},
    {"--moe-ffn-hidden-size", 1, "weave's experts are --ffn-hidden-size wide: set that instead"},
    {"--moe-shared-expert-intermediate-size", 1,
     "weave's MoE layers have no shared expert: drop it"},
    {"--kv-channels", 1,
     "an attention head is --hidden-size / --num-attention-heads wide here: drop it and choose "
     "those two"},
    {"--vocab-size", 1,
     "weave train's tokens are bytes, a vocabulary of 256 padded to "
     "--make-vocab-size-divisible-by: drop it, or give it to weave predict, which models a "
     "tokenizer's vocabulary"},
    {"--no-load-optim", 0,
     "--load resumes the optimizer state with the weights, as an uninterrupted run would have "
     "it: drop it"},
    {"--no-save-optim", 0, "a checkpoint always holds the optimizer state: drop it"},
    {"--finetune", 0,
     "--load resumes a run where it stopped (iteration, optimizer, data); a new run from loaded "
     "weights is not possible: drop it"},
    {"--exit-interval", 1, "a run stops at --train-iters: set that to the iteration to stop at"},
    {"--exit-duration-in-mins", 1, "a run stops at --train-iters only: drop it"},
    {"--account-for-embedding-in-pipeline-split", 0,
     "balance the first and last stages with --decoder-first-pipeline-num-layers and "
     "--decoder-last-pipeline-num-layers instead"},
    {"--account-for-loss-in-pipeline-split", 0,
     "balance the first and last stages with --decoder-first-pipeline-num-layers and "
     "--decoder-last-pipeline-num-layers instead"},
});

}  // namespace

std::span<const MegatronFlag> no_effect_flags() {
  return kNoEffect;
}

std::span<const MegatronFlag> refused_flags() {
  return kRefused;
}

std::optional<std::string> refusal(std::string_view command, std::string_view flag) {
  // weave predict takes train's flags and those above it models (registered there, so never
  // looked up here); the rest it refuses as train does.
  if (command != "train" && command != "predict") return std::nullopt;
  const auto found = std::find_if(kRefused.begin(), kRefused.end(),
                                  [&](const MegatronFlag& f) { return f.name == flag; });
  if (found == kRefused.end()) return std::nullopt;
  return fmt::format("{} is refused: {}", flag, found->why);
}

}  // namespace weave::cli
