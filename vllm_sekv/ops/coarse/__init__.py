"""SeKV coarse-attention merge: `coarse_merge` (Triton in `coarse_kernel`,
PyTorch in `coarse_reference`, same signature) merges token attention over the
view with attention over segment summaries by log-sum-exp;
`coarse_reference.attention_with_lse` is the exact attention it must
reproduce. Call it through `vllm_sekv.ops`; the Triton module is imported
lazily there, so CPU-only installs never import Triton."""
