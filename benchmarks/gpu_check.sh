#!/usr/bin/env bash
# The prepared GPU check: one command on a machine with an NVIDIA GPU and a CUDA PyTorch.
#
#   bash benchmarks/gpu_check.sh            # results in $OUT (or ./gpu-check)
#
# 1. tests/test_cuda.py: the library on the GPU against its CPU results (at most 2 minutes);
# 2. `blockhess bench --device cuda`, group (a), the paper's component Jacobians in float32
#    and float64, timings only (at most 2.5 minutes);
# 3. group (b) with MSE at (8, 16, 32), (16, 32, 64) and (32, 64, 128), with peak memory
#    (at most 4.5 minutes).
# Each step is stopped at its cap, so the whole stays under 9.5 minutes; bench rewrites its
# JSON after every case, so a stopped step still leaves the cases it finished.
# It uses the machine's own python3 and packages (torch, pytest, psutil, tqdm, matplotlib,
# scikit-learn, mpmath) with this checkout's src/ on PYTHONPATH: nothing is installed.
# Writes six files: env.txt, test_cuda.log, bench-a.json, bench-a.md, bench-b.json,
# bench-b.md. Each step runs even if an earlier one failed; the exit status is the first
# failure's.
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-gpu-check}"
mkdir -p "$out"
work="$(mktemp -d)"
status=0
fail() { [ "$status" -eq 0 ] && status=$1; return 0; }  # keep the first failure's status

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
    git rev-parse --short HEAD 2>/dev/null || echo "commit unknown (no .git)"
} >"$out/env.txt" 2>&1

timeout -k 10 120 python3 -m pytest -rfEs --durations=5 -p no:cacheprovider tests/test_cuda.py 2>&1 \
    | tee "$out/test_cuda.log" || fail $?

for step in "a 150 --cases a --no-memory" \
            "b 270 --cases b --only b/mse/8x16x32,b/mse/16x32x64,b/mse/32x64x128 --disable curvlinops,jax"; do
    read -r name cap opts <<<"$step"
    # shellcheck disable=SC2086  # the options are meant to split
    timeout -k 10 "$cap" python3 -m blockhess bench --device cuda --out "$work/$name" $opts || fail $?
    pkill -f blockhess_lab.bench_worker  # a worker of a stopped step would hold the GPU
    cp "$work/$name/bench.json" "$out/bench-$name.json" 2>/dev/null
    cp "$work/$name/bench.md" "$out/bench-$name.md" 2>/dev/null
done
rm -rf "$work"
exit "$status"
