#!/usr/bin/env bash
# weave predict against the wall clock on this host: `weave calibrate` measures the host's kernel
# rates for 1 and 2 devices, then each configuration trains a few iterations (the median
# iteration after the first two is the wall-clock step) and is predicted on the virtual clock with
# the calibrated preset. Prints each configuration's error and the median |error|.
#
# usage: bench/predict_bench.sh WEAVE_BINARY [ITERATIONS]
set -euo pipefail

weave=${1:?usage: bench/predict_bench.sh WEAVE_BINARY [ITERATIONS]}
iterations=${2:-8}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

for n in 1 2; do
  "$weave" calibrate --devices "$n" --seconds 0.1 --output "$work/host$n.json" >"$work/calibrate$n.txt"
  tail -2 "$work/calibrate$n.txt" | head -1 | sed "s/^/calibrated, $n device(s): /"
done

dense="--mock-data --num-attention-heads 8 --seed 7"
moe="--mock-data --num-attention-heads 8 --num-experts 8 --moe-router-topk 2 --seed 7"
configs=(
  "1|dense, 4 layers h256|$dense --num-layers 4 --hidden-size 256 --ffn-hidden-size 1024 --seq-length 256 --micro-batch-size 4 --global-batch-size 8"
  "1|dense, 2 layers h512 s512|$dense --num-layers 2 --hidden-size 512 --ffn-hidden-size 2048 --seq-length 512 --micro-batch-size 2 --global-batch-size 4"
  "1|MoE 8 experts, 2 layers h256|$moe --num-layers 2 --hidden-size 256 --ffn-hidden-size 512 --seq-length 256 --micro-batch-size 4 --global-batch-size 8"
  "2|dense tp 2|$dense --num-layers 4 --hidden-size 256 --ffn-hidden-size 1024 --seq-length 256 --micro-batch-size 4 --global-batch-size 8 --tensor-model-parallel-size 2"
  "2|dense tp 2 + sp|$dense --num-layers 4 --hidden-size 256 --ffn-hidden-size 1024 --seq-length 256 --micro-batch-size 4 --global-batch-size 8 --tensor-model-parallel-size 2 --sequence-parallel"
  "2|dense dp 2|$dense --num-layers 4 --hidden-size 256 --ffn-hidden-size 1024 --seq-length 256 --micro-batch-size 4 --global-batch-size 8 --devices 2"
  "2|dense pp 2, 1f1b, 4 micro-batches|$dense --num-layers 4 --hidden-size 256 --ffn-hidden-size 1024 --seq-length 256 --micro-batch-size 2 --global-batch-size 8 --pipeline-model-parallel-size 2"
  "2|MoE ep 2|$moe --num-layers 2 --hidden-size 256 --ffn-hidden-size 512 --seq-length 256 --micro-batch-size 4 --global-batch-size 8 --devices 2 --expert-model-parallel-size 2"
  "2|MoE ep 2, Ampipe degree 2|$moe --num-layers 2 --hidden-size 256 --ffn-hidden-size 512 --seq-length 256 --micro-batch-size 4 --global-batch-size 8 --devices 2 --expert-model-parallel-size 2 --ampipe-degree 2"
  "2|MoE tp 2 + sp|$moe --num-layers 2 --hidden-size 256 --ffn-hidden-size 512 --seq-length 256 --micro-batch-size 4 --global-batch-size 8 --tensor-model-parallel-size 2 --sequence-parallel"
)

printf '\n%-40s %8s %12s %12s %8s\n' configuration devices "wall ms" "predicted ms" error
errors=()
for entry in "${configs[@]}"; do
  IFS='|' read -r n name flags <<<"$entry"
  # shellcheck disable=SC2086
  "$weave" train $flags --train-iters "$iterations" --log-interval 1 --log-json "$work/log.json" \
    >/dev/null
  wall=$(grep '"type":"iteration"' "$work/log.json" | sed -n '3,$p' |
    sed 's/.*"seconds":\([0-9.e+-]*\).*/\1/' | sort -g |
    awk '{ v[NR] = $1 } END { if (NR % 2) print 1000 * v[(NR + 1) / 2];
                              else print 500 * (v[NR / 2] + v[NR / 2 + 1]) }')
  # shellcheck disable=SC2086
  predicted=$("$weave" predict $flags --accelerator "$work/host$n.json" |
    sed -n 's/^step *\([0-9.]*\) ms/\1/p')
  error=$(awk -v p="$predicted" -v w="$wall" 'BEGIN { printf "%.1f", 100 * (p - w) / w }')
  errors+=("$error")
  printf '%-40s %8s %12.2f %12.2f %7s%%\n' "$name" "$n" "$wall" "$predicted" "$error"
done
printf '%s\n' "${errors[@]}" | tr -d '-' | sort -g |
  awk '{ v[NR] = $1 } END { med = NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2;
        printf "\nmedian |error| %.1f %%, largest %.1f %% (target: median at most 5 %%, none above 10 %%)\n", med, v[NR] }'
