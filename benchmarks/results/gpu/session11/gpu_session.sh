#!/usr/bin/env bash
# The driver of session 11's GPU calls, run from the repository root on the GPU machine
# (copied there as ./gpu_session.sh after the carries of shared/gpu/README.md): bash gpu_session.sh <step>
set -uo pipefail
export PYTHONPATH=/tmp/site:/tmp/nh:/tmp/extra SEKV_GGUF_PATH=/tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf SEKV_CACHE_DIR=/tmp/sekvcache
step=$1
if [ ! -f /tmp/setup_done ]; then
  mkdir -p /tmp/carry && cp -r .gpucarry/c3 /tmp/carry/
  start=$(date +%s)
  bash /tmp/carry/c3/setup.sh > $OUT/setup.log 2>&1 && touch /tmp/setup_done
  echo "setup $(( $(date +%s) - start )) s"
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || { echo install failed; tail $OUT/install.log; }
git rev-parse --short HEAD > $OUT/commit.txt 2>/dev/null; git status --short >> $OUT/commit.txt 2>/dev/null
run() { local name=$1 limit=$2; shift 2; local s=$(date +%s); timeout $limit "$@" > $OUT/$name.log 2>&1; local rc=$?; echo "$name rc=$rc $(( $(date +%s) - s )) s"; tail -4 $OUT/$name.log; }
VIEWS="python3 benchmarks/gpu/views_e2e.py --host-bytes 20G"
case $step in
  unit_views)
    nvidia-smi > $OUT/nvidia_smi.txt 2>&1
    run cuda_unit 150 pytest -q -rs -p no:cacheprovider tests/connector/test_device_reports.py tests/connector/test_full_graph_steps.py tests/store/test_capture.py tests/store/test_host_pool.py tests/store/test_layerwise.py tests/triton_kernels/test_gather.py tests/triton_kernels/test_rotate.py
    run views_graphs 290 $VIEWS --engines sekv plain --sizes 131072 --view-tokens 65536 --steps 2 --decode-tokens 128 --cuda-graphs --timeout-s 280 --out $OUT/views_graphs ;;
  restore_audit)
    run restore 330 python3 benchmarks/gpu/restore_e2e.py --engines sekv-host native plain --lengths 65536 131072 --repeats 3 --timers --out $OUT/restore
    run sync_audit 220 $VIEWS --engines sekv --sizes 65536 --view-tokens 32768 --steps 1 --decode-tokens 16 --cuda-graphs --sync-audit --timeout-s 210 --out $OUT/sync_audit ;;
  lease2)  # after the head start (restore copies enqueued when the step is planned)
    nvidia-smi > $OUT/nvidia_smi.txt 2>&1
    run cuda_unit 150 pytest -q -rs -p no:cacheprovider tests/connector/test_device_reports.py tests/connector/test_full_graph_steps.py tests/connector/test_head_start.py tests/store/test_capture.py tests/store/test_host_pool.py tests/store/test_layerwise.py tests/triton_kernels/test_gather.py tests/triton_kernels/test_rotate.py tests/gpu/test_cuda_index.py
    run graphs_test 300 pytest -q -rs -p no:cacheprovider tests/gpu/test_cuda_engine.py -k cuda_graphs ;;
  restore2)
    run restore 500 python3 benchmarks/gpu/restore_e2e.py --engines sekv-host native plain --lengths 65536 130944 --repeats 3 --timers --sync-audit --out $OUT/restore ;;
  views2)
    run views_graphs 500 $VIEWS --engines sekv plain --sizes 131072 --view-tokens 65536 --steps 2 --decode-tokens 128 --cuda-graphs --sync-audit --timeout-s 280 --out $OUT/views_graphs ;;
  graphs_test)
    run graphs_test 420 pytest -q -rs -p no:cacheprovider tests/gpu/test_cuda_engine.py -k cuda_graphs ;;
  views_again)
    run views_graphs 290 $VIEWS --engines sekv plain --sizes 131072 --view-tokens 65536 --steps 2 --decode-tokens 128 --cuda-graphs --timeout-s 280 --out $OUT/views_graphs ;;
esac
