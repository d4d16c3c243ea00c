"""A step's capture: gathered layer by layer, stored at its host rows with
keys rotated to their virtual positions; on CUDA asynchronously, into the
pinned pool, and the same bytes as the synchronous path."""
import numpy as np
import pytest
import torch

from vllm_sekv.ops import RopeSpec, rotate_keys
from vllm_sekv.store import HostPool, cudart
from vllm_sekv.store.capture import CaptureWriter, StepCapture

LAYERS, BT, H, D = 3, 4, 2, 8
ROPE = RopeSpec(inv_freq=1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)), rotary_dim=D)



def _capture(device, host_rows, deltas, dtype=torch.bfloat16, tokens=11, seed=0):
    """A capture of `host_rows` from a batch of `tokens` rows, every layer taken;
    returns it and the per-layer (key, value) batches it saw."""
    g = torch.Generator().manual_seed(seed)
    batch_rows = torch.randperm(tokens, generator=g)[: len(host_rows)]
    cap = StepCapture(batch_rows.to(device), np.asarray(host_rows), None if deltas is None else deltas.to(device),
                      LAYERS, H, D, dtype)
    seen = []
    for layer in range(LAYERS):
        # strided like vLLM's K/V: views into one fused qkv buffer
        qkv = torch.randn(tokens, 3 * H * D, generator=g).to(device=device, dtype=torch.float32)
        key, value = qkv[:, H * D: 2 * H * D].view(tokens, H, D), qkv[:, 2 * H * D:].view(tokens, H, D)
        cap.take(layer, key, value)
        seen.append((key[batch_rows.to(device)].cpu(), value[batch_rows.to(device)].cpu()))
    return cap, seen


def _expected(pool_slots, host_rows, seen, deltas, dtype):
    want = HostPool(pool_slots, LAYERS, BT, H, D, dtype)
    want.data.zero_()
    rows = torch.as_tensor(np.asarray(host_rows))
    for layer, (key, value) in enumerate(seen):
        if deltas is not None:
            key = rotate_keys(key.to(dtype), deltas, ROPE)
        want.write_rows(layer, rows, key.to(dtype), value.to(dtype))
    return want.data


@pytest.mark.parametrize("with_deltas", [False, True])
def test_a_capture_lands_at_its_host_rows_rotated_by_its_deltas(with_deltas):
    host_rows = [5, 6, 7, 8, 13, 2]
    deltas = torch.tensor([3, 3, 3, -2, 40, 0]) if with_deltas else None
    cap, seen = _capture("cpu", host_rows, deltas)
    pool = HostPool(5, LAYERS, BT, H, D, torch.bfloat16)
    pool.data.zero_()
    assert CaptureWriter(pool, torch.device("cpu")).write(cap, ROPE)
    assert torch.equal(pool.data, _expected(5, host_rows, seen, deltas, torch.bfloat16))


def test_a_capture_that_missed_a_layer_is_never_written():
    cap = StepCapture(torch.tensor([0]), np.array([1]), None, LAYERS, H, D, torch.float32)
    x = torch.randn(2, H, D)
    cap.take(0, x, x)
    cap.take(2, x, x)
    assert not cap.complete
    pool = HostPool(2, LAYERS, BT, H, D, torch.float32)
    pool.data.zero_()
    assert not CaptureWriter(pool, torch.device("cpu")).write(cap, ROPE)
    assert pool.data.count_nonzero() == 0


@pytest.mark.skipif(not (torch.cuda.is_available() and cudart.available()), reason="asynchronous path: CUDA only")
def test_cuda_captures_are_copied_into_the_pinned_pool_asynchronously_with_the_same_bytes():
    pool = HostPool(6, LAYERS, BT, H, D, torch.bfloat16, pin_memory=True)
    writer = CaptureWriter(pool, torch.device("cuda"))
    assert writer.stream is not None
    expected = torch.zeros_like(pool.data)
    steps = [([4, 5, 6, 7, 8, 9, 21], torch.tensor([1, 1, 1, 1, 5, 5, -7])), ([10], None), ([0, 3, 1], None)]
    for i, (host_rows, deltas) in enumerate(steps):
        cap, seen = _capture("cuda", host_rows, deltas, seed=i)
        assert writer.write(cap, ROPE)
        step = _expected(6, host_rows, seen, deltas, torch.bfloat16)
        touched = torch.zeros(6 * BT, dtype=torch.bool)
        touched[host_rows] = True
        touched = touched.view(6, BT)[:, None, None, :, None, None].expand_as(expected)
        expected = torch.where(touched, step, expected)
    writer.settle()
    assert not writer._pending
    assert torch.equal(pool.data, expected)


@pytest.mark.skipif(not (torch.cuda.is_available() and cudart.available()), reason="asynchronous path: CUDA only")
def test_cuda_reap_never_waits_for_a_copy_still_running():
    pool = HostPool(2, LAYERS, BT, H, D, torch.bfloat16, pin_memory=True)
    writer = CaptureWriter(pool, torch.device("cuda"))
    cap, seen = _capture("cuda", [3], None, seed=0)
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time ahead of the copy
    assert writer.write(cap, ROPE)
    writer.reap()
    assert len(writer._pending) == 1  # the copy is still queued: kept, not waited for
    writer.settle()
    assert not writer._pending
    assert torch.equal(pool.data, _expected(2, [3], seen, None, torch.bfloat16))
    cap, _ = _capture("cuda", [5], None, seed=1)
    assert writer.write(cap, ROPE)
    torch.cuda.synchronize()
    writer.reap()
    assert not writer._pending  # done copies are let go


@pytest.mark.skipif(not (torch.cuda.is_available() and cudart.available()), reason="asynchronous path: CUDA only")
def test_cuda_order_makes_a_reader_on_another_stream_wait_for_the_captures_copies():
    """A GPU index update reads the pool through the copy engine on its own
    stream: `order` makes that stream wait for the captures still being
    copied in, without the host waiting."""
    pool = HostPool(2, LAYERS, BT, H, D, torch.bfloat16, pin_memory=True)
    pool.data.zero_()
    writer = CaptureWriter(pool, torch.device("cuda"))
    cap, seen = _capture("cuda", [4, 5, 6, 7], None, seed=4)
    torch.cuda._sleep(1_000_000_000)  # the copy starts about half a second from now
    assert writer.write(cap, ROPE)
    reader = torch.cuda.Stream()
    writer.order(reader)
    with torch.cuda.stream(reader):
        keys = pool.slot_keys_on([1], torch.device("cuda"))
    assert not reader.query()  # queued behind the capture's copy; the host went on
    reader.synchronize()
    assert torch.equal(keys.cpu()[0], _expected(2, [4, 5, 6, 7], seen, None, torch.bfloat16)[1, 0])  # slot 1's keys


@pytest.mark.skipif(not (torch.cuda.is_available() and cudart.available()), reason="asynchronous path: CUDA only")
def test_cuda_a_capture_never_rewrites_rows_a_reader_is_still_reading():
    """A reader outside the compute stream's order (the GPU index's feed)
    registered with `add_reader`: a capture written while its read of the
    same slot is still queued lands after that read, and `settle` waits for
    the reader too."""
    pool = HostPool(2, LAYERS, BT, H, D, torch.bfloat16, pin_memory=True)
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(5)))
    before = pool.data[1, 0].clone()
    writer = CaptureWriter(pool, torch.device("cuda"))
    reader = torch.cuda.Stream()
    writer.add_reader(reader)
    with torch.cuda.stream(reader):
        torch.cuda._sleep(1_000_000_000)  # the read starts about half a second from now
        keys = pool.slot_keys_on([1], torch.device("cuda"))
    cap, seen = _capture("cuda", [4, 5, 6, 7], None, seed=6)  # every row of slot 1
    assert writer.write(cap, ROPE)
    writer.settle()
    assert reader.query()
    assert torch.equal(keys.cpu()[0], before)  # what slot 1 held when the read was queued
    assert torch.equal(pool.data[1], _expected(2, [4, 5, 6, 7], seen, None, torch.bfloat16)[1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not (torch.cuda.is_available() and cudart.available()), reason="CUDA only"))])
def test_a_paged_capture_gathered_from_the_caches_stores_the_same_bytes(device):
    """`paged` captures read their rows from FlashAttention-layout caches
    after the forward (one gather, keys rotated in it): the pool gets what
    per-layer takes of the same rows would have stored."""
    pages, page_size = 5, 4
    g = torch.Generator().manual_seed(3)
    caches = [torch.randn(2, pages, page_size, H, D, generator=g).to(device=device, dtype=torch.bfloat16)
              for _ in range(LAYERS)]
    keys, values = [c[0] for c in caches], [c[1] for c in caches]
    slots = torch.tensor([17, 3, 4, 11, 0])
    host_rows, deltas = [5, 6, 7, 8, 13], torch.tensor([3, 3, 3, -2, 400])
    cap = StepCapture(slots.to(device), np.asarray(host_rows), deltas.to(device), LAYERS, H, D, torch.bfloat16,
                      paged=True)
    assert not cap.complete
    cap.gather(keys, values, ROPE)
    assert cap.complete and cap.deltas is None  # rotated in the gather
    pool = HostPool(5, LAYERS, BT, H, D, torch.bfloat16, pin_memory=device == "cuda")
    pool.data.zero_()
    writer = CaptureWriter(pool, torch.device(device))
    assert writer.write(cap, ROPE)
    writer.settle()
    pages_of, offsets = slots // page_size, slots % page_size
    seen = [(k.cpu()[pages_of, offsets], v.cpu()[pages_of, offsets]) for k, v in zip(keys, values)]
    assert torch.equal(pool.data, _expected(5, host_rows, seen, deltas, torch.bfloat16))


def test_a_paged_capture_checks_the_cache_views_against_what_the_layer_wrote():
    """The first paged capture compares the rows it read with the attention
    layer's own K/V: views of the wrong layout (here K and V swapped) fail
    the capture instead of storing wrong KV."""
    pages, page_size = 3, 4
    g = torch.Generator().manual_seed(5)
    caches = [torch.randn(2, pages, page_size, H, D, generator=g).bfloat16() for _ in range(LAYERS)]
    keys, values = [c[0] for c in caches], [c[1] for c in caches]
    slots, deltas = torch.tensor([9, 2]), torch.tensor([7, -1])
    written = (keys[1][slots // page_size, slots % page_size], values[1][slots // page_size, slots % page_size])
    for views, ok in (((keys, values), True), ((values, keys), False)):
        cap = StepCapture(slots, np.array([0, 1]), deltas, LAYERS, H, D, torch.bfloat16, paged=True)
        cap.expect(1, *written)
        assert cap.gather(*views, ROPE) is ok
        assert cap.complete is ok


def test_paged_views_read_what_vllm_0_26_flash_attention_writes():
    """vLLM 0.26's FlashAttention cache packs K and V in the content dim,
    logical [pages, heads, page_size, 2 * head_dim] (stored page-major), and
    writes through `kv_cache.transpose(1, 2).split(head_dim, -1)`; the views
    read back what that wrote. Other layouts: 5-D [2, pages, ...] and
    [pages, 2, ...]; the CPU backend's head-major one is not taken."""
    from vllm_sekv import compat

    pages, page_size = 6, 16
    kv = torch.zeros(pages, page_size, H, 2 * D).permute(0, 2, 1, 3)  # logical (B, H, N, 2D), NHD storage
    key_cache, value_cache = kv.transpose(1, 2).split(D, dim=-1)  # vLLM's write path
    slots = torch.tensor([5, 40, 95])
    k, v = torch.randn(3, H, D), torch.randn(3, H, D)
    key_cache[slots // page_size, slots % page_size] = k
    value_cache[slots // page_size, slots % page_size] = v
    kv_view, v_view = compat.paged_kv_views(kv, H, D)
    assert torch.equal(kv_view[slots // page_size, slots % page_size], k)
    assert torch.equal(v_view[slots // page_size, slots % page_size], v)
    five = torch.randn(2, pages, page_size, H, D)
    assert all(a is not None for a in compat.paged_kv_views(five, H, D))
    assert torch.equal(compat.paged_kv_views(five, H, D)[1], five[1])
    assert torch.equal(compat.paged_kv_views(five.transpose(0, 1), H, D)[0], five[0])
    assert compat.paged_kv_views(torch.zeros(2, pages, H, page_size, D), H, D) is None  # head-major


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_a_capture_into_an_fp8_pool_is_the_exact_pools_rows_quantized(device):
    """`workspace_codec` fp8: whole slots quantized where the capture is,
    the rows of incomplete blocks kept in their tails on the host; each row
    reads back as the exact pool's within one e4m3 rounding (plus the bf16
    read)."""
    host_rows = [4, 5, 6, 7, 8, 9, 0]  # slot 1 whole; slots 2 and 0 begun
    deltas = torch.tensor([3, 3, 3, 3, -2, 40, 0])
    cap, seen = _capture(device, host_rows, deltas)
    pool = HostPool(4, LAYERS, BT, H, D, torch.bfloat16, codec="fp8", pin_memory=device == "cuda")
    writer = CaptureWriter(pool, torch.device(device))
    assert writer.write(cap, ROPE)
    writer.settle()
    want = _expected(4, host_rows, seen, deltas, torch.bfloat16)
    rows = torch.tensor(host_rows)
    k, v = pool.read_rows_all_layers(rows)  # [n, L, H, D]
    for got, kv in ((k, 0), (v, 1)):
        ref = want[rows // BT, kv, :, rows % BT].float()
        params = pool.scales[rows // BT, kv]  # [n, L, H, 1 + D]: scale, centre per channel
        scale, centre = params[..., :1], params[..., 1:]
        bound = (ref - centre).abs() * 2.0 ** -4 + scale * 2.0 ** -10 + ref.abs() * 2.0 ** -8
        assert bool(((got.float() - ref).abs() <= bound).all())
    assert pool.take_failed_slots() == set() and _failed_on_device(writer) == set()


def _failed_on_device(writer: CaptureWriter) -> set[int]:
    """Slots whose stored block was not finite, as the device flags them (fp8 on CUDA)."""
    flags = writer.take_flags()
    if flags is None:
        return set()
    finite, slots = flags
    return set(slots[~finite.cpu().numpy()].tolist())


def _quantized(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One block `[2, L, bt, H, D]` quantized on the device as the pool stores it."""
    from vllm_sekv.store.fp8 import quantize

    q, params, _ = quantize(block.to("cuda")[None], token_dim=3)
    return q[0].cpu(), params[0].cpu()


@pytest.mark.skipif(not (torch.cuda.is_available() and cudart.available()), reason="asynchronous path: CUDA only")
def test_cuda_fp8_captures_are_asynchronous_and_store_each_block_quantized_once_over_all_its_rows():
    """`workspace_codec` fp8 on CUDA: captures are written on the writer's
    stream (the host goes on while the device is busy); a block whose rows
    come over several steps waits in its page-locked tail and is quantized
    once, on the device, when its last row comes: the pool then holds
    exactly that block's quantization; a whole slot likewise at once; an
    incomplete block reads back from its tail."""
    pool = HostPool(6, LAYERS, BT, H, D, torch.bfloat16, codec="fp8", pin_memory=True)
    writer = CaptureWriter(pool, torch.device("cuda"))
    assert writer.stream is not None
    steps = [[8, 9, 12, 13, 14, 15, 20], [10], [11, 21], [0]]  # slot 2 over three steps, 3 whole, 5 and 0 begun
    blocks = torch.zeros(6, 2, LAYERS, BT, H, D, dtype=torch.bfloat16)
    for i, host_rows in enumerate(steps):
        cap, seen = _capture("cuda", host_rows, None, seed=i)
        for layer, (key, value) in enumerate(seen):
            for j, row in enumerate(host_rows):
                blocks[row // BT, 0, layer, row % BT] = key[j].to(torch.bfloat16)
                blocks[row // BT, 1, layer, row % BT] = value[j].to(torch.bfloat16)
        if i == 0:
            torch.cuda._sleep(1_000_000_000)  # the first capture's work starts about half a second from now
        assert writer.write(cap, ROPE)
        if i == 0:
            assert len(writer._pending) == 1 and not writer._pending[0][0].query()  # queued; the host went on
    writer.settle()
    for slot in (2, 3):
        q, params = _quantized(blocks[slot])
        assert torch.equal(pool.data[slot].view(torch.uint8), q.view(torch.uint8)), slot
        assert torch.equal(pool.scales[slot], params), slot
    k, v = pool.read_rows_all_layers(torch.tensor([20, 21, 0]))  # slots 5 and 0: still in their tails
    assert torch.equal(k, blocks[[5, 5, 0], 0, :, [0, 1, 0]]) and torch.equal(v, blocks[[5, 5, 0], 1, :, [0, 1, 0]])
    assert _failed_on_device(writer) == set() and pool.take_failed_slots() == set()


@pytest.mark.skipif(not (torch.cuda.is_available() and cudart.available()), reason="asynchronous path: CUDA only")
def test_cuda_an_fp8_block_that_is_not_finite_is_flagged_on_the_device_and_its_scales_are_nan():
    pool = HostPool(4, LAYERS, BT, H, D, torch.bfloat16, codec="fp8", pin_memory=True)
    writer = CaptureWriter(pool, torch.device("cuda"))
    cap, _ = _capture("cuda", [4, 5, 6, 7, 8, 9, 10, 11], None, seed=3)  # slots 1 and 2 whole
    cap.kv[0, 1, 5] = float("nan")  # one key row of slot 2, layer 1
    assert writer.write(cap, ROPE)
    assert _failed_on_device(writer) == {2}
    writer.settle()
    assert bool(pool.scales[2].isnan().any()) and bool(pool.scales[1].isfinite().all())
    assert pool.take_failed_slots() == set()  # on CUDA the device's flags report it
