"""The views' block index and its scoring, as tensors: a few summary vectors
per block, layer and KV head (`block_index`), how they are built and how
queries score them (`block_summaries`), and SeKV's zoom router
(`router`, a small learned scorer). Pure torch, no vLLM imports; the index
lives in the worker, next to the keys it summarizes.
"""
