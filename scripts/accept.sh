#!/usr/bin/env bash
# Fashion-MNIST acceptance: ours under several algorithm policies and modes beside the PyTorch
# reference trainer (same init, data, order, schedule). Prints one line per run; metrics to $OUT.
#   bash scripts/accept.sh "--epochs 20"            # hyperparameters shared by every run
#   SEEDS="1 2" bash scripts/accept.sh "--epochs 20"  # only ours (heuristic) and the reference, per seed
set -u -o pipefail
cfg=${1:-"--epochs 20"}
out=${OUT:-out/accept}
mkdir -p "$out"
line() { grep -E "^final" | sed "s/^/$1 | /"; }
if [ -n "${SEEDS:-}" ]; then
    for seed in $SEEDS; do
        python3 -m lenet.train --quiet $cfg --seed "$seed" --out "/tmp/accept-seed$seed" 2>&1 | line "ours seed $seed"
        python3 scripts/torch_train.py $cfg --seed "$seed" 2>&1 | grep -E "^torch final" | sed "s/^/reference seed $seed | /"
    done
    exit 0
fi
for v in "heuristic:--algo heuristic" "exhaustive:--algo exhaustive" "deterministic:--deterministic" \
         "eager:--no-cuda-graph"; do
    name=${v%%:*}; flags=${v#*:}
    python3 -m lenet.train --quiet $cfg $flags --out "/tmp/accept-$name" 2>&1 | line "ours $name"
done
python3 scripts/torch_train.py $cfg --json "$out/torch.json" 2>&1 | grep -E "^torch final" | sed "s/^/reference | /"
