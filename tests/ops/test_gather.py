"""The capture gather (`vllm_sekv/ops/rope/gather.py`) on CUDA against its
PyTorch reference, on vLLM's FlashAttention cache layout `[2, pages, page_size,
kv_heads, head_dim]` per layer: bit-identical, keys rotated or copied. (The
CPU check runs the same kernel in Triton's interpreter: test_interpreter.py.)"""
import pytest
import torch

from vllm_sekv.ops.rope import scatter_reference
from vllm_sekv.ops import RopeSpec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")


@pytest.mark.parametrize("neox,rotary_dim", [(True, 128), (False, 128), (True, 64)])
@pytest.mark.parametrize("rotate", [True, False])
def test_gather_equals_the_reference_on_flash_attention_caches(neox, rotary_dim, rotate):
    from vllm_sekv.ops.rope import gather

    torch.manual_seed(0)
    layers, pages, page_size, heads, head_dim, n = 4, 64, 16, 8, 128, 37
    caches = [torch.randn(2, pages, page_size, heads, head_dim, device="cuda").bfloat16() for _ in range(layers)]
    k_views, v_views = [c[0] for c in caches], [c[1] for c in caches]
    inv = 1.0 / 500000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    rope = RopeSpec(inv, rotary_dim, neox)
    slots = torch.randperm(pages * page_size, device="cuda")[:n]
    deltas = torch.randint(-600000, 600000, (n,), device="cuda") if rotate else None
    got = gather.gather_rerope(k_views, v_views, slots, deltas, rope,
                               torch.empty(2, layers, n, heads, head_dim, device="cuda", dtype=torch.bfloat16))
    want = scatter_reference.gather_rerope(k_views, v_views, slots, deltas, rope,
                                           torch.empty(2, layers, n, heads, head_dim, device="cuda",
                                                       dtype=torch.bfloat16))
    assert torch.equal(got, want)
