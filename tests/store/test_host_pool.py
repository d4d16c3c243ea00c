import numpy as np
import pytest
import torch

from vllm_sekv.store import HostPool
from vllm_sekv.store import cudart
from vllm_sekv.store.host_pool import PAGE_BYTES


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_round_trip_is_bit_identical(dtype):
    g = torch.Generator().manual_seed(0)
    pool = HostPool(num_slots=5, num_layers=3, block_tokens=8, kv_heads=2, head_dim=16, dtype=dtype)
    n = 19
    rows = torch.randperm(5 * 8, generator=g)[:n]
    key = torch.randn(n, 2, 16, generator=g).to(dtype)
    value = torch.randn(n, 2, 16, generator=g).to(dtype)
    # Extreme values survive too: infinities, subnormals, negative zero.
    key[0, 0, :4] = torch.tensor([float("inf"), -0.0, 1e-40, -float("inf")]).to(dtype)
    pool.write_rows(1, rows, key, value)
    k2, v2 = pool.read_rows(1, rows)
    bits = torch.int16 if dtype != torch.float32 else torch.int32
    assert torch.equal(k2.view(bits), key.view(bits))
    assert torch.equal(v2.view(bits), value.view(bits))


def test_rows_land_in_their_slot_and_offset():
    pool = HostPool(num_slots=3, num_layers=2, block_tokens=4, kv_heads=1, head_dim=2, dtype=torch.float32)
    pool.data.zero_()
    key = torch.full((1, 1, 2), 7.0)
    pool.write_rows(0, torch.tensor([2 * 4 + 3]), key, key + 1)
    assert torch.equal(pool.data[2, 0, 0, 3], key[0])
    assert torch.equal(pool.data[2, 1, 0, 3], key[0] + 1)
    assert pool.data.count_nonzero() == 4


# Runs of whole slots (2-3, 5, 4, 6) and rows that are not (2, 3, 39).
MIXED_ROWS = torch.tensor([8, 9, 10, 11, 12, 13, 14, 15, 2, 3, 20, 21, 22, 23, 16, 17, 18, 19, 39, 24, 25, 26, 27])


def test_block_bytes():
    assert HostPool.bytes_per_block(30, 32, 3, 64, torch.bfloat16) == 2 * 30 * 32 * 3 * 64 * 2
    pool = HostPool(2, 30, 32, 3, 64, torch.bfloat16)
    assert pool.block_bytes == HostPool.bytes_per_block(30, 32, 3, 64, torch.bfloat16)


def test_rows_in_whole_slots_are_written_as_slices_with_the_same_result():
    import torch

    from vllm_sekv.store import HostPool

    rows = MIXED_ROWS
    for dtype in (torch.float32, torch.bfloat16):
        fast, slow = (HostPool(10, 2, 4, 2, 3, dtype) for _ in range(2))
        fast.data.zero_()
        slow.data.zero_()
        key, value = torch.randn(len(rows), 2, 3), torch.randn(len(rows), 2, 3)
        runs = fast.slot_runs(rows)
        assert runs.whole == [(0, 2, 2), (10, 5, 1), (14, 4, 1), (19, 6, 1)]
        assert runs.rest.tolist() == [8, 9, 18]
        fast.write_rows(1, rows, key, value, runs)
        slots, offsets = rows // 4, rows % 4
        slow.data[slots, 0, 1, offsets] = key.to(dtype)
        slow.data[slots, 1, 1, offsets] = value.to(dtype)
        assert torch.equal(fast.data, slow.data)


def test_writing_every_layer_at_once_equals_writing_layer_by_layer():
    rows = MIXED_ROWS
    for dtype in (torch.float32, torch.bfloat16):
        together, apart = (HostPool(10, 3, 4, 2, 5, dtype) for _ in range(2))
        together.data.zero_()
        apart.data.zero_()
        kv = torch.randn(2, 3, len(rows), 2, 5).to(dtype)  # [K/V, layers, n, H, D]
        runs = together.slot_runs(rows)
        assert runs.whole and len(runs.rest)  # both paths taken
        together.write_rows_all_layers(rows, kv, runs)
        for layer in range(3):
            apart.write_rows(layer, rows, kv[0, layer], kv[1, layer], runs)
        assert torch.equal(together.data, apart.data)
    one = HostPool(3, 2, 4, 1, 2, torch.float32)  # a single decode token
    one.data.zero_()
    one.write_rows_all_layers(torch.tensor([6]), torch.arange(8.0).reshape(2, 2, 1, 1, 2))
    assert one.data[1, :, :, 2].tolist() == [[[[0.0, 1.0]], [[2.0, 3.0]]], [[[4.0, 5.0]], [[6.0, 7.0]]]]
    assert one.data.count_nonzero() == 7


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host tiers exist on CUDA only")
def test_a_pinned_pool_is_page_locked_at_its_own_size_and_round_trips_through_the_gpu():
    pool = HostPool(3, 2, 16, 2, 8, torch.bfloat16, pin_memory=True)
    assert cudart.is_page_locked(pool.data) and pool.data.data_ptr() % PAGE_BYTES == 0
    assert not cudart.is_page_locked(torch.empty(4))
    pool.data.copy_(torch.randn(pool.data.shape))
    on_gpu = pool.data.to("cuda", non_blocking=True)
    back = torch.empty_like(pool.data).pin_memory()
    back.copy_(on_gpu, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, pool.data)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not (torch.cuda.is_available() and cudart.available()), reason="CUDA only"))])
def test_slot_keys_on_a_device_are_the_slots_keys(device):
    """`slot_keys_on` (a GPU index's read): the keys of whole slots, in the
    order asked, runs of consecutive slots copied by the copy engine on CUDA."""
    pool = HostPool(num_slots=9, num_layers=2, block_tokens=4, kv_heads=2, head_dim=8, dtype=torch.bfloat16,
                    pin_memory=device == "cuda")
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(2)))
    slots = [3, 4, 5, 0, 8, 7]
    keys = pool.slot_keys_on(slots, torch.device(device))
    assert keys.device.type == device
    assert torch.equal(keys.cpu(), pool.data[torch.tensor(slots), 0])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not (torch.cuda.is_available() and cudart.available()), reason="CUDA only"))])
def test_rows_on_a_device_are_the_rows_the_host_reads(device):
    """`rows_on` (the coarse summaries' reader): the rows' whole slots moved,
    the rows picked on the device, bit for bit what `read_rows_all_layers` reads."""
    pool = HostPool(num_slots=9, num_layers=2, block_tokens=4, kv_heads=2, head_dim=8, dtype=torch.bfloat16,
                    pin_memory=device == "cuda")
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(3)))
    rows = np.array([13, 0, 14, 35, 1, 20, 21, 22, 23, 5])
    k, v = pool.rows_on(rows, torch.device(device))
    want_k, want_v = pool.read_rows_all_layers(torch.from_numpy(rows))
    assert k.device.type == device
    assert torch.equal(k.cpu(), want_k) and torch.equal(v.cpu(), want_v)
