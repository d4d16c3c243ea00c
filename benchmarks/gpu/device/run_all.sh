#!/usr/bin/env bash
# Runs the GPU tests and all GPU benchmarks on the device machine; writes under $OUT.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash benchmarks/gpu/device/run_all.sh [all|restore|quick]
# $OUT/restore.json is benchmarks/results/gpu_restore_pipeline/report.json's run; `python
# benchmarks/gpu/report.py restore --dir D` writes a folder's report.md. Reports name the commit from
# $SEKV_COMMIT (no git history there).
set -u
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../../.."
# Import the package from a copy, so nothing depends on the machine's pip; -P keeps the repo
# root off sys.path.
rm -rf /tmp/sekv_pp && mkdir -p /tmp/sekv_pp && cp -r vllm_sekv /tmp/sekv_pp/ || exit 1
export PYTHONPATH=/tmp/sekv_pp
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv >"$OUT/nvidia_smi.txt" 2>&1
timeout 150 python3 -P -m pytest -q -m gpu tests/ops tests/store/test_transfer.py -p no:cacheprovider \
    2>&1 | tail -40 | tee "$OUT/pytest_gpu.log"
cd benchmarks/gpu
what=${1:-all}
if [ "$what" = quick ]; then
    timeout 120 python3 bench_restore.py --out "$OUT/restore.json" --tokens 8192 --repeats 2 2>&1 | tee "$OUT/restore.log"
fi
if [ "$what" = all ] || [ "$what" = restore ]; then
    timeout 240 python3 bench_restore.py --out "$OUT/restore.json" 2>&1 | tee "$OUT/restore.log"
fi
