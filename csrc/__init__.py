"""Native host-side sources (C++/CUDA), installed as `vllm_sekv._csrc` data and
compiled on first use. Empty until a native component lands."""
