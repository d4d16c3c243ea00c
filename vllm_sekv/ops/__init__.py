"""Compute primitives, dispatched by device: Triton kernels on CUDA, the PyTorch
references of `vllm_sekv.triton_kernels` elsewhere. Callers never pick an
implementation themselves.
"""
from vllm_sekv.triton_kernels.rope.reference import RopeSpec, rotate_keys

__all__ = ["RopeSpec", "rotate_keys"]
