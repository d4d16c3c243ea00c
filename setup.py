"""Package layout; all other metadata lives in pyproject.toml.

The kernels live in the top-level folder `triton_kernels/` but install as
`vllm_sekv.triton_kernels`: a top-level `triton_kernels` would shadow OpenAI's
package of that name, which vLLM imports for MXFP4 MoE.

Native host-side sources in `csrc/` install as data of `vllm_sekv._csrc` and
are compiled on first use with torch's C++ extension loader, so a plain
`pip install` needs no compiler on machines that never use them.
"""
from setuptools import find_packages, setup

KERNELS = "vllm_sekv.triton_kernels"
CSRC = "vllm_sekv._csrc"

packages = find_packages(include=["vllm_sekv", "vllm_sekv.*"])
packages += [KERNELS] + [f"{KERNELS}.{p}" for p in find_packages("triton_kernels")]
packages += [CSRC]

setup(
    packages=packages,
    package_dir={"vllm_sekv": "vllm_sekv", KERNELS: "triton_kernels", CSRC: "csrc"},
    package_data={CSRC: ["*.cpp", "*.h", "*.cu"]},
)
