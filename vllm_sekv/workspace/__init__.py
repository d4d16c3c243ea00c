"""The workspace's policy: sessions, tenants, the block catalog, content
hashes, the planner and the plans it returns, execution-view passes,
surprisal segments and the manifest of an NVMe folder.

Runs in the scheduler process and knows tokens, hashes and slot ids, never
bytes. No vLLM imports; the connector's scheduler side drives it.
"""
