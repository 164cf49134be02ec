#!/usr/bin/env bash
# Ampipe's step time and exposed all-to-all time at degrees 1, 2 and 4 in the regime it is for,
# where the expert all-to-alls cost about what the compute does: on the virtual clock for 2, 8
# and 64 devices (20 GB/s, 10 us links as in the Ampipe paper's experiments) and on the wall
# clock for 2 devices on this host, its link slowed as far as the host's compute is from the
# modelled accelerator's.
#
# usage: bench/ampipe_bench.sh WEAVE_BINARY [--quick]
set -euo pipefail

weave=${1:?usage: bench/ampipe_bench.sh WEAVE_BINARY [--quick]}
quick=${2:-}
model="--moe-layer-freq 1 --hidden-size 512 --num-attention-heads 8 --ffn-hidden-size 1024
       --mock-data --train-iters 1"

section() { printf '\n== %s\n' "$*"; }

section "virtual clock, 2 devices (ep 2), 4 MoE layers, 2048 positions, 3e13 FLOP/s, kernels run"
# shellcheck disable=SC2086
"$weave" train $model --num-layers 4 --seq-length 2048 --num-experts 4 --devices 2 \
  --expert-model-parallel-size 2 --link ampipe-20gbps --device-flops 3e13 --ampipe-advise

section "the same with pipe experts (4 capacity slices, their own streams)"
# shellcheck disable=SC2086
"$weave" train $model --num-layers 4 --seq-length 2048 --num-experts 4 --devices 2 \
  --expert-model-parallel-size 2 --link ampipe-20gbps --device-flops 3e13 --ampipe-advise \
  --ampipe-advise-fast --use-pipe-experts --pipe-experts-multi-data 4 --pipe-experts-multi-stream

section "virtual clock, 4 devices (tp 2 + SP, ep 2), 2 MoE layers, hidden 128, 256 positions, 1e12 FLOP/s"
# A chunk's tensor-parallel collectives run on the tp group's stream while another chunk's
# all-to-all is on the ep group's: with one comm stream per device they queued.
"$weave" train --mock-data --train-iters 1 --devices 4 --num-layers 2 --hidden-size 128 \
  --num-attention-heads 8 --ffn-hidden-size 256 --seq-length 256 --micro-batch-size 2 \
  --num-experts 4 --tensor-model-parallel-size 2 --sequence-parallel \
  --expert-model-parallel-size 2 --link ampipe-20gbps --device-flops 1e12 --ampipe-advise

section "experts split over tp (deepspeed_moe): degrees, the tp-sp overlap, pipe experts"
# The step's builder directly: 8 devices on the virtual clock at 3e13 FLOP/s (compute well
# below communication) and 1.2e13 (about equal), and (without --quick) 4 devices on the wall
# clock.
"$(dirname "$weave")/../bench/ampipe_tp_bench" --quick --device-flops 3e13
"$(dirname "$weave")/../bench/ampipe_tp_bench" ${quick:+--quick} --device-flops 1.2e13

section "virtual clock, 8 devices (ep 8), 4 MoE layers, 2048 positions, 3e13 FLOP/s"
# shellcheck disable=SC2086
"$weave" train $model --num-layers 4 --seq-length 2048 --num-experts 8 --devices 8 \
  --expert-model-parallel-size 8 --link ampipe-20gbps --device-flops 3e13 --ampipe-advise \
  --ampipe-advise-fast

[ "$quick" = --quick ] && exit 0

section "virtual clock, 64 devices (ep 64), 1 MoE layer, 4096 positions, capacity factor 1"
# shellcheck disable=SC2086
"$weave" train $model --num-layers 1 --seq-length 4096 --num-experts 64 --devices 64 \
  --expert-model-parallel-size 64 --moe-expert-capacity-factor 1.0 --link ampipe-20gbps \
  --device-flops 1.5e13 --ampipe-advise --ampipe-advise-fast

section "wall clock, 2 devices on this host, link 0.0267 GB/s and 7.5 ms (20 GB/s and 10 us x 750)"
for degree in 1 2 4; do
  printf 'degree %s: ' "$degree"
  # shellcheck disable=SC2086
  "$weave" train $model --num-layers 4 --seq-length 2048 --num-experts 4 --devices 2 \
    --expert-model-parallel-size 2 --train-iters 3 --log-interval 1 --link 0.0267:7500 \
    --ampipe-degree "$degree" | tail -1
done
