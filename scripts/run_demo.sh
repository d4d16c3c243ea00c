#!/usr/bin/env bash
# The demo: the same agent session (examples/agent_session.py, greedy) against
# plain vLLM and against vLLM with the sekv connector, on the bundled SmolLM2,
# then one table of both. The servers run one after the other, never together.
# Arguments go to the example (e.g. --steps 8). Logs and each run's figures:
# $DEMO_DIR (default: a new temporary folder).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="$(cd "${SEKV_VENV:-.venv}" && pwd)"
PY="$VENV/bin/python"
EXAMPLE="$PWD/examples/agent_session.py"
OUT="${DEMO_DIR:-$(mktemp -d)}"
mkdir -p "$OUT"
MODEL="$("$VENV/bin/vllm-sekv" model prepare --no-install)"
START_TIMEOUT_S=600
# /reset_prefix_cache needs dev mode; on CPU, a 1 GiB KV cache.
export VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1
VLLM_ARGS=(--host 127.0.0.1 --max-model-len 8192 --enforce-eager --enable-prompt-tokens-details
           --gpu-memory-utilization 0.5)

server=""
stop_server() {  # TERM the server's process group, KILL it after 30 s
  [ -n "$server" ] || return 0
  kill -TERM -- "-$server" 2>/dev/null || true
  for _ in $(seq 30); do kill -0 "$server" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$server" 2>/dev/null || true
  wait "$server" 2>/dev/null || true
  server=""
}
trap stop_server EXIT
trap 'exit 130' INT TERM

# session LABEL COMMAND...: start the server COMMAND (given --port), wait for
# it, run the session against it, stop it.
session() {
  local label="$1"; shift
  local port log="$OUT/$label.log"
  port="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  echo "[demo] starting $label (about a minute on CPU; log: $log)"
  # Its own process group (setsid), so that stopping it stops its engine process too;
  # started outside the checkout, whose folders must not shadow installed packages.
  (cd "$OUT" && exec setsid "$@" --port "$port" >"$log" 2>&1) &
  server=$!
  local deadline=$((SECONDS + START_TIMEOUT_S))
  until "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
        "http://127.0.0.1:$port/health" 2>/dev/null; do
    if ! kill -0 "$server" 2>/dev/null || [ "$SECONDS" -ge "$deadline" ]; then
      echo "[demo] $label did not come up; the end of $log:"; tail -n 20 "$log"; exit 1
    fi
    sleep 2
  done
  "$PY" "$EXAMPLE" --url "http://127.0.0.1:$port" --label "$label" --json "$OUT/$label.json" "${EXTRA[@]}"
  stop_server
}

EXTRA=("$@")
session vLLM "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" "${VLLM_ARGS[@]}"
session sekv "$VENV/bin/vllm-sekv" serve "$MODEL" --host-bytes 2G "${VLLM_ARGS[@]}"
echo
"$PY" "$EXAMPLE" --compare "$OUT/vLLM.json" "$OUT/sekv.json"
