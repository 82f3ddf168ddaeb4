#!/usr/bin/env bash
# The GPU check: run on a machine with an NVIDIA GPU, from the repository root.
#   bash scripts/gpu_check.sh            # logs under $OUT (or out/gpu-check)
# Runs the GPU tests with LENET_REQUIRE_GPU=1 (a skipped test fails), then train_step under
# each engine and policy, then compute-sanitizer memcheck over a few steps (eager and CUDA graph),
# and ends with one summary line: passed / failed / skipped, programs, memcheck, GPU, cuDNN.
# Wheels in .whl/ (packages the machine lacks, e.g. nvmath-python) are installed to /tmp/site.
set -u -o pipefail
out=${OUT:-out/gpu-check}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || { echo "gpu-check: could not install .whl/*.whl"; exit 1; }
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/nvidia-smi.txt"

LENET_REQUIRE_GPU=1 python3 -m pytest -m gpu -q -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$out/pytest.log"
test_rc=${PIPESTATUS[0]}

prog_rc=0
for engine in auto graph legacy; do
    for algo in heuristic exhaustive; do
        python3 -m lenet.train_step --engine "$engine" --algo "$algo" --steps 100 2>&1 \
            | tee "$out/train_step_${engine}_$algo.txt"
        [ "${PIPESTATUS[0]}" = 0 ] || prog_rc=1
    done
done
python3 -m lenet.train_step --algo exhaustive --steps 20 --no-cuda-graph --no-fused 2>&1 | tee "$out/train_step_eager.txt"
[ "${PIPESTATUS[0]}" = 0 ] || prog_rc=1
# compute-sanitizer memcheck over a few steps, eager and CUDA graph: an invalid access fails the
# check. The step frees everything before it exits, which a plain run verifies (the pool must hold
# 0 bytes). Under the sanitizer, --leak-check full still lists the pool's allocations as held at
# exit (149 MB on an H100) although the same run without the sanitizer frees them all: not yet
# understood, so the leak listing is logged, not judged.
san_rc=0
python3 scripts/profile_step.py --batch 64 --steps 3 --algo heuristic --deterministic > "$out/cleanup.txt" 2>&1
grep -q "pool holds 0 bytes" "$out/cleanup.txt" || san_rc=1
sed "s/^/cleanup: /" "$out/cleanup.txt" | tail -1
for mode in eager graph; do
    flag=$([ "$mode" = graph ] && echo --graph)
    compute-sanitizer --tool memcheck --error-exitcode 7 \
        python3 scripts/profile_step.py --batch 64 --steps 3 --algo heuristic --deterministic $flag \
        > "$out/sanitizer_$mode.txt" 2>&1 || san_rc=1
    grep -E "ERROR SUMMARY|^loss" "$out/sanitizer_$mode.txt" | sed "s/^/sanitizer $mode: /"
done

for extra in ${GPU_CHECK_EXTRA:-}; do   # more commands, e.g. a short training run, named by the caller
    bash -c "$extra" 2>&1 | tee -a "$out/extra.txt"; [ "${PIPESTATUS[0]}" = 0 ] || prog_rc=1
done

python3 - "$out/pytest.log" "$test_rc" "$prog_rc" "$san_rc" <<'PY' | tee "$out/summary.txt"
import re, sys
log, test_rc, prog_rc, san_rc = open(sys.argv[1]).read(), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
count = lambda w: sum(int(n) for n in re.findall(r"(\d+) " + w, log.strip().splitlines()[-1] if log.strip() else ""))
gpu = re.findall(r"^GPU: (.*) \| cuDNN (.*)$", log, re.M)
g, c = gpu[-1] if gpu else ("unknown", "unknown")
ok = test_rc == 0 and prog_rc == 0 and san_rc == 0 and count("passed") > 0 and count("skipped") == 0
print(f"gpu-check: {'PASS' if ok else 'FAIL'} | {count('passed')} passed, {count('failed')} failed, "
      f"{count('skipped')} skipped, {count('error')} errors | programs {'ok' if prog_rc == 0 else 'FAILED'} "
      f"| memcheck {'clean' if san_rc == 0 else 'FAILED'} | GPU {g} | cuDNN {c}")
sys.exit(0 if ok else 1)
PY
