#!/usr/bin/env bash
# Sets everything up, then runs the whole test suite (unit tests and the tests
# that start real vLLM engines and servers on the bundled model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${SEKV_VENV:-.venv}/bin/pytest" -q -rs tests "$@"
