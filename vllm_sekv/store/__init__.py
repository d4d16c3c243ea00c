"""Storage tiers, eviction policies and slot bookkeeping. No vLLM imports.

Bookkeeping (`SlotAllocator`, policies) lives with the scheduler-side catalog;
the bytes (`HostPool`) live in the worker process. They agree on slot ids.
"""
from vllm_sekv.store.host_pool import HostPool
from vllm_sekv.store.policy import EvictionPolicy, LRUPolicy, SLRUPolicy, make_policy
from vllm_sekv.store.slab import SlotAllocator
from vllm_sekv.store.tiers import Tier

__all__ = [
    "EvictionPolicy",
    "HostPool",
    "LRUPolicy",
    "SLRUPolicy",
    "SlotAllocator",
    "Tier",
    "make_policy",
]
