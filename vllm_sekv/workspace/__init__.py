"""Sessions, blocks, the block catalog, planning and the block index. No vLLM imports.

The catalog, sessions and planner run in the scheduler process and know tokens,
hashes and slot ids, never bytes. The block index is computed where the keys
are (the worker process) from the host pool.
"""
