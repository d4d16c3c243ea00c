#!/usr/bin/env bash
# Sets everything up, then runs the whole test suite (unit tests and the tests
# that start real vLLM engines and servers on the bundled model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# `pytest`, not `python -m pytest`: the latter puts the checkout root on sys.path,
# where the top-level `triton_kernels/` folder would shadow OpenAI's package.
exec "${SEKV_VENV:-.venv}/bin/pytest" -q -rs tests "$@"
