"""Restore pipeline: result equals a plain copy + reference rotation, on CPU
(CI) and, marked gpu, on CUDA from a pinned pool."""
import pytest
import torch

from vllm_sekv.store.transfer import HostGatherer, RestorePipeline
from vllm_sekv.ops import RopeSpec
from vllm_sekv.ops.rope.rotate_reference import rotate_keys

LAYERS, BT, HEADS, DIM, PAGE = 3, 8, 2, 16, 4


def _rope():
    inv = 1.0 / 10000.0 ** (torch.arange(0, DIM, 2, dtype=torch.float64) / DIM)
    return RopeSpec(inv, DIM, True)


def _expected(pool, host_slots, kv, slots, deltas, rope):
    """Plain copy + reference rotation, token by token."""
    out = kv.clone()
    for j, s in enumerate(host_slots):
        for i in range(BT):
            n = j * BT + i
            if slots[n] < 0:
                continue
            page, off = divmod(int(slots[n]), PAGE)
            for l in range(LAYERS):
                k = pool[s, 0, l, i].to(out.device)
                out[l, 0, page, off] = rotate_keys(k[None], deltas[n:n + 1], rope)[0]
                out[l, 1, page, off] = pool[s, 1, l, i]
    return out


def _setup(dtype, device, num_slots=23, pages=50, n_blocks=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(num_slots, 2, LAYERS, BT, HEADS, DIM, generator=gen).to(dtype)
    if device == "cuda":
        pool = pool.pin_memory()
    kv = torch.randn(LAYERS, 2, pages, PAGE, HEADS, DIM, generator=gen).to(dtype).to(device)
    host_slots = [3, 4, 5, 17, 0, 9, 10, 22, 1][:n_blocks]  # runs and jumps
    slots = torch.randperm(pages * PAGE, generator=gen)[:n_blocks * BT]
    slots[::7] = -1
    deltas = torch.randint(-1000, 100000, (n_blocks * BT,), generator=gen)
    return pool, kv, host_slots, slots, deltas


@pytest.mark.parametrize("num_threads", [1, 3])
def test_host_gatherer_equals_index_select(num_threads):
    pool = torch.randn(20, 5, 7)
    slots = [4, 5, 6, 7, 19, 0, 1, 11]
    out = torch.full((10, 5, 7), float("nan"))
    g = HostGatherer(num_threads)
    g.gather(pool, slots, out)
    g.close()
    torch.testing.assert_close(out[:8], pool[slots], rtol=0, atol=0)
    assert out[8:].isnan().all()


@pytest.mark.parametrize("batch_blocks", [1, 4, 16])
def test_cpu_pipeline_equals_copy_plus_rotation(batch_blocks):
    pool, kv, host_slots, slots, deltas = _setup(torch.bfloat16, "cpu")
    pool_before = pool.clone()
    want = _expected(pool, host_slots, kv, slots, deltas, _rope())
    pipe = RestorePipeline(pool.shape[1:], pool.dtype, "cpu", batch_blocks=batch_blocks, num_threads=2)
    handle = pipe.restore(pool, host_slots, [kv[l, 0] for l in range(LAYERS)], [kv[l, 1] for l in range(LAYERS)],
                          slots, deltas, _rope())
    handle.wait()
    pipe.close()
    torch.testing.assert_close(kv, want, rtol=0, atol=0)
    torch.testing.assert_close(pool, pool_before, rtol=0, atol=0)  # source untouched
    assert handle.num_bytes == len(host_slots) * pool[0].numel() * 2


def test_pipeline_rejects_bad_arguments():
    pool, kv, host_slots, slots, deltas = _setup(torch.float16, "cpu", n_blocks=2)
    pipe = RestorePipeline(pool.shape[1:], pool.dtype, "cpu")
    keys, vals = [kv[l, 0] for l in range(LAYERS)], [kv[l, 1] for l in range(LAYERS)]
    with pytest.raises(ValueError, match="slot_mapping"):
        pipe.restore(pool, host_slots, keys, vals, slots[:-1], deltas, _rope())
    with pytest.raises(ValueError, match="out of range"):
        pipe.restore(pool, [0, 99], keys, vals, slots, deltas, _rope())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_pipeline_equals_copy_plus_rotation(dtype):
    pool, kv, host_slots, slots, deltas = _setup(dtype, "cuda")
    rope = _rope()
    want = _expected(pool, host_slots, kv.cpu(), slots, deltas, rope)
    pipe = RestorePipeline(pool.shape[1:], dtype, "cuda", batch_blocks=2, num_buffers=2)
    keys, vals = [kv[l, 0] for l in range(LAYERS)], [kv[l, 1] for l in range(LAYERS)]
    handle = pipe.restore(pool, host_slots, keys, vals, slots, deltas, rope)
    handle.wait()
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3  # Triton vs torch rounding of the same float32 rotation
    torch.testing.assert_close(kv.cpu().float(), want.float(), rtol=tol, atol=tol)
    pipe.close()
