import math

import pytest
import torch

from vllm_sekv.ops import RopeSpec, rotate_keys
from vllm_sekv.store import HostPool
from vllm_sekv.workspace.block_index import MeanKIndex


def rope(head_dim=16, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return RopeSpec(inv_freq=inv, rotary_dim=head_dim)


@pytest.mark.parametrize("start", [0, 96, 5000])
def test_entry_is_the_mean_pre_rope_key(start):
    g = torch.Generator().manual_seed(start)
    L, T, H, D = 3, 8, 2, 16
    spec = rope(D)
    pool = HostPool(4, L, T, H, D, torch.float32)
    pre = torch.randn(L, T, H, D, generator=g)
    positions = torch.arange(start, start + T)
    for layer in range(L):  # store post-RoPE keys, as captured from the model
        pool.data[2, 0, layer] = rotate_keys(pre[layer], positions, spec)
    index = MeanKIndex(4, L, H, D, spec)
    index.add(pool, slot=2, start_token=start)
    assert index.valid[2] and not index.valid[0]
    torch.testing.assert_close(index.keys[2], pre.mean(dim=1), atol=1e-5, rtol=1e-5)


def test_rotation_composes_and_inverts():
    spec = rope(16)
    x = torch.randn(5, 2, 16, dtype=torch.float32)
    p = torch.tensor([0, 1, 17, 1000, 65000])
    there = rotate_keys(x, p, spec)
    assert not torch.allclose(there[1:], x[1:])
    torch.testing.assert_close(rotate_keys(there, -p, spec), x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rotate_keys(rotate_keys(x, p, spec), p, spec), rotate_keys(x, 2 * p, spec),
                               atol=1e-4, rtol=1e-4)
    # the norm is preserved: a pure rotation
    torch.testing.assert_close(there.norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-5)
    assert math.isclose(float(spec.inv_freq[0]), 1.0)
