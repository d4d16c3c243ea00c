"""Block-index scoring by sub-block summaries: `score_sub_blocks` (Triton in
`sub_block_scoring`, PyTorch in `sub_block_reference`, same contract). Call it
through `vllm_sekv.ops`, which picks the implementation by device."""
