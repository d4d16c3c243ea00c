"""The connector's worker side, in each worker process on the forward thread:
holds the host tier's bytes, restores planned rows into vLLM's paged caches
(`host_restores` on the host, `device_restores` on CUDA), captures new K/V
out of the forward (`forward_capture`), moves blocks to and from NVMe and
the shared tier (`tier_transfers`), scores probes against the block index
(`probes`, `rerank`), merges SeKV summaries into attention
(`coarse_attention`) and records surprisal (`surprisal`).
`worker_connector.SekvWorkerSide` runs them in step order.
"""
