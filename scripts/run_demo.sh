#!/usr/bin/env bash
# Sets everything up, then runs a multi-step agent session against `vllm serve`
# with the sekv connector on the bundled SmolLM2 (examples/agent_session.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${SEKV_VENV:-.venv}/bin/python" examples/agent_session.py "$@"
