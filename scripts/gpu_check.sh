#!/usr/bin/env bash
# The GPU check: run on a machine with an NVIDIA GPU, from the repository root.
#   bash scripts/gpu_check.sh            # logs under $OUT (or out/gpu-check)
#   bash scripts/gpu_check.sh tests      # only the GPU tests; `programs`: the programs, memcheck and the
#                                        # hostile-environment and start-up tests (their GPU branches);
#                                        # `racecheck`, `synccheck`, `initcheck`: that sanitizer over one
#                                        # model's steps; `packs`: the three over a pack of three models
#                                        # (`packs-racecheck` ...: one of them);
#                                        # `sanitizers`: all of these
# (each part prints its own summary line, saying what it ran. On an H100 the three sanitizers over one model
# and the pack ran past ten minutes once the tail form's pack version joined them: racecheck and synccheck
# with three of the pack's initchecks took 590 s, racecheck alone over both past 560 s; the parts are
# split so that each fits a device call of ten minutes)
# Runs the GPU tests with LENET_REQUIRE_GPU=1 (a skipped test fails), then train_step under
# each engine and policy, then compute-sanitizer memcheck and leak check over a few steps (eager and CUDA graph),
# racecheck and synccheck over our stage kernels, initcheck over a step of every engine, and ends with one
# summary line: passed / failed / skipped,
# programs, sanitizer, GPU, cuDNN.
# Wheels in .whl/ (packages the machine lacks, e.g. nvmath-python) are installed to /tmp/site.
# The GPU machine lacks nvmath-python, nvidia-cudnn-frontend (1.28.0) and the sweep extra: Optuna with alembic, colorlog,
# mako, markupsafe, pyyaml and sqlalchemy (cp312 wheels); without the latter the sweep's GPU tests skip, which fails.
# A Pillow wheel (10.1 or later: the plot's scalable font, lenet/chart.py) goes with them wherever the machine's
# own Pillow may be older: without one that can plot, a run writes no curves.png and the tests that read it fail.
set -u -o pipefail
case "${1:-all}" in   # a part not named here would run nothing and pass
    all|tests|programs|racecheck|synccheck|initcheck|sanitizers|packs|packs-racecheck|packs-synccheck|packs-initcheck|arch|spread) ;;
    *) echo "gpu-check: no part ${1}: all, tests, programs, racecheck, synccheck, initcheck, sanitizers, packs," \
            "packs-racecheck, packs-synccheck, packs-initcheck, arch A, spread"; exit 2 ;;
esac
out=${OUT:-out/gpu-check}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null && [ -z "${GPU_CHECK_WHEELS_IN:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || { echo "gpu-check: could not install .whl/*.whl"; exit 1; }
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/nvidia-smi.txt"
python3 -c "import os; print(len(os.sched_getaffinity(0)))" > "$out/cpus.txt" 2>/dev/null \
    || nproc > "$out/cpus.txt"   # the CPUs this part may use (a spread's worker: its share)

part=${1:-all}
test_rc=0 prog_rc=0 san_rc=0
# `spread`: the whole check over every GPU of the machine (or $GPU_CHECK_GPUS of them), the parts longest first
# from one queue, each GPU taking the next part when it is free; each part runs in its own copy of the checkout
# (a part's checkout check sees only its own files) with the wheels installed once, here. Prints each part's
# summary line (ending with its wall clock), then one line for the whole. The queue runs on two stand-in GPUs
# without a GPU (tests/test_gpu_check_cpu.py); the parts' times on H100s and H200s, and the four-GPU run that
# led to the workers' pinning below: docs/probes.md, "The GPU check on four GPUs".
# GPU_CHECK_SLOTS=N: N workers a GPU (default 1). Each part then runs on a GPU that other processes share, as a
# user's may be: each stream's work waits its turn there, so a read on one stream of what another has not
# finished shows. Timing-driven choices (the planner's) see each other's work; the checks judge results, never
# times. What it found: docs/probes.md, "The GPU check on a shared GPU".
if [ "$part" = spread ]; then
    if [ -n "${GPU_CHECK_GPUS:-}" ] && ! [[ $GPU_CHECK_GPUS =~ ^[1-9][0-9]*$ ]]; then   # 08 is no number to bash
        echo "gpu-check (spread): GPU_CHECK_GPUS must be a whole number >= 1, not '$GPU_CHECK_GPUS'"; exit 2
    fi
    gpus=${GPU_CHECK_GPUS:-$(nvidia-smi -L | grep -c '^GPU')}
    out=$(cd "$out" && pwd)
    [ "$gpus" -ge 1 ] 2>/dev/null || { echo "gpu-check (spread): no GPU"; exit 1; }
    slots=${GPU_CHECK_SLOTS:-1}
    [[ $slots =~ ^[1-9][0-9]*$ ]] || { echo "gpu-check (spread): GPU_CHECK_SLOTS must be a whole number >= 1, not '$slots'"; exit 2; }
    work=$(mktemp -d); queue=$work/queue
    fixed=tests/test_model_gpu.py::test_parity_every_fixed_combination   # a third of the model's tests' time
    printf '%s\n' "tests-parity|$fixed" \
        "tests-model|tests/test_model_gpu.py --deselect $fixed tests/test_pack_gpu.py tests/test_readme_gpu.py tests/test_startup.py" \
        "tests-stages|tests/test_descriptors_gpu.py tests/test_graph_gpu.py tests/test_stages_gpu.py tests/test_head_gpu.py tests/test_step_gpu.py" \
        "tests-torch|tests/test_torch_gpu.py tests/test_numerics_gpu.py tests/test_bench_gpu.py" \
        "tests-train|tests/test_train_gpu.py tests/test_recipe_gpu.py tests/test_sweep_gpu.py" \
        "racecheck|" "synccheck|" "programs|" "initcheck|" "packs-racecheck|" "packs-synccheck|" "packs-initcheck|" > "$queue"
    # GPU_CHECK_PARTS: some of the queue's parts only (their names, space-separated), for a machine's time
    # limit; the summary then names the parts that ran, and says it is not the whole check.
    if [ -n "${GPU_CHECK_PARTS:-}" ]; then
        for p in $GPU_CHECK_PARTS; do
            grep -q "^$p|" "$queue" || { echo "gpu-check (spread): no part $p in the queue: $(cut -d'|' -f1 "$queue" | tr '\n' ' ')"; exit 2; }
        done
        grep -E "^($(echo $GPU_CHECK_PARTS | tr ' ' '|'))\|" "$queue" > "$queue.some" && mv "$queue.some" "$queue"
    fi
    parts=$(cut -d'|' -f1 "$queue" | tr '\n' ' ')   # what this run's summary counts (not older runs' folders)
    # Each worker on CPUs of its own (taskset): NumPy's BLAS and PyTorch's CPU threads count the CPUs a
    # process may use, so unpinned parts each start a thread a CPU of the machine and wait on each other.
    # Worker w takes the w-th of W even shares of the CPUs this script may use (fewer CPUs than workers: one
    # each, shared); where taskset or python3 is missing or refuses, the parts run unpinned and say so.
    mapfile -t shares < <(python3 -c "import os; c = sorted(os.sched_getaffinity(0)); n, W = len(c), $((gpus * slots))
for w in range(W): print(','.join(map(str, c[w * n // W:(w + 1) * n // W] or [c[w * n // W]])))" 2>/dev/null)
    worker() {   # worker w runs on GPU w mod gpus
        local w=$1 g=$(( $1 % gpus )) line name args pin=() t0 share=${shares[$1]:-}
        if [ -n "$share" ] && taskset -c "$share" true 2>/dev/null; then
            pin=(taskset -c "$share")
        fi
        while line=$(flock "$queue.lock" sh -c 'head -1 "$0"; sed -i 1d "$0"' "$queue") && [ -n "$line" ]; do
            name=${line%%|*} args=${line#*|} t0=$(date +%s)
            rm -rf "$work/g$w" "$out/$name"; mkdir "$work/g$w"   # no earlier run's summary left to count
            { [ -n "${pin[*]:-}" ] || echo "gpu-check (spread): $name runs unpinned (no taskset share)"; } > "$out/$name.txt"
            tar -C . --exclude="./${out#"$PWD"/}" -cf - . | tar -C "$work/g$w" -xf -   # without the logs
            # pytest empties its --basetemp at start: a worker's own, after any the caller's PYTEST_ADDOPTS names
            (cd "$work/g$w" && CUDA_VISIBLE_DEVICES=$g GPU_CHECK_WHEELS_IN=1 PYTEST_ARGS="$args" OUT="$out/$name" \
                PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} --basetemp=$work/t$w" \
                ${pin[@]+"${pin[@]}"} bash scripts/gpu_check.sh "$([ "${name#tests-}" = "$name" ] && echo "$name" || echo tests)" \
                >> "$out/$name.txt" 2>&1)
            mkdir -p "$out/$name" && echo $(( $(date +%s) - t0 )) > "$out/$name/seconds"   # the part's wall clock
        done
        rm -rf "$work/g$w"
    }
    for w in $(seq 0 $((gpus * slots - 1))); do worker "$w" & done
    wait
    rm -rf "$work"
    python3 scripts/gpu_check_summary.py "$out" "$parts" | tee "$out/summary.txt"
    exit "${PIPESTATUS[0]}"
fi
# `arch A`: an older GPU generation's code path on this GPU (Note [kernel architecture] in
# lenet/kernels/nvrtc.py): our kernels compiled as PTX for compute capability A (75: a T4; 80: an A100; 86,
# 89), then the GPU tests of the model, stages, head, numerics, packs and lenet.torch (every engine), and the
# programs: train_step under every engine, the fast recipe (seeds 0-2, each >= 91%), a sweep of 16 seeds,
# predict and export of its winner.
if [ "$part" = arch ]; then
    export LENET_KERNEL_ARCH=${2:?"gpu_check.sh arch needs a compute capability: 75, 80, 86, 89"}
    export LENET_PLAN_CACHE=/tmp/lenet-plans-$LENET_KERNEL_ARCH.json
    part="arch $LENET_KERNEL_ARCH"
    LENET_REQUIRE_GPU=1 python3 -B -m pytest -m gpu -q -p no:cacheprovider ${PYTEST_ARGS:-} tests/test_model_gpu.py \
        tests/test_stages_gpu.py tests/test_head_gpu.py tests/test_numerics_gpu.py tests/test_pack_gpu.py \
        tests/test_torch_gpu.py 2>&1 | tee "$out/pytest.log"
    test_rc=${PIPESTATUS[0]}
    for engine in auto ours graph legacy; do
        python3 -m lenet.train_step --engine "$engine" --steps 20 > "$out/train_step_$engine.txt" 2>&1 || prog_rc=1
        tail -1 "$out/train_step_$engine.txt" | sed "s/^/train_step $engine: /"
    done
    data=${LENET_CHECK_DATA:-data/fashion-mnist}
    for seed in 0 1 2; do
        # the fast recipe (scripts/time_to_accuracy.py's RECIPES["fast"])
        python3 -m lenet train --epochs 16 --batch-size 150 --schedule cosine --lr 0.15 --nesterov \
            --label-smoothing 0.05 --warmup-epochs 1 --flip --tta --seed $seed --data-dir "$data" --quiet \
            > "$out/train_$seed.txt" 2>&1 || prog_rc=1
        line=$(grep "^final" "$out/train_$seed.txt")
        echo "train seed $seed: $line"
        acc=$(echo "$line" | sed -n 's/.*test accuracy \([0-9.]*\)%.*/\1/p')
        python3 -c "import sys; sys.exit(0 if float('${acc:-0}') >= 91.0 else 1)" || { prog_rc=1; echo "train seed $seed: below 91%"; }
    done
    sweep=$(mktemp -d)
    python3 -m lenet sweep --seeds 0-15 --data-dir "$data" --out "$sweep/s" --quiet > "$out/sweep.txt" 2>&1 || prog_rc=1
    grep -E "models|winner alone" "$out/sweep.txt" | head -2 | sed "s/^/sweep: /"
    python3 -m lenet export "$sweep/s/best/checkpoint.npz" --to "$sweep/m.safetensors" > "$out/export.txt" 2>&1 || prog_rc=1
    python3 -m lenet predict --checkpoint "$sweep/s/best/checkpoint.npz" "$data"/t10k-images-idx3-ubyte* \
        --labels "$data"/t10k-labels-idx1-ubyte* > "$out/predict.txt" 2>&1 || prog_rc=1
    tail -1 "$out/predict.txt" | sed "s/^/predict: /"
    rm -rf "$sweep"
fi
if [ "$part" = all ] || [ "$part" = tests ]; then
LENET_REQUIRE_GPU=1 python3 -B -m pytest -m gpu -q -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$out/pytest.log"
test_rc=${PIPESTATUS[0]}
elif [ "${part#arch}" = "$part" ]; then
    echo "GPU tests not run in this part" > "$out/pytest.log"
fi

if [ "$part" = all ] || [ "$part" = programs ]; then
for engine in auto ours graph legacy; do
    for algo in heuristic exhaustive; do
        python3 -m lenet.train_step --engine "$engine" --algo "$algo" --steps 100 2>&1 \
            | tee "$out/train_step_${engine}_$algo.txt"
        [ "${PIPESTATUS[0]}" = 0 ] || prog_rc=1
    done
done
python3 -m lenet.train_step --algo exhaustive --steps 20 --no-cuda-graph --no-fused 2>&1 | tee "$out/train_step_eager.txt"
[ "${PIPESTATUS[0]}" = 0 ] || prog_rc=1
# The programs in hostile environments and their start-up, where a GPU takes them further than CI's machine
# does (these tests have a GPU's branch: on an H100 a HOME that did not exist was made by the CUDA driver's
# compute cache, which no machine without a GPU reaches). About 80 s on an H100.
python3 -B -m pytest -q -p no:cacheprovider tests/test_hostile_cpu.py tests/test_startup.py > "$out/hostile.txt" 2>&1 \
    || prog_rc=1
tail -1 "$out/hostile.txt" | sed "s/^/hostile and start-up tests: /"
# compute-sanitizer memcheck over a few steps, eager and CUDA graph, with --leak-check full: an
# invalid access or an allocation still held at exit fails the check (profile_step frees the
# model, the caches and the pool before it exits). --show-backtrace no: saving a backtrace for
# every allocation makes the sanitizer hold the Python frames of the allocating calls, and
# those frames hold the arrays, so with backtraces on, everything allocated in a function that
# returned is still alive at exit (149 MB listed on an H100; the same run without backtraces:
# 0 bytes). An error is then located by rerunning that one command with backtraces on.
# At 150 images too: the head's weight gradients run their passes of eight images, four and one there (64
# is eight eights; Note [the weights' loads in flight] in lenet/kernels/head_weights.cu).
for mode in eager graph; do
    flag=$([ "$mode" = graph ] && echo --graph)
    for batch in 64 150; do
        log="$out/sanitizer_${mode}_${batch}.txt"
        compute-sanitizer --tool memcheck --leak-check full --show-backtrace no --error-exitcode 7 \
            python3 scripts/profile_step.py --batch $batch --steps 3 --algo heuristic --deterministic $flag \
            > "$log" 2>&1 || san_rc=1
        grep -q "LEAK SUMMARY: 0 bytes leaked in 0 allocations" "$log" || san_rc=1
        grep -q "pool holds 0 bytes" "$log" || san_rc=1
        grep -E "ERROR SUMMARY|LEAK SUMMARY|pool holds|^loss" "$log" | sed "s/^/sanitizer $mode $batch: /"
    done
done
fi

# Which sanitizers run, over one model's steps (and lenet.torch's, and every engine's for initcheck) and
# over the pack of three: a part per tool runs it over one model's; `packs` runs the three over the pack.
case "$part" in
    all|sanitizers) tools="racecheck synccheck initcheck" pack_tools=$tools ;;
    racecheck|synccheck|initcheck) tools=$part pack_tools="" ;;
    packs) tools="" pack_tools="racecheck synccheck initcheck" ;;
    packs-racecheck|packs-synccheck|packs-initcheck) tools="" pack_tools=${part#packs-} ;;
    *) tools="" pack_tools="" ;;
esac
if [ -n "$tools$pack_tools" ]; then

# racecheck (shared-memory hazards) and synccheck (barrier misuse) over a step of --engine ours (its
# kernels are all ours but the plan-time check's), at a batch that fills whole groups and one that leaves a
# partial group, and at the batches where the heuristic takes each shape (HEURISTIC in
# lenet/kernels/stages.py on 132 SMs: stage 2's tensor-core backward in two warp roles and named barriers,
# version 7, with 4 blocks an SM up to 200, one image a block below 132, and with 2 at 2100; version 8, three
# blocks an SM, from 4224, past these batches: it runs in the stage kernels' lines below); the forwards' two images a block iteration
# at 1 and 128; stage 1's dense backward at all of them). Every other version of every stage kernel runs
# once under both tools below (scripts/probes/stage_kernels.py --once). The head: head_split.cu's kernels (its loss
# total on the side stream's second lane) up to 256 images (1, 64, 7, 128, 200), the tail form above (cuBLASLt's fc1 products and head_tail.cu's
# kernels, 263 blocks at 2100, beside stage 2's dense backward: lenet/kernels/head.py, shapes); head.cu's
# forward in the deterministic pack of 300 below.
for tool in ${tools/initcheck/}; do
    for batch in 1 64 7 128 200 2100; do
        for flag in ""; do
            log="$out/${tool}_${batch}${flag:+_graph}.txt"
            compute-sanitizer --tool $tool --error-exitcode 7 \
                python3 scripts/profile_step.py --batch $batch --steps 2 --engine ours --algo heuristic $flag \
                > "$log" 2>&1 || san_rc=1
            grep -qE "(RACECHECK|ERROR) SUMMARY: 0 " "$log" || san_rc=1
            grep -E "SUMMARY|^loss" "$log" | sed "s/^/$tool batch $batch${flag:+ graph}: /"
        done
    done
done

# Every launch shape of every stage kernel version (the ones no heuristic takes as well), once, at 7
# images and at 300 (a g2 block takes two images in turn).
for tool in ${tools/initcheck/}; do
    log="$out/${tool}_stage_kernels.txt"
    compute-sanitizer --tool $tool --error-exitcode 7 \
        python3 scripts/probes/stage_kernels.py --once --batch 7 300 > "$log" 2>&1 || san_rc=1
    grep -qE "(RACECHECK|ERROR) SUMMARY: 0 " "$log" || san_rc=1
    echo "$tool every stage kernel version at 7 and 300: $(grep -cE 'fused-(fwd|bwd)' "$log") launch shapes, $(grep -E 'SUMMARY' "$log")"
    # stage 2's backward in two roles, versions 7 and 8, at 1200 images: 2 to 5 images a block (g4 to g2),
    # a buffer filled again from the third (at 300 a block takes at most two)
    log="$out/${tool}_stage2_roles.txt"
    compute-sanitizer --tool $tool --error-exitcode 7 \
        python3 scripts/probes/stage_kernels.py --once --kernel stage2_backward_roles --per-sm 2 3 4 --batch 1200 \
        > "$log" 2>&1 || san_rc=1
    grep -qE "(RACECHECK|ERROR) SUMMARY: 0 " "$log" || san_rc=1
    echo "$tool stage 2's backward versions 7 and 8 at 1200: $(grep -cE 'fused-bwd' "$log") launch shapes, $(grep -E 'SUMMARY' "$log")"
done

# The same over a pack of 3 models (lenet sweep): our stage kernels take the model from blockIdx.y, and
# the loss, the update and the gather kernels too (Note [model from the grid] in stage_common.cu); with
# --deterministic our head's pack versions too (each model on its lone grid: head_common.cu), at 7 images
# (one range of weight gradients) and 300 (two, summed by the pack's reduction), and the tail's pack
# version at 300 (cuBLASLt's batched products, each model's rows summed by the pack's reduction).
for tool in $pack_tools; do
    for pack in "7" "7 --deterministic" "300 --deterministic" "300"; do
        log="$out/${tool}_pack_${pack// /_}.txt"
        compute-sanitizer --tool $tool --error-exitcode 7 \
            python3 scripts/profile_step.py --models 3 --steps 2 --engine ours --algo heuristic --batch $pack \
            > "$log" 2>&1 || san_rc=1
        grep -qE "(RACECHECK|ERROR) SUMMARY: 0 " "$log" || san_rc=1
        grep -E "SUMMARY|^loss" "$log" | sed "s/^/$tool pack of 3, batch $pack: /"
    done
done

# The same over our module driven from PyTorch (lenet/torch.py): the head's kernel then reads the
# dlogits of torch's loss (its given-dlogits path) instead of computing its own.
for tool in ${tools/initcheck/}; do
    log="$out/${tool}_torch.txt"
    compute-sanitizer --tool $tool --error-exitcode 7 \
        python3 scripts/torch_bench.py --check 2 --engine ours --batch 64 7 > "$log" 2>&1 || san_rc=1
    grep -qE "(RACECHECK|ERROR) SUMMARY: 0 " "$log" || san_rc=1
    grep -E "SUMMARY|^batch" "$log" | sed "s/^/$tool torch: /"
done

# initcheck (reads of device memory nothing wrote) over a step of every engine, the planning included:
# every buffer the planner times candidates on is written first, so any report is a real one.
for engine in $([ "${tools/initcheck/}" = "$tools" ] || echo ours legacy graph auto); do
    log="$out/initcheck_$engine.txt"
    compute-sanitizer --tool initcheck --error-exitcode 7 \
        python3 scripts/profile_step.py --batch 64 --steps 1 --engine $engine --algo heuristic > "$log" 2>&1 || san_rc=1
    grep -qE "ERROR SUMMARY: 0 " "$log" || san_rc=1
    grep -E "SUMMARY|^loss" "$log" | sed "s/^/initcheck $engine: /"
done

fi

if [ "$part" = all ] || [ "$part" = programs ]; then
for extra in ${GPU_CHECK_EXTRA:-}; do   # more commands, e.g. a short training run, named by the caller
    bash -c "$extra" 2>&1 | tee -a "$out/extra.txt"; [ "${PIPESTATUS[0]}" = 0 ] || prog_rc=1
done
fi

python3 - "$out/pytest.log" "$test_rc" "$prog_rc" "$san_rc" "$part" <<'PY' | tee "$out/summary.txt"
import re, subprocess, sys
log, test_rc, prog_rc, san_rc = open(sys.argv[1]).read(), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
part = sys.argv[5]
count = lambda w: sum(int(n) for n in re.findall(r"(\d+) " + w, log.strip().splitlines()[-1] if log.strip() else ""))
gpu = re.findall(r"^GPU: (.*) \| cuDNN (.*)$", log, re.M)
g, c = gpu[-1] if gpu else ("unknown", "unknown")
if not gpu:
    q = "import cupy, descriptors; print(cupy.cuda.runtime.getDeviceProperties(0)['name'].decode(), descriptors.version_string())"
    g, _, c = subprocess.run([sys.executable, "-c", q], capture_output=True, text=True).stdout.strip().rpartition(" ")
tests_ran = part in ("all", "tests") or part.startswith("arch")
ok = test_rc == 0 and prog_rc == 0 and san_rc == 0 and (not tests_ran or (count("passed") > 0 and count("skipped") == 0))
tests = (f"{count('passed')} passed, {count('failed')} failed, {count('skipped')} skipped, {count('error')} errors"
         if tests_ran else "GPU tests not run in this part")
progs = part in ("all", "programs") or part.startswith("arch")
tools = {"all": "memcheck + leak check, racecheck, synccheck, initcheck", "programs": "memcheck + leak check",
         "sanitizers": "racecheck, synccheck, initcheck",
         "packs": "racecheck, synccheck, initcheck over a pack"}.get(
    part, f"{part[len('packs-'):]} over a pack" if part.startswith("packs-") else part if part.endswith("check") else None)
sanitized = f"{tools} {'clean' if san_rc == 0 else 'FAILED'}" if tools else "sanitizers not run in this part"
print(f"gpu-check ({part}): {'PASS' if ok else 'FAIL'} | {tests} | programs {'ok' if prog_rc == 0 else 'FAILED'}"
      f"{'' if progs else ' (not run)'} | {sanitized} | GPU {g} | cuDNN {c}")
sys.exit(0 if ok else 1)
PY
