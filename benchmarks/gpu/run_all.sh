#!/usr/bin/env bash
# Runs the GPU tests and all GPU benchmarks on the device machine; writes under $OUT.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash benchmarks/gpu/run_all.sh [quick]
set -u
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv >"$OUT/nvidia_smi.txt" 2>&1
timeout 240 python3 -m pytest -q -m gpu tests/triton_kernels tests/store/test_transfer.py -p no:cacheprovider \
    2>&1 | tail -40 | tee "$OUT/pytest_gpu.log"
cd benchmarks/gpu
if [ "${1:-}" = quick ]; then
    timeout 120 python3 bench_restore.py --out "$OUT/restore.json" --tokens 8192 --repeats 2 2>&1 | tee "$OUT/restore.log"
    timeout 120 python3 bench_scoring.py --out "$OUT/scoring.json" --tokens 262144 1048576 --no-sweep --repeats 2 2>&1 | tee "$OUT/scoring.log"
else
    timeout 300 python3 bench_restore.py --out "$OUT/restore.json" 2>&1 | tee "$OUT/restore.log"
    timeout 300 python3 bench_scoring.py --out "$OUT/scoring.json" 2>&1 | tee "$OUT/scoring.log"
fi
