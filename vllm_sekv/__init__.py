"""vllm-sekv: a virtual KV workspace for long-running LLM agents, as a vLLM plugin.

Switch it on with one flag:
    vllm serve MODEL --kv-transfer-config '{"kv_connector":"sekv","kv_role":"kv_both"}'
"""

__version__ = "0.1.0"
CONNECTOR_NAME = "sekv"
