"""Triton kernels of vllm-sekv, installed as `vllm_sekv.triton_kernels`.

Each kernel sits beside a PyTorch reference with the same signature; the CPU
path uses the references (see `vllm_sekv.ops`). Never import this folder as a
top-level `triton_kernels`: that name belongs to OpenAI's package used by vLLM.
"""
