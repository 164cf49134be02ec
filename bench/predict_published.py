#!/usr/bin/env python3
"""weave predict against published training runs: every row of the reference tables, run with
the settings the run used, its predicted step against the published one, the error, the mean
and largest |error| of each table, and where the predicted step goes.

usage: bench/predict_published.py WEAVE_BINARY [--quick] [--table N] [--check MEAN MAX]

  --quick       the rows that predict in about a second each (the CI subset: table 3 whole)
  --table N     only table N (1: Korthikanti et al. 2022, 2: Megatron-LM's README, 3: MindSpeed's
                Ampipe gains, 4: an MoE all-to-all overlap)
  --check MEAN MAX
                exit 1 when a table's mean |error| exceeds MEAN % or a row's |error| MAX %

The error is predicted over published minus 1 of the step time (positive: weave is slower than
the run was). Where a table gives TFLOP/s per GPU the published step is the model FLOPs weave
counts (Megatron-LM's formula) over that rate and the GPUs. For gains (table 3) the error is the
predicted gain minus the published, in percentage points.

The breakdown is per device, in % of the predicted step: products, attention and element-wise
compute (layers), the kernels' launch cost, the optimizer (zeroing, gradient norm, update),
exposed communication by group (tp, pp, dp, ep, cp; a time two groups leave exposed at once
counted in each) and the bubble (compute idle over the step). Compute and exposed communication overlap nothing else, so with the
bubble's idle time they account for the step.

What the tables leave unsaid is assumed as stated beside each table below; no figure is set per
row to bring it nearer its published value.
"""
import json
import subprocess
import sys

# Table 1: Korthikanti et al. 2022, Table 5. Stated: A100-SXM4-80GB, sequence 2048, FFN 4h, fp16,
# dp 1, Megatron-LM of 2022 (core attention materialises the s x s scores: the backend Megatron-
# Core calls "local"/"unfused"), fused softmax, bias-GeLU and bias-dropout-add. Assumed: vocabulary
# 51,200 (Megatron's GPT runs of the time), full recomputation uniform over 1 layer, selective
# recomputation = Megatron's default module (the core attention), learned positions, dropout 0.1
# on attention and hidden states as Megatron's GPT scripts of the time.
KORTHIKANTI = [
    # model, layers, hidden, heads, GPUs, tp, pp, virtual stages, gbs, mbs, full s, seq+sel s
    ("22B", 48, 6144, 64, 8, 8, 1, 1, 4, 4, 1.42, 1.10),
    ("175B", 96, 12288, 96, 64, 8, 8, 3, 64, 1, 18.13, 13.75),
    ("530B", 105, 20480, 128, 280, 8, 35, 3, 280, 1, 49.05, 37.83),
    ("1T", 128, 25600, 160, 512, 8, 64, 1, 512, 1, 94.42, 71.49),
]
KORTHIKANTI_STACK = "--attention-backend unfused --attention-dropout 0.1 --hidden-dropout 0.1"

# Table 2: Megatron-LM README's performance table. Stated: H100 (DGX H100), vocabulary 131,072,
# sequence 4,096, dp 48, --overlap-grad-reduce --overlap-param-gather --tp-comm-overlap.
# Assumed: bf16, micro-batch 1, no virtual stages, no recomputation, FFN 4h with GeLU and
# untied embeddings (the parameter counts the table's names give: 24 x 12 x 2048^2 + 2 x 131072
# x 2048 = 1.74B), the distributed optimizer (Megatron refuses --overlap-param-gather without it),
# sequence parallelism where tp > 1 (--tp-comm-overlap requires it), no dropout, the unfused
# cross-entropy (Megatron's default without --cross-entropy-loss-fusion), and the attention kernel
# Transformer Engine chooses (--attention-backend auto; the run of July 2024 predates the flag):
# cuDNN's fused attention, which Transformer Engine prefers over FlashAttention on Hopper
# (get_attention_backend in its dot_product_attention/utils.py, attention.py before).
# What follows from Megatron-LM's code of July 2024 (the table's commit) for these flags, not
# chosen: gradients reduced in fp32 (arguments.py turns --accumulate-allreduce-grads-in-fp32 on
# whenever --bf16; --grad-reduce-in-bf16 came later), reduce-scattered only in the last
# micro-batch's backward (no_sync over the others) and the bf16 parameters gathered in the next
# step's first forward; each bucket checked for NaN (its norm) and scaled by 1 / 48 on the compute
# stream before its reduce-scatter (start_grad_sync; --check-for-nan-in-loss-and-grad is on by
# default); on the pipeline stages after the first every reduction started after the stage's last
# backward (--delay-grad-reduce's default, and those stages' single bucket); learned absolute
# positions, LayerNorm, biases and the fused bias-GeLU (Megatron's GPT defaults).
# The 32B row cannot be reached under these settings whatever the kernels' rates: tp 8 leaves one
# member of each 48-wide data-parallel group a node, so each GPU's own 400 Gb/s NIC carries 47/48
# of its 3.94B parameters' fp32 gradients (15.4 GB) and bf16 values (7.7 GB) a step: 0.46 s at
# the line rate. With 4 micro-batches of 1 only the last backward (1/6 of the compute) can hide the
# reduce-scatter and the first forward (1/12) the gather, so the step is at least 5/6 C + 0.31 s
# + (0.15 s - C/12) = 3/4 C + 0.46 s; the published 0.892 s step (459.6 TFLOP/s) needs a compute
# time C of 0.57 s, 716 TFLOP/s of model FLOPs: about the products' sustained rate (722 in the
# h100-sxm preset), as if attention, element-wise work and the tensor-parallel collectives were
# free (weave's C is 0.75 s). A micro-batch of 2 (not stated;
# 413.8 TFLOP/s predicted) or gradients reduced in bf16 (impossible in Megatron-LM of July 2024)
# would each make it reachable. Dropout (Megatron's default 0.1) is left out: weave prices none
# inside the fused attention kernel (no published H100 figure with it) nor in the fused
# bias-dropout-add, so the rows' predictions are the same with it.
MEGATRON_README = [
    # model, heads, hidden, layers, tp, pp, dp, GPUs, gbs, TFLOP/s per GPU
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9),
]
MEGATRON_README_STACK = ("--bf16 --use-distributed-optimizer --overlap-grad-reduce "
                         "--overlap-param-gather --tp-comm-overlap --attention-backend auto "
                         "--untie-embeddings-and-output-weights")

# Table 3: MindSpeed's Ampipe (docs/features/ampipe.md). Stated: 16 Ascend NPUs, sequence 128k,
# 2 layers, 4 experts top-2, hidden 12288, full recomputation (block), ep 2, tp 8, dp 1, cp 2,
# pp 1, SP. What MindSpeed's code (branch 2.0.0_core_r0.8.0) requires of every row, not chosen:
# its deepspeed_moe layer (arguments.py asserts it for Ampipe; --use-pipe-experts is that layer's,
# mindspeed/moe/moe_layer.py), whose experts are split over the tp group (each expert's
# ColumnParallelLinear all-gathers its rows over tp, its RowParallelLinear reduce-scatters them),
# and no bias in the linear layers (arguments.py asserts not --add-bias-linear under Ampipe).
# Assumed: 96 heads (128-wide, as the 12288-wide GPT-3 175B), expert FFN 4h, bf16, micro-batch 1,
# global batch 1, flash attention (MindSpeed's fused attention) and rotary positions, as
# MindSpeed's own 128k scripts of this model run it (tests_extend/system_tests/gpt/
# pretrain_gpt_deepspeed_moe_128k.sh: hidden 12288, 96 heads, 2 layers, deepspeed_moe top-2,
# --position-embedding-type rope); a learned table of 131,072 positions would add 1.6e9
# parameters whose gradient no such script has. The doc names no --enable-token-rearrange-opt, so
# the gate dispatches and combines by MindSpeed's default dense einsums (moe_layer.py; Ampipe's
# gating and post-MLP computers), which Ampipe's chunks halve. The preset prices the HCCS mesh at
# its links' line rate (no HCCL bus bandwidth measurement of the 910B was found): the tp
# collectives' time is a lower bound, and with it the gains the pipelines' hiding brings.
AMPIPE_MODEL = ("--accelerator ascend-910b --num-layers 2 --hidden-size 12288 "
                "--num-attention-heads 96 --ffn-hidden-size 49152 --seq-length 131072 "
                "--max-position-embeddings 131072 --position-embedding-type rope "
                "--num-experts 4 --moe-router-topk 2 --moe-model-type deepspeed_moe "
                "--disable-bias-linear "
                "--moe-layer-freq 1 --devices 16 --tensor-model-parallel-size 8 "
                "--sequence-parallel --context-parallel-size 2 --expert-model-parallel-size 2 "
                "--micro-batch-size 1 --global-batch-size 1 --bf16 --recompute-granularity full "
                "--recompute-method block --recompute-num-layers 2 --vocab-size 32000")
AMPIPE = [
    # setting, extra flags, published TFLOP/s
    ("baseline", "", 120.56),
    ("pipe-experts", "--use-pipe-experts --pipe-experts-multi-stream --pipe-experts-multi-data 2",
     124.85),
    ("ampipe", "--ampipe-degree 2 --ampipe-tp-sp-comm-overlap", 127.29),
    ("ampipe + pipe-experts",
     "--ampipe-degree 2 --ampipe-tp-sp-comm-overlap --use-pipe-experts "
     "--pipe-experts-multi-stream --pipe-experts-multi-data 4", 126.87),
]

# Table 4: Qwen3-235B-A22B (yanring/Megatron-MoE-ModelZoo). Stated: 94 layers, hidden 4096, 64
# heads of 128 (--kv-channels 128: queries 8192 wide, twice the hidden size), 4 query groups, 128
# experts top-8, expert FFN 1536, 256 H100, bf16, tp 2, pp 8, virtual stages 4, ep 32, dp 16,
# micro-batch 1, global batch 2048, sequence 4096, recomputation of the norms and activations
# (best_practice/qwen3/run_h100_235b.sh: --recompute-granularity selective --recompute-modules
# moe_act layernorm). Assumed: SwiGLU, RoPE, RMSNorm, QK-norm, untied embeddings, vocabulary 151,936 (Qwen3's),
# sequence parallelism, the distributed optimizer with overlapped gradient reduction and parameter
# gathers, the first and last model chunk one layer short (94 = 2 + 30 x 3 + 2 over the 8 x 4
# chunks), and, where weave cannot follow the run: the experts --ffn-hidden-size wide (every
# layer is MoE: weave's experts take that width), the all-to-all dispatcher for the run's DeepEP
# one, and routing as it falls for the run's --moe-router-force-load-balancing (weave prices a
# balanced dispatch either way).
# Stated by the model's file: --cross-entropy-loss-fusion --cross-entropy-fusion-impl te, and no
# --attention-backend (Megatron-Core's auto: Transformer Engine's choice, cuDNN's fused attention on
# Hopper, priced at the kernel's rate for 128-wide heads; the run's 4 query groups are not in that
# measurement).
QWEN3 = ("--accelerator h100-sxm --num-layers 94 --hidden-size 4096 --num-attention-heads 64 "
         "--kv-channels 128 --group-query-attention --num-query-groups 4 --ffn-hidden-size 1536 "
         "--num-experts 128 --moe-router-topk 8 --moe-layer-freq 1 "
         "--swiglu --position-embedding-type rope --normalization RMSNorm --qk-layernorm "
         "--disable-bias-linear --untie-embeddings-and-output-weights --vocab-size 151936 "
         "--seq-length 4096 --max-position-embeddings 4096 --devices 256 "
         "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 8 "
         "--virtual-pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 2 "
         "--decoder-last-pipeline-num-layers 2 "
         "--expert-model-parallel-size 32 --micro-batch-size 1 --global-batch-size 2048 --bf16 "
         "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
         "--attention-backend auto --cross-entropy-loss-fusion --cross-entropy-fusion-impl te "
         "--recompute-granularity selective --recompute-modules moe_act layernorm")
# The overlap (Megatron-Core's --overlap-moe-expert-parallel-comm, which weave does not take) is
# predicted with MindSpeed's --moe-alltoall-overlap-comm, which weave accepts without effect: its
# all-to-alls already overlap whatever the data allows, so the row shows what the 1F1B overlap's
# reordering of two micro-batches would add.
QWEN3_ROWS = [("without overlap", "", 19.7), ("1F1B all-to-all overlap",
                                                "--moe-alltoall-overlap-comm", 17.6)]


def korthikanti_flags(row, selective):
    _, layers, hidden, heads, gpus, tp, pp, vp, gbs, mbs, _, _ = row
    flags = (f"--accelerator a100-80gb --fp16 --num-layers {layers} --hidden-size {hidden} "
             f"--num-attention-heads {heads} --ffn-hidden-size {4 * hidden} --seq-length 2048 "
             f"--max-position-embeddings 2048 --vocab-size 51200 --devices {gpus} "
             f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp} "
             f"--micro-batch-size {mbs} --global-batch-size {gbs} {KORTHIKANTI_STACK}")
    if vp > 1:
        flags += f" --num-layers-per-virtual-pipeline-stage {layers // (pp * vp)}"
    if selective:
        flags += " --sequence-parallel --recompute-granularity selective"
    else:
        flags += " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
    return flags


def megatron_readme_flags(row):
    _, heads, hidden, layers, tp, pp, dp, gpus, gbs, _ = row
    flags = (f"--accelerator h100-sxm --num-layers {layers} --hidden-size {hidden} "
             f"--num-attention-heads {heads} --ffn-hidden-size {4 * hidden} --seq-length 4096 "
             f"--max-position-embeddings 4096 --vocab-size 131072 --devices {gpus} "
             f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp} "
             f"--micro-batch-size 1 --global-batch-size {gbs} {MEGATRON_README_STACK}")
    if tp > 1:
        flags += " --sequence-parallel"
    return flags


def predict(weave, flags):
    """weave predict --json's figures for `flags`, or the error it printed."""
    run = subprocess.run([weave, "predict", "--json", *flags.split()], capture_output=True,
                         text=True)
    if run.returncode != 0:
        return None, (run.stderr or run.stdout).strip().splitlines()[-1]
    return json.loads(run.stdout), None


def breakdown(p):
    """The step's shares, in % of the predicted step per device."""
    step = p["step_ms"]
    parts = dict(p["compute_ms_per_device"])
    for group, ms in p["exposed_ms_per_device"].items():
        parts["x-" + group] = ms
    busy = p["compute_busy_ms_per_device"]
    parts["bubble"] = max(step - busy - p["exposed_total_ms_per_device"], 0.0)
    short = {"products": "mm", "attention": "attn", "elementwise": "elem", "optimizer": "opt",
             "launch": "launch"}
    return " ".join(f"{short.get(k, k)} {100 * v / step:.0f}" for k, v in parts.items()
                    if 100 * v / step >= 0.5)


class Table:
    def __init__(self, title):
        self.title, self.errors, self.unpredicted = title, [], 0
        print(f"\n{title}")
        print(f"{'row':28} {'predicted':>10} {'published':>10} {'error':>8}  breakdown (% of step)")

    def row(self, name, predicted, published, error, unit, p):
        self.errors.append(error)
        print(f"{name:28} {predicted:10.3f} {published:10.3f} {error:+7.1f}{unit}  {breakdown(p)}",
              flush=True)

    def failed(self, name, why):
        self.unpredicted += 1
        print(f"{name:28} {'-':>10} {'-':>10} {'-':>8}  not predicted: {why}", flush=True)

    def summary(self, unit="%"):
        if not self.errors:
            return None if not self.unpredicted else (float("inf"), float("inf"))
        if self.unpredicted:  # a row weave refused fails a check, as a row beyond it does
            return float("inf"), float("inf")
        mean = sum(abs(e) for e in self.errors) / len(self.errors)
        worst = max(abs(e) for e in self.errors)
        print(f"{'mean |error|':28} {'':10} {'':10} {mean:7.1f}{unit}   max |error| {worst:.1f}{unit}")
        return mean, worst


def seconds_row(t, name, prediction, published):
    """A row of seconds a step: the prediction (or why it failed) against the published time."""
    p, why = prediction
    if p is None:
        t.failed(name, why)
        return
    s = p["step_ms"] / 1e3
    t.row(name, s, published, 100 * (s / published - 1), "%", p)


def table_korthikanti(weave, quick):
    t = Table("1. Korthikanti et al. 2022, Table 5: seconds per iteration, A100 (a100-80gb)")
    for row in KORTHIKANTI:
        if quick and row[0] not in ("22B",):
            continue
        for selective, published in ((False, row[10]), (True, row[11])):
            name = f"{row[0]} {'seq+sel' if selective else 'full'}"
            seconds_row(t, name, predict(weave, korthikanti_flags(row, selective)), published)
    return t.summary()


def table_megatron_readme(weave, quick):
    t = Table("2. Megatron-LM README: TFLOP/s per GPU, H100 (h100-sxm), dp 48")
    for row in MEGATRON_README:
        if quick and row[0] not in ("1.7B", "7.1B"):
            continue
        p, why = predict(weave, megatron_readme_flags(row))
        if p is None:
            t.failed(row[0], why)
            continue
        predicted = p["flops_per_device"] / 1e12
        t.row(row[0], predicted, row[9], 100 * (row[9] / predicted - 1), "%", p)
    return t.summary()


def table_ampipe(weave):
    t = Table("3. MindSpeed Ampipe (ascend-910b): TFLOP/s and gain over the baseline, pp")
    base_pred = base_pub = None
    for name, extra, published in AMPIPE:
        p, why = predict(weave, f"{AMPIPE_MODEL} {extra}")
        if p is None:
            t.failed(name, why)
            continue
        predicted = p["flops_per_device"] / 1e12
        if base_pred is None:
            base_pred, base_pub = predicted, published
            print(f"{name:28} {predicted:10.2f} {published:10.2f} {'':>8}  {breakdown(p)}")
            continue
        gain = 100 * (predicted / base_pred - 1)
        pub_gain = 100 * (published / base_pub - 1)
        t.row(f"{name} gain %", gain, pub_gain, gain - pub_gain, "pp", p)
    return t.summary("pp")


def table_qwen3(weave):
    t = Table("4. Qwen3-235B-A22B, 256 H100 (h100-sxm): seconds a step")
    for name, extra, published in QWEN3_ROWS:
        seconds_row(t, name, predict(weave, f"{QWEN3} {extra}"), published)
    return t.summary()


def main():
    args = sys.argv[1:]
    if not args or args[0].startswith("-"):
        sys.exit(__doc__)
    weave, args = args[0], args[1:]
    quick = "--quick" in args
    tables = {1, 2, 3, 4}
    check = None
    if "--table" in args:
        tables = {int(args[args.index("--table") + 1])}
    if "--check" in args:
        i = args.index("--check")
        check = float(args[i + 1]), float(args[i + 2])
    runs = {1: lambda: table_korthikanti(weave, quick), 2: lambda: table_megatron_readme(weave, quick),
            3: lambda: table_ampipe(weave), 4: lambda: table_qwen3(weave)}
    if quick:
        tables &= {1, 2, 3}
    failed = False
    for n in sorted(tables):
        result = runs[n]()
        if check and result and (result[0] > check[0] or result[1] > check[1]):
            print(f"table {n}: mean {result[0]:.1f} / max {result[1]:.1f} beyond the targets "
                  f"{check[0]} / {check[1]}")
            failed = True
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
