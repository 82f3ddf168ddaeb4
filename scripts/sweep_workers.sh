#!/usr/bin/env bash
# One `lenet sweep --search optuna` worker per GPU of this machine, all on one study (lenet/study.py):
#   bash scripts/sweep_workers.sh STORAGE OUT [lenet sweep flags ...]
#   bash scripts/sweep_workers.sh sqlite:///runs/study.db runs/study --trials 256 --lr 0.02:0.5 --validation 10000
# Each worker is pinned to its GPU with CUDA_VISIBLE_DEVICES (a list of the GPUs to use may be given in
# $GPUS, e.g. GPUS="0 2"; default: every GPU nvidia-smi lists) and writes under OUT/gpuN; its log is
# OUT/gpuN.log. Workers on other machines join the same study by running `lenet sweep` with the same flags
# and --storage. Exits with the first failing worker's status (0 when every worker finished).
set -u -o pipefail
if [ $# -lt 2 ] || [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
    [ $# -lt 2 ] && [ "${1:-}" != -h ] && [ "${1:-}" != --help ] && exit 2
    exit 0
fi
storage=$1 out=$2
shift 2
for f in "$@"; do
    case $f in
        --storage|--storage=*|--out|--out=*) echo "sweep_workers: give the storage and the folder as the first two arguments, not $f" >&2; exit 2;;
    esac
done
gpus=${GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr '\n' ' ')}
if [ -z "${gpus// }" ]; then
    echo "sweep_workers: no GPU found (nvidia-smi lists none); set GPUS to the indices to use" >&2
    exit 2
fi
mkdir -p "$out" || exit 2
pids=()
for g in $gpus; do
    CUDA_VISIBLE_DEVICES=$g python3 -m lenet sweep --search optuna --storage "$storage" --out "$out/gpu$g" --quiet "$@" \
        > "$out/gpu$g.log" 2>&1 &
    pids+=($!)
    echo "worker on GPU $g: pid $!, log $out/gpu$g.log"
done
rc=0
for p in "${pids[@]}"; do
    wait "$p" || { s=$?; [ $rc = 0 ] && rc=$s; }
done
exit $rc
