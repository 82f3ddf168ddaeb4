#!/usr/bin/env bash
# Probe (GPU, a machine of two or more GPUs): `lenet sweep --gpus` timed on one GPU and on all, caches warm
# on both sides (a first untimed run pays the kernels' compiles and the pack's plan search), and Ctrl-C:
# a SIGINT to the parent while its workers train, then --resume to the end. Logs under OUTDIR.
#   bash scripts/probes/two_gpus.sh OUTDIR [DATA]
# The grid: the fast recipe, 8 learning rates x 4 label smoothings x 16 seeds = 512 trials, packs of 64.
set -u
out=$1 data=${2:-data/fashion-mnist}
mkdir -p "$out"
grid="--search optuna --sampler grid --trials 512 --lr 0.05 0.075 0.1 0.125 0.15 0.175 0.2 0.25
      --label-smoothing 0 0.05 0.1 0.15 --seeds 0-15 --data-dir $data --quiet"
work=$(mktemp -d)
timed() {   # timed NAME GPUS: one sweep of the grid on those GPUs, seconds to exit appended to its log
    local s e
    s=$(date +%s.%N)
    CUDA_VISIBLE_DEVICES=$2 python3 -m lenet sweep --gpus all $grid --out "$work/$1" > "$out/$1.txt" 2>&1
    echo "rc=$? wall $(python3 -c "print(round($(date +%s.%N) - $s, 1))") s" >> "$out/$1.txt"
}
all=$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd,)
timed warm 0
timed one 0
timed all "$all"
CUDA_VISIBLE_DEVICES=$all python3 -m lenet sweep --gpus all $grid --out "$work/int" > "$out/int.txt" 2> "$out/int.err" &
p=$!
sleep 12
kill -INT $p
wait $p
echo "after SIGINT: rc=$? stderr lines $(grep -c . "$out/int.err")" >> "$out/int.txt"
CUDA_VISIBLE_DEVICES=$all python3 -m lenet sweep --gpus all $grid --out "$work/int" --resume >> "$out/int.txt" 2>&1
echo "resumed: rc=$? rows $(wc -l < "$work/int/results.jsonl")" >> "$out/int.txt"
for f in one all int; do echo "== $f"; tail -4 "$out/$f.txt"; done
rm -rf "$work"
