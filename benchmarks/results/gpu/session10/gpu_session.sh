#!/usr/bin/env bash
# The driver of session 10's GPU calls, run from the repository root on the GPU machine
# (copied there as ./gpu_session.sh): bash gpu_session.sh <step>
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
run() { local name=$1 limit=$2; shift 2; local s=$(date +%s); timeout $limit "$@" > $OUT/$name.log 2>&1; local rc=$?; echo "$name rc=$rc $(( $(date +%s) - s )) s"; tail -4 $OUT/$name.log; }
case $step in
  unit_restore)
    nvidia-smi > $OUT/nvidia_smi.txt 2>&1
    run cuda_unit 150 pytest -q -rs -p no:cacheprovider tests/connector/test_device_reports.py tests/store/test_capture.py tests/store/test_host_pool.py tests/store/test_layerwise.py tests/triton_kernels/test_gather.py
    run restore64k 330 python3 benchmarks/gpu/restore_e2e.py --engines sekv-host native --lengths 65536 --repeats 3 --timers --out $OUT/restore64k ;;
  gpu_tests)
    run gpu_tests 560 pytest -q -rs -p no:cacheprovider tests/gpu/test_cuda_engine.py tests/gpu/test_cuda_views.py ;;
  views_eager)
    run views_decode 560 python3 benchmarks/gpu/views_e2e.py --engines sekv plain --sizes 131072 --view-tokens 65536 --host-bytes 20G --steps 2 --decode-tokens 128 --timers --timeout-s 330 --out $OUT/views_decode ;;
  final)
    nvidia-smi > $OUT/nvidia_smi.txt 2>&1
    run cuda_unit 90 pytest -q -rs -p no:cacheprovider tests/connector/test_device_reports.py tests/connector/test_full_graph_steps.py tests/store/test_capture.py tests/store/test_host_pool.py tests/store/test_layerwise.py tests/triton_kernels/test_gather.py
    run views_graphs 280 python3 benchmarks/gpu/views_e2e.py --engines sekv plain --sizes 131072 --view-tokens 65536 --host-bytes 20G --steps 2 --decode-tokens 128 --cuda-graphs --timeout-s 270 --out $OUT/views_graphs
    run graphs_test 300 pytest -q -rs -p no:cacheprovider tests/gpu/test_cuda_engine.py -k cuda_graphs ;;
  views_graphs)
    run views_graphs 560 python3 benchmarks/gpu/views_e2e.py --engines sekv plain --sizes 131072 --view-tokens 65536 --host-bytes 20G --steps 2 --decode-tokens 128 --timers --cuda-graphs --timeout-s 330 --out $OUT/views_graphs ;;
esac
