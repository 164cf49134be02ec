#!/usr/bin/env python3
"""weave predict at the scale users rent: the time and peak memory of predicting one step of
published runs' sizes, each prediction in a process of its own (its peak resident memory read
with wait4). Targets: the 1T model on 3,072 A100s at most 10 s and 2 GiB, Llama 3 405B on
16,384 H100s at most 30 s and 4 GiB, the 64-device 7B-like --advise at most 30 s.

usage: bench/predict_scale.py WEAVE_BINARY
"""
import os
import subprocess
import sys
import time

ONE_T = (
    "--accelerator a100-80gb --num-layers 128 --hidden-size 25600 --num-attention-heads 160 "
    "--ffn-hidden-size 102400 --seq-length 2048 --vocab-size 51200 --micro-batch-size 1 "
    "--global-batch-size 3072 --devices 3072 --tensor-model-parallel-size 8 "
    "--pipeline-model-parallel-size 64 --fp16"
)
# Llama 3 405B (Meta's paper): 126 layers, 7 on the first and last of 16 stages, 8 elsewhere;
# 16 micro-batches of one sequence a replica.
LLAMA3_405B = (
    "--accelerator h100-sxm --num-layers 126 --hidden-size 16384 --ffn-hidden-size 53248 "
    "--num-attention-heads 128 --group-query-attention --num-query-groups 8 --swiglu "
    "--seq-length 8192 --max-position-embeddings 8192 --vocab-size 128256 "
    "--tensor-model-parallel-size 8 --sequence-parallel --pipeline-model-parallel-size 16 "
    "--decoder-first-pipeline-num-layers 7 --decoder-last-pipeline-num-layers 7 --devices 16384 "
    "--micro-batch-size 1 --global-batch-size 2048 --bf16 --use-distributed-optimizer"
)
ADVISE_7B = (
    "--accelerator a100-80gb --num-layers 32 --hidden-size 4096 --num-attention-heads 32 "
    "--ffn-hidden-size 11008 --swiglu --seq-length 2048 --devices 64 --global-batch-size 512 "
    "--bf16 --use-distributed-optimizer --advise"
)
CASES = [
    ("1T, 3,072 A100s, fp16", ONE_T, 10, 2),
    ("1T, 3,072 A100s, fp16, full recomputation",
     ONE_T + " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
     10, 2),
    ("Llama 3 405B, 16,384 H100s, bf16", LLAMA3_405B, 30, 4),
    ("7B-like --advise over 64 A100s", ADVISE_7B, 30, None),
]


def run(weave, flags):
    """Seconds, peak resident GiB and the step line of one prediction, alone in its process."""
    start = time.monotonic()
    child = subprocess.Popen([weave, "predict", *flags.split()], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.monotonic() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        sys.exit(f"weave predict {flags} failed:\n{out}")
    step = next((l.split(None, 1)[1] for l in out.splitlines() if l.startswith("step ")), "")
    return seconds, usage.ru_maxrss / 2**20, step


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    weave = sys.argv[1]
    print(f"{'case':45} {'seconds':>8} {'target':>7} {'peak GiB':>9} {'target':>7}  step")
    for name, flags, seconds_target, gib_target in CASES:
        seconds, gib, step = run(weave, flags)
        gib_goal = f"{gib_target:7}" if gib_target else f"{'-':>7}"
        print(f"{name:45} {seconds:8.2f} {seconds_target:7} {gib:9.2f} {gib_goal}  {step}",
              flush=True)

if __name__ == "__main__":
    main()
