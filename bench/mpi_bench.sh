#!/usr/bin/env bash
# weave across processes on this host. First the collectives of the MPI backend against Open
# MPI's own (all-reduce, all-gather, reduce-scatter, all-to-all, variable all-to-all,
# send/recv), 2 processes bound to a core each, 8 B to 64 MiB (bench/mpi_collectives_bench.cpp).
# Then training: the same model on 2 devices in one process and on 2 processes of one device
# each, and on 4 devices in one process and in 2 processes of two devices each (tokens/s over
# the last iterations, wall clock; the best of 3 runs of each).
#
# usage: bench/mpi_bench.sh BUILD_DIR [--quick]
set -euo pipefail

build=${1:?usage: bench/mpi_bench.sh BUILD_DIR [--quick]}
quick=${2:-}
weave="$build/tools/weave"
# Open MPI refuses root unless told; this benchmark runs as whoever runs it.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none

section() { printf '\n== %s\n' "$*"; }

section "collectives over 2 processes (one per core): weave's MPI backend and Open MPI"
max=$((64 << 20))
[ "$quick" = --quick ] && max=$((1 << 20))
mpirun -np 2 --bind-to core "$build/bench/mpi_collectives_bench" --max-bytes=$max

model="--num-layers 4 --hidden-size 256 --num-attention-heads 8 --ffn-hidden-size 1024 \
  --seq-length 256 --micro-batch-size 4 --mock-data --log-interval 1000"
iters=20
[ "$quick" = --quick ] && iters=6
rate='s/.*| \([0-9]*\) tokens\/s (wall).*/\1/p'

# best A B: the larger rate (an empty one counts as 0).
best() { awk -v a="${1:-0}" -v b="${2:-0}" 'BEGIN { print (a > b ? a : b) }'; }

# train DEVICES PLAN...: one process against two, tokens/s, the best of 3 runs of each taken in
# turn (the host is shared: a run that lost its cores to another program says nothing).
train() {
  local devices=$1
  shift
  for plan in "$@"; do
    printf '%-52s' "${plan:-data parallel $devices}"
    one=0 two=0
    for _ in 1 2 3; do
      one=$(best "$one" "$("$weave" train $model $plan --devices "$devices" --train-iters $iters |
        sed -n "$rate")")
      two=$(best "$two" "$(mpirun -np 2 --bind-to core "$weave" train $model $plan \
        --devices "$devices" --train-iters $iters | sed -n "$rate")")
    done
    printf 'one process %8s tokens/s | two processes %8s tokens/s (%s %%)\n' "$one" "$two" \
      "$(awk -v a="$one" -v b="$two" 'BEGIN { if (a > 0) printf "%.1f", 100 * b / a }')"
  done
}

section "training, 2 devices: one process against two (one device each), tokens/s"
train 2 "--tensor-model-parallel-size 2 --sequence-parallel" "" \
  "--num-experts 4 --expert-model-parallel-size 2"

section "training, 4 devices: one process against two (two devices each), tokens/s"
train 4 "--tensor-model-parallel-size 2 --sequence-parallel" "" \
  "--num-experts 4 --expert-model-parallel-size 4"
