#!/usr/bin/env bash
# A sweep's seed-0 model against its lone `lenet train` run, epoch by epoch, on the GPU machine:
#   bash scripts/probes/pack_vs_lone.sh [FLAGS...]     (FLAGS for both, e.g. --deterministic --no-tta)
# (the sweep's defaults are the fast recipe, which the lone run names). Prints each epoch's test accuracy and loss of both, and whether they are equal.
set -u
out=${OUT:-/tmp/pack-vs-lone}
mkdir -p "$out"
common=($(python3 -c "from lenet.pack import Config; print(' '.join(Config(epochs=${EPOCHS:-2}).train_flags()))"))
tta=--tta
for a in "$@"; do [ "$a" = --no-tta ] && tta=; done
flags=(); for a in "$@"; do [ "$a" != --no-tta ] && flags+=("$a"); done
python3 -m lenet sweep --quiet --seeds 0-2 --epochs "${EPOCHS:-2}" ${tta:---no-tta} "${flags[@]}" --rank-on-test \
    --overwrite \
    --out "$out/sweep" > "$out/sweep.log" 2>&1 || { tail -3 "$out/sweep.log"; exit 1; }
python3 -m lenet train --quiet "${common[@]}" $tta "${flags[@]}" --overwrite --out "$out/lone" \
    > "$out/lone.log" 2>&1 || { tail -3 "$out/lone.log"; exit 1; }
python3 - "$out" "$*" <<'PY'
import json, sys
from pathlib import Path
sys.path.insert(0, ".")
from lenet import checkpoint as ckpt
out = Path(sys.argv[1])
row = next(r for r in map(json.loads, (out / "sweep" / "results.jsonl").read_text().splitlines()) if r["config"]["seed"] == 0)
_, _, meta = ckpt.load(out / "lone" / "checkpoint.npz")
lone = [(h["test_accuracy"], h["test_loss"]) for h in meta["history"]]
pack = list(zip(row["accuracy"], row["loss"]))
for e, (p, l) in enumerate(zip(pack, lone)):
    print(f"[{sys.argv[2]}] epoch {e + 1}: pack {100 * p[0]:.2f}% {p[1]:.6f} | lone {100 * l[0]:.2f}% {l[1]:.6f} | "
          f"{'equal' if p == l else 'DIFFER'}")
PY
