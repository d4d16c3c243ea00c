#!/usr/bin/env bash
# Sets everything up, then runs the whole test suite (unit tests and the tests
# that start real vLLM engines and servers on the bundled model). Extra
# arguments go to pytest.
#
# Two test files at a time (SEKV_TEST_WORKERS): a vLLM server on a CPU computes
# on one thread and spends much of its start-up importing, so two engines share
# a 2-core machine well. A file's tests stay on one worker (its module fixtures
# start each engine once), and files go out in collection order, the engine
# tests (the longest) first (xdist would otherwise hand out the files with the
# most tests first). Tests marked `serial` check bounded times (Redis
# timeouts, back-offs) and run afterwards, alone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PYTEST="${SEKV_VENV:-.venv}/bin/pytest"
status=0
"$PYTEST" -q -rs -n "${SEKV_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder -m "not serial" tests "$@" || status=$?
serial=0
"$PYTEST" -q -rs -m serial tests "$@" || serial=$?
[ "$serial" -eq 5 ] && serial=0  # 5: the arguments selected no serial test
[ "$status" -eq 5 ] && status=0
exit $(( status != 0 ? status : serial ))
