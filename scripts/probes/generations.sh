#!/usr/bin/env bash
# Probe (GPU): one GPU generation's code path on this GPU (Note [kernel architecture] in
# lenet/kernels/nvrtc.py): our kernels compiled as PTX for compute capability ARCH, then what fits an SM
# (resident.py), the heuristic's candidate rows on whole steps (heuristic_rows.py) and stage 2's backward
# versions alone at large batches (stage_kernels.py). Logs under OUTDIR.
#   bash scripts/probes/generations.sh 75 $OUT/arch75 [GPU]
set -u -o pipefail
arch=$1 out=$2 gpu=${3:-0}
mkdir -p "$out"
export CUDA_VISIBLE_DEVICES=$gpu LENET_KERNEL_ARCH=$arch PYTHONUNBUFFERED=1 LENET_PLAN_CACHE=/tmp/plans-$arch.json
[ "$arch" = 90 ] && unset LENET_KERNEL_ARCH
python3 scripts/probes/resident.py > "$out/resident.txt" 2>&1
if [ "$arch" -ge 80 ]; then b2="fused-bwd-v7-g2 fused-bwd-v7-g4 fused-bwd-v8-g3"
else b2="fused-bwd-v3-g4 fused-bwd-v4-g2 fused-bwd-v4-g4 fused-bwd-v5-g2 fused-bwd-v5-g4"; fi
python3 scripts/probes/heuristic_rows.py --steps 200 --batch 1 64 128 256 1024 --conv2-backward $b2 \
    > "$out/rows_small.txt" 2>&1
python3 scripts/probes/heuristic_rows.py --steps 30 --batch 8192 65536 --forward fused-fwd-v1-i1-g8 \
    --conv2-backward $b2 > "$out/rows_large.txt" 2>&1
python3 scripts/probes/stage_kernels.py --batch 2048 8192 65536 --kernel stage2_backward stage1_backward \
    > "$out/kernels.txt" 2>&1
echo "arch $arch done"
