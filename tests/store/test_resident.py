"""Diff restores: blocks kept on the device between restores are copied
there instead of from the host, with the same result bit for bit; the
bookkeeping keeps what the running restore reads and never serves a block
whose host slot was rewritten."""
import pytest
import torch

from vllm_sekv import ops
from vllm_sekv.store.resident import ResidentBlocks
from vllm_sekv.store.transfer import RestorePipeline

from test_transfer import BT, LAYERS, PAGE, _expected, _rope, _setup

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


# Consecutive restores of mostly the same blocks (host slots of a 23-slot pool), each at other paged slots and
# positions: all moved; all resident in another order; two new among resident ones; the same again in its own
# order; more new blocks than the pool has entries left for, so some moved ones are not kept.
STEPS = [[3, 4, 5, 17, 0, 9, 10, 22, 1], [22, 1, 9, 3, 17, 0, 5, 10, 4], [5, 6, 4, 17, 3, 11, 9, 10, 1],
         [5, 6, 4, 17, 3, 11, 9, 10, 1], [12, 3, 13, 14, 15, 16, 18, 19, 20, 21, 2, 7, 8, 4]]
PLACED = [0, 9, 7, 9, 2]  # blocks each step finds resident (capacity 12)


def _steps(device, how, deltas=True, batch_blocks=4):
    """Run STEPS on one cache set; `how`: "placed" (a resident pool, the pipeline's own scatter: resident
    blocks written from the pool), "staged" (a resident pool and a `write` that scatters: resident blocks
    staged), "plain" (no resident pool). Returns the caches after each step and the handles."""
    pool, kv, _, _, _ = _setup(torch.bfloat16, device)
    pool[:, 0, :, 0, :, :4] = -0.0  # keys a rotation by zero would not all keep
    pipe = RestorePipeline(pool.shape[1:], pool.dtype, device, batch_blocks=batch_blocks, num_threads=2)
    resident = ResidentBlocks(12, pool.shape[1:], pool.dtype, device) if how != "plain" else None
    keys, values = _caches(kv)

    def write(staged, slots, batch_deltas):
        ops.scatter_rerope(staged, keys, values, slots, batch_deltas, _rope())

    after, handles = [], []
    for step, host_slots in enumerate(STEPS):
        gen = torch.Generator().manual_seed(100 + step)
        slots = torch.randperm(kv.shape[2] * PAGE, generator=gen)[:len(host_slots) * BT]
        slots[::5] = -1
        moved = torch.randint(-1000, 100000, (len(host_slots) * BT,), generator=gen) if deltas else None
        handle = pipe.restore(pool, host_slots, keys, values, slots.to(device), None if moved is None else
                              moved.to(device), _rope(), write=write if how == "staged" else None, resident=resident)
        handle.wait()
        after.append(kv.clone())
        handles.append(handle)
    pipe.close()
    return pool, after, handles


@pytest.mark.parametrize("deltas", [True, False], ids=["moved", "not-moved"])
@pytest.mark.parametrize("batch_blocks", [4, 64])
@pytest.mark.parametrize("device", DEVICES)
def test_resident_blocks_written_from_the_pool_give_what_a_restore_without_them_gives(device, batch_blocks, deltas):
    """Exact pools: with `key_caches` / `value_caches` and no `write` a
    restore writes its resident blocks straight from the resident pool (and
    only the others through staging); every step's caches equal, bit for
    bit, those of the same restores without a resident pool and those of
    the staged way, the blocks placed and bytes moved as the pool held."""
    pool, placed, handles = _steps(device, "placed", deltas, batch_blocks)
    _, plain, _ = _steps(device, "plain", deltas, batch_blocks)
    _, staged, staged_handles = _steps(device, "staged", deltas, batch_blocks)
    block_bytes = pool[0].numel() * pool.element_size()
    for step, host_slots in enumerate(STEPS):
        assert torch.equal(placed[step].view(torch.int16), plain[step].view(torch.int16)), f"step {step}"
        assert torch.equal(placed[step].view(torch.int16), staged[step].view(torch.int16)), f"step {step}"
        assert handles[step].placed_blocks == staged_handles[step].placed_blocks == PLACED[step]
        assert handles[step].num_bytes == (len(host_slots) - PLACED[step]) * block_bytes
    if device == "cuda":  # the CUDA branch writes what the CPU branch writes
        _, on_cpu, _ = _steps("cpu", "placed", deltas, batch_blocks)
        for step in range(len(STEPS)):
            assert torch.equal(placed[step].cpu().view(torch.int16), on_cpu[step].view(torch.int16)), f"step {step}"


@pytest.mark.parametrize("device", DEVICES)
def test_resident_blocks_are_written_from_the_device_copies_without_reading_their_host_slots(device):
    """A restore of blocks all resident reads nothing of the pool: with
    their host slots scribbled over (not rewritten as far as the pool
    knows), the caches still get the kept bytes; the restore moves no byte."""
    pool, kv, host_slots, slots, deltas, pipe, resident = _first_restore(device)
    want = _expected(pool, host_slots[::-1], kv.clone(), slots, deltas, _rope())
    pool[host_slots] = float("nan")
    handle = pipe.restore(pool, host_slots[::-1], *_caches(kv), slots, deltas, _rope(), resident=resident)
    handle.wait()
    pipe.close()
    assert torch.equal(kv.cpu().view(torch.int16), want.cpu().view(torch.int16))
    assert handle.placed_blocks == len(host_slots) and handle.num_bytes == 0
