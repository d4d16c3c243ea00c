"""Mean-K block scoring: `score_blocks` (Triton in `kernel`, PyTorch in
`reference`, same signature) and `select_blocks` (top-k with sink and recent
blocks forced in). Pick an implementation through `vllm_sekv.ops`."""
from .reference import COMBINE_MODES
from .select import select_blocks

__all__ = ["COMBINE_MODES", "select_blocks"]
