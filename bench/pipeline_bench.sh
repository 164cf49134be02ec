#!/usr/bin/env bash
# Pipeline schedules side by side. For p = 4, m = 8 and p = 8, m = 32: the schedule alone with
# unit costs (F 1, B 2, I = W = 1; bubble in theory and replayed, peak in-flight micro-batches
# per stage), then the training graph of a dense GPT on the virtual clock (step time, bubble
# measured beside the formula, activation sets and memory per stage). Last, the wall clock of
# a 2-stage pipeline on this host next to one device.
#
# usage: bench/pipeline_bench.sh WEAVE_BINARY [--quick]
set -euo pipefail

weave=${1:?usage: bench/pipeline_bench.sh WEAVE_BINARY [--quick]}
quick=${2:-}
schedules="gpipe 1f1b interleaved interleaved-mem zb-h1 zb-v"

section() { printf '\n== %s\n' "$*"; }

# The schedule's own figures: one line per schedule from `weave schedule`.
schedule_table() {
  local p=$1 m=$2
  section "schedules alone, p = $p, m = $m (unit costs: F 1, B 2, I 1, W 1)"
  for s in $schedules; do
    v=1
    case $s in interleaved | interleaved-mem | zb-v) v=2 ;; esac
    printf '%-16s v=%s  ' "$s" "$v"
    "$weave" schedule --pipeline-model-parallel-size "$p" --num-micro-batches "$m" \
      --virtual-pipeline-size "$v" --pipeline-scheduler "$s" |
      awk '/^bubble/ { printf "bubble %s simulated, %s theory | ", $4, $6 }
           /^task graph/ { printf "replayed %s | ", $10 }
           /^memory tracker/ { sub(/.*per rank: /, ""); printf "peak per stage: %s", $0 }'
    echo
  done
}

schedule_table 4 8
section "training graph, p = 4, m = 8: 8 layers, hidden 512, 8 heads, ffn 2048, 1024 positions; 1e14 FLOP/s, nvlink3"
"$weave" train --mock-data --num-layers 8 --hidden-size 512 --num-attention-heads 8 \
  --ffn-hidden-size 2048 --seq-length 1024 --pipeline-model-parallel-size 4 \
  --global-batch-size 8 --link nvlink3 --device-flops 1e14 --pipeline-advise

[ "$quick" = --quick ] && exit 0

schedule_table 8 32
section "training graph, p = 8, m = 32: 16 layers, hidden 512, 8 heads, ffn 2048, 512 positions; 1e14 FLOP/s, nvlink3"
"$weave" train --mock-data --num-layers 16 --hidden-size 512 --num-attention-heads 8 \
  --ffn-hidden-size 2048 --seq-length 512 --pipeline-model-parallel-size 8 \
  --global-batch-size 32 --link nvlink3 --device-flops 1e14 --pipeline-advise

section "wall clock on this host: 8 layers, hidden 512, 512 positions, 8 micro-batches, 3 iterations"
wall="--mock-data --num-layers 8 --hidden-size 512 --num-attention-heads 8 --ffn-hidden-size 2048
      --seq-length 512 --global-batch-size 8 --train-iters 3 --log-interval 1"
printf '%-28s ' "1 device"
# shellcheck disable=SC2086
"$weave" train $wall | tail -1
for s in 1f1b interleaved zb-h1; do
  printf '%-28s ' "pp 2, $s"
  extra=""
  [ "$s" = interleaved ] && extra="--num-layers-per-virtual-pipeline-stage 2"
  # shellcheck disable=SC2086
  "$weave" train $wall --pipeline-model-parallel-size 2 --pipeline-scheduler "$s" $extra | tail -1
done
