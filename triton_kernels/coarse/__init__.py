"""SeKV coarse-attention merge: `coarse_merge` (Triton in `kernel`, PyTorch in
`reference`, same signature) merges token attention over the view with attention
over segment summaries by log-sum-exp; `reference.attention_with_lse` is the exact
attention it must reproduce. The Triton module is not imported here, so CPU-only
installs never import Triton."""
from .reference import attention_with_lse, coarse_merge

__all__ = ["attention_with_lse", "coarse_merge"]
