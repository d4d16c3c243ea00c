"""Diff restores: blocks kept on the device between restores are copied
there instead of from the host, with the same result bit for bit; the
bookkeeping keeps what the running restore reads and never serves a block
whose host slot was rewritten."""
import pytest
import torch

from vllm_sekv.store.resident import ResidentBlocks
from vllm_sekv.store.transfer import RestorePipeline

from test_transfer import BT, LAYERS, _expected, _rope, _setup

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


def test_moved_blocks_take_free_entries_then_the_least_recently_used_ones():
    resident = ResidentBlocks(3, (2, 1, 1, 1, 1), torch.float32, "cpu")
    plan = resident.plan([10, 11])
    assert plan.placed == [] and plan.moved == [0, 1] and [e for _, e in plan.admit] == [0, 1]
    plan = resident.plan([11, 12, 13])  # 11 placed; 12 takes the free entry, 13 evicts 10
    assert plan.placed == [(0, 1)] and plan.moved == [1, 2]
    assert [e for _, e in plan.admit] == [2, 0] and 10 not in resident and 13 in resident
    plan = resident.plan([14], keep=[11, 12, 13])  # all kept by the running restore: nothing evicted
    assert plan.moved == [0] and plan.admit == [] and len(resident) == 3
    resident.drop([12, 99])
    assert 12 not in resident and resident.plan([14]).admit == [(0, 2)]


def _caches(kv):
    return [kv[l, 0] for l in range(LAYERS)], [kv[l, 1] for l in range(LAYERS)]


def _first_restore(device):
    """A pool, a pipeline and a resident pool that holds the first restore's blocks."""
    pool, kv, host_slots, slots, deltas = _setup(torch.bfloat16, device)
    pipe = RestorePipeline(pool.shape[1:], pool.dtype, device, batch_blocks=4, num_threads=2)
    resident = ResidentBlocks(16, pool.shape[1:], pool.dtype, device)
    first = pipe.restore(pool, host_slots, *_caches(kv.clone()), slots, deltas, _rope(), resident=resident)
    first.wait()
    assert first.placed_blocks == 0 and len(resident) == len(host_slots)
    return pool, kv, host_slots, slots, deltas, pipe, resident


@pytest.mark.parametrize("device", DEVICES)
def test_a_diff_restore_places_kept_blocks_and_writes_what_a_full_restore_writes(device):
    pool, _, host_slots, _, _, pipe, resident = _first_restore(device)
    # the next step: most blocks again, in another order, at other places and positions
    again = [host_slots[i] for i in (3, 0, 7, 5, 1, 2, 8)] + [11, 12]
    _, kv2, _, slots2, deltas2 = _setup(torch.bfloat16, device, seed=1)
    want = _expected(pool, again, kv2.clone(), slots2, deltas2, _rope())
    handle = pipe.restore(pool, again, *_caches(kv2), slots2, deltas2, _rope(), resident=resident)
    handle.wait()
    pipe.close()
    torch.testing.assert_close(kv2, want, rtol=0, atol=0)
    assert handle.placed_blocks == 7
    assert handle.num_bytes == 2 * pool[0].numel() * pool.element_size()  # the two new blocks only


@pytest.mark.parametrize("device", DEVICES)
def test_a_dropped_slot_is_moved_again_with_its_new_bytes(device):
    pool, kv, host_slots, slots, deltas, pipe, resident = _first_restore(device)
    resident.drop([host_slots[2]])  # its host slot is rewritten
    pool[host_slots[2]] = torch.randn(pool[0].shape, generator=torch.Generator().manual_seed(7)).to(pool.dtype)
    want = _expected(pool, host_slots, kv.clone(), slots, deltas, _rope())
    handle = pipe.restore(pool, host_slots, *_caches(kv), slots, deltas, _rope(), resident=resident)
    handle.wait()
    pipe.close()
    torch.testing.assert_close(kv, want, rtol=0, atol=0)
    assert handle.placed_blocks == len(host_slots) - 1


def test_a_diff_restore_of_an_fp8_pool_places_its_bytes_and_takes_the_scales_from_the_host():
    from vllm_sekv.store.fp8 import FP8_DTYPE, quantize

    pool, _, host_slots, slots, deltas = _setup(torch.float32, "cpu")
    q, scales, _ = quantize(pool, token_dim=3)
    seen = []

    def write(staged, batch_slots, batch_deltas, batch_scales):
        seen.append((staged.clone(), batch_slots.clone(), batch_scales.clone()))

    pipe = RestorePipeline(q.shape[1:], FP8_DTYPE, "cpu", batch_blocks=16, num_threads=1)
    resident = ResidentBlocks(16, q.shape[1:], FP8_DTYPE, "cpu")
    pipe.restore(q, host_slots, [], [], slots, deltas, _rope(), write=write, scales=scales, resident=resident)
    handle = pipe.restore(q, host_slots[::-1], [], [], slots, deltas, _rope(), write=write, scales=scales,
                          resident=resident)
    assert handle.placed_blocks == len(host_slots)
    (staged1, slots1, scales1), (staged2, slots2, scales2) = seen
    order = list(range(len(host_slots)))[::-1]
    assert torch.equal(staged2.view(torch.uint8), staged1[order].view(torch.uint8))
    assert torch.equal(scales2, scales1[order])
    assert torch.equal(slots2, slots)  # the batch's own order: moved blocks first, and none moved
