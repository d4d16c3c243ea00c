"""The fp8 workspace codec (`workspace_codec: fp8`) on CPU: the quantizer's
error bound, the fp8 host pool (bytes, partial-slot writes, non-finite
blocks), restores through the reference scatter, the batched pipeline and the
layerwise restore against dequantize-then-restore, and NVMe records of an fp8
pool (bit-identical round trip; a record of the other codec is a miss)."""
import numpy as np
import pytest
import torch

from vllm_sekv.ops import RopeSpec
from vllm_sekv.ops.rope.scatter_reference import scatter_rerope
from vllm_sekv.store import HostPool
from vllm_sekv.store.fp8 import CENTRE_GATE, FP8_DTYPE, FP8_MAX, dequantize, error_bound, quantize
from vllm_sekv.store.layerwise import LayerwiseRestore
from vllm_sekv.store.nvme import NvmeLayout, RecordIO
from vllm_sekv.store.records import CODEC_FP8, RecordLayout, record_bytes
from vllm_sekv.store.transfer import RestorePipeline

LAYERS, BT, HEADS, DIM = 3, 8, 2, 16


def _rope(rotary_dim=DIM, neox=True):
    inv = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    return RopeSpec(inv_freq=inv, rotary_dim=rotary_dim, is_neox_style=neox)


def _kv(n, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, LAYERS, n, HEADS, DIM, generator=g) * scale).to(torch.bfloat16)


def _centre(x, token_dim):
    """The codec's centres: a channel's block mean where that is more than
    `CENTRE_GATE` standard deviations from 0, else 0."""
    std, mean = torch.std_mean(x.float(), dim=token_dim, correction=0, keepdim=True)
    return torch.where(mean.abs() > CENTRE_GATE * std, mean, torch.zeros_like(mean))


# ----------------------------------------------------------------- quantizer

@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0])
def test_round_trip_error_is_within_one_e4m3_rounding(magnitude):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 2, LAYERS, BT, HEADS, DIM, generator=g) * magnitude
    x = x + torch.randn(HEADS, DIM, generator=g) * 20 * magnitude  # large channels, as keys with a bias have
    x[0, 0, 0, :, 0] *= 1e-4  # tiny values next to large ones: subnormal e4m3
    q, params, finite = quantize(x, token_dim=3)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape
    assert params.shape == (5, 2, LAYERS, HEADS, 1 + DIM) and params.dtype == torch.float32 and bool(finite.all())
    centre = _centre(x, token_dim=3).squeeze(3)
    assert bool((centre != 0).any()) and bool((centre == 0).any())
    torch.testing.assert_close(params[..., 1:], centre)
    amax = (x - centre.unsqueeze(3)).abs().amax(dim=-1).amax(dim=3)
    torch.testing.assert_close(params[..., 0], amax / FP8_MAX)
    back = dequantize(q, params, token_dim=3)
    err = (back - x).abs()
    assert bool((err <= error_bound(x, params, token_dim=3)).all()), (err - error_bound(x, params, 3)).max()
    # the group's largest residual is represented exactly (it maps to 448)
    residual = (back - centre.unsqueeze(3)).abs().amax(dim=-1).amax(dim=3)
    torch.testing.assert_close(residual, amax, rtol=1e-5, atol=1e-6 * magnitude)


def test_the_centre_keeps_a_large_constant_channel_from_swamping_the_rest():
    """A channel far larger than the others and nearly constant (a key
    projection's bias) comes back with the others' precision, not its own
    magnitude's."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 2, LAYERS, BT, HEADS, DIM, generator=g)
    x[..., 0] += 300.0
    q, params, _ = quantize(x, token_dim=3)
    err = (dequantize(q, params, token_dim=3) - x).abs()
    assert float(err.max()) < 0.5  # the other channels' residuals (randn) * 2**-4; without the centre up to 18
    torch.testing.assert_close(params[..., 1], x[..., 0].mean(dim=3))  # that channel is centred on its mean,
    assert bool((params[..., 2:] == 0).all())  # the others, varying about 0, keep e4m3's relative precision


def test_zero_blocks_get_scale_one_and_read_back_zero():
    x = torch.zeros(2, 2, LAYERS, BT, HEADS, DIM)
    x[1, 1, 2, 3, 1, 5] = -2.5  # one non-zero group
    q, params, finite = quantize(x, token_dim=3)
    assert bool(finite.all())
    expect = torch.ones_like(params[..., 0])
    expect[1, 1, 2, 1] = 2.5 / FP8_MAX  # one value in a channel is no bias: not centred
    torch.testing.assert_close(params[..., 0], expect)
    back = dequantize(q, params, token_dim=3)
    assert torch.equal(back[0], x[0])
    torch.testing.assert_close(back, x, rtol=0, atol=1e-6)


def test_non_finite_groups_get_nan_scales():
    x = torch.randn(1, 2, LAYERS, BT, HEADS, DIM)
    x[0, 0, 1, 2, 1, 3] = float("inf")
    x[0, 1, 0, 0, 0, 0] = float("nan")
    _, params, finite = quantize(x, token_dim=3)
    bad = torch.zeros_like(finite)
    bad[0, 0, 1, 1] = bad[0, 1, 0, 0] = True
    assert torch.equal(~finite, bad)
    scale = params[..., 0]
    assert bool(scale[bad].isnan().all()) and bool(scale[~bad].isfinite().all())
    assert bool((params[..., 1:][bad] == 0).all()) and bool(params[..., 1:].isfinite().all())


# ----------------------------------------------------------------- the pool

def test_pool_bytes_are_the_fp8_bytes_and_the_parameters():
    exact = HostPool(4, LAYERS, BT, HEADS, DIM, torch.bfloat16)
    fp8 = HostPool(4, LAYERS, BT, HEADS, DIM, torch.bfloat16, codec="fp8")
    assert fp8.data.dtype == FP8_DTYPE and fp8.data.shape == exact.data.shape
    assert fp8.scales.shape == (4, 2, LAYERS, HEADS, 1 + DIM) and fp8.scales.dtype == torch.float32
    assert exact.block_bytes == HostPool.bytes_per_block(LAYERS, BT, HEADS, DIM, torch.bfloat16)
    assert fp8.block_bytes == HostPool.bytes_per_block(LAYERS, BT, HEADS, DIM, torch.bfloat16, "fp8")
    assert fp8.block_bytes == exact.block_bytes // 2 + 2 * LAYERS * HEADS * 4 * (1 + DIM)
    # a served geometry (32-token blocks, head_dim 128): 0.56 of the exact bytes
    served = [HostPool.bytes_per_block(32, 32, 8, 128, torch.bfloat16, codec) for codec in ("fp8", "exact")]
    assert 0.56 < served[0] / served[1] < 0.57
    with pytest.raises(ValueError, match="codec"):
        HostPool(1, LAYERS, BT, HEADS, DIM, torch.bfloat16, codec="int4")


def _check_rows_bounded(pool, rows, kv, rounds=1):
    """Every row read back is within `rounds` e4m3 roundings of what was written."""
    k, v = pool.read_rows_all_layers(rows)  # [n, L, H, D]
    for got, want, kv_i in ((k, kv[0], 0), (v, kv[1], 1)):
        want = want.transpose(0, 1).float()  # [n, L, H, D]
        params = pool.scales[rows // BT, kv_i]  # [n, L, H, 1 + D]
        scale, centre = params[..., :1], params[..., 1:]
        bound = rounds * ((want - centre).abs() * 2.0 ** -4 + scale * 2.0 ** -10) + 1e-2 * want.abs()  # + bf16 read
        assert bool(((got.float() - want).abs() <= bound).all()), ((got.float() - want).abs() - bound).max()


def test_whole_slot_writes_read_back_within_the_bound():
    pool = HostPool(6, LAYERS, BT, HEADS, DIM, torch.bfloat16, codec="fp8")
    rows = torch.cat([torch.arange(BT, 3 * BT), torch.arange(4 * BT, 5 * BT)])
    kv = _kv(len(rows), scale=3.0)
    pool.write_rows_all_layers(rows, kv)
    _check_rows_bounded(pool, rows, kv)
    k_all, v_all = pool.read_rows_all_layers(rows)
    for layer in range(LAYERS):
        k, v = pool.read_rows(layer, rows)
        assert k.shape == (len(rows), HEADS, DIM)
        assert torch.equal(k, k_all[:, layer]) and torch.equal(v, v_all[:, layer])
    slots = pool.dequantized_slots([1, 4])
    assert torch.equal(slots[1, 0].transpose(0, 1).reshape(BT, LAYERS, HEADS, DIM), k_all[2 * BT:])
    keys = pool.slot_keys_on([1, 2], torch.device("cpu"))
    assert keys.dtype == torch.bfloat16 and keys.shape == (2, LAYERS, BT, HEADS, DIM)
    assert torch.equal(keys[0], pool.block_keys(1))
    assert pool.take_failed_slots() == set()


def test_a_long_write_is_quantized_a_few_slots_at_a_time_as_in_one(monkeypatch):
    """A prefill's capture may be gigabytes: slots are quantized a few at a
    time (bounded scratch where the K/V are), to the same bytes and scales."""
    from vllm_sekv.store import fp8, host_pool

    rows = torch.arange(5 * BT)
    kv = _kv(len(rows), seed=4, scale=5.0)
    whole = HostPool(6, LAYERS, BT, HEADS, DIM, torch.bfloat16, codec="fp8")
    whole.write_rows_all_layers(rows, kv)
    monkeypatch.setattr(host_pool, "QUANTIZE_SCRATCH_BYTES", 2 * kv[:, :, :BT].numel() * 20)  # 2 slots a time
    calls = []

    def recording(block, token_dim):
        calls.append(len(block))
        return quantize(block, token_dim)

    monkeypatch.setattr(fp8, "quantize", recording)  # what `quantize_blocks` calls
    chunked = HostPool(6, LAYERS, BT, HEADS, DIM, torch.bfloat16, codec="fp8")
    chunked.write_rows_all_layers(rows, kv)
    assert calls == [2, 2, 1]  # bounded scratch: never more than 2 slots per call
    assert torch.equal(chunked.data[:5].view(torch.uint8), whole.data[:5].view(torch.uint8))  # slot 5: unwritten
    assert torch.equal(chunked.scales[:5], whole.scales[:5])


@pytest.mark.parametrize("per_layer", [False, True], ids=["all-layers", "per-layer"])
def test_partial_slot_writes_wait_in_the_tail_and_are_quantized_once(per_layer):
    """A block written a few rows at a time, each step louder than the last:
    its rows read back as written until the block is complete, then it is
    quantized once, with one scale over every row (one rounding each)."""
    pool = HostPool(4, LAYERS, BT, HEADS, DIM, torch.bfloat16, codec="fp8")
    pool.data.fill_(float("nan"))  # stale bytes of a reused slot must not matter
    slot = 2
    chunks = [(0, 3, 0.01), (3, 4, 1.0), (4, 7, 50.0), (7, 8, 0.5)]
    written = []
    for i, (lo, hi, mag) in enumerate(chunks):
        rows = torch.arange(slot * BT + lo, slot * BT + hi)
        kv = _kv(hi - lo, seed=i, scale=mag)
        if per_layer:
            for layer in range(LAYERS):
                pool.write_rows(layer, rows, kv[0, layer], kv[1, layer])
        else:
            pool.write_rows_all_layers(rows, kv)
        written.append((rows, kv))
        if hi < BT:  # incomplete: every row as written, the rest empty
            k, v = pool.read_rows_all_layers(torch.arange(slot * BT, slot * BT + BT))
            so_far = torch.cat([w for _, w in written], dim=2)
            assert torch.equal(k[:hi], so_far[0].transpose(0, 1)) and torch.equal(v[:hi], so_far[1].transpose(0, 1))
            assert bool((k[hi:] == 0).all()) and bool((v[hi:] == 0).all())
    for r, k in written:
        _check_rows_bounded(pool, r, k, rounds=1)
    all_kv = torch.cat([k for _, k in written], dim=2).float()
    centre = _centre(all_kv, token_dim=2)  # [2, L, 1, H, D]
    amax = (all_kv - centre).abs().amax(dim=-1).amax(dim=2)  # [2, L, H]
    torch.testing.assert_close(pool.scales[slot, ..., 0], amax / FP8_MAX)  # the scale covers every row
    torch.testing.assert_close(pool.scales[slot, ..., 1:], centre.squeeze(2))
    assert pool.take_failed_slots() == set() and not pool._tails


def test_rows_of_an_incomplete_block_are_left_to_the_host_path():
    """A device restore copies a slot's fp8 bytes, which an incomplete block
    does not have yet: `split_tail_rows` takes its rows out of the device
    restore (with their paged slots and deltas) for the host path, which
    reads them from the tail as written."""
    from vllm_sekv.worker_side.device_restores import split_tail_rows
    from vllm_sekv.workspace.step_plan import RestoreOp

    pool = HostPool(4, LAYERS, BT, HEADS, DIM, torch.bfloat16, codec="fp8")
    pool.write_rows_all_layers(torch.arange(BT, 2 * BT), _kv(BT, seed=1))  # slot 1 whole
    pool.write_rows_all_layers(torch.arange(2 * BT, 2 * BT + 3), _kv(3, seed=2))  # slot 2: 3 rows, in a tail
    rows = np.arange(BT, 2 * BT + 3)
    assert pool.in_tails(rows).tolist() == [False] * BT + [True] * 3
    op = RestoreOp("r", paged_slots=np.arange(100, 100 + len(rows)), host_rows=rows,
                   rope_deltas=np.full(len(rows), 7), first_position=5)
    whole = RestoreOp("w", paged_slots=np.arange(8), host_rows=np.arange(BT, BT + 8))
    device, tails = split_tail_rows([whole, op], pool)
    assert device[0] is whole and [o.req_id for o in device] == ["w", "r"] and len(tails) == 1
    assert device[1].host_rows.tolist() == rows[:BT].tolist() and device[1].paged_slots.tolist() == list(range(100, 100 + BT))
    assert tails[0].host_rows.tolist() == rows[BT:].tolist() and tails[0].paged_slots.tolist() == [100 + BT, 101 + BT, 102 + BT]
    assert tails[0].rope_deltas.tolist() == [7, 7, 7] and tails[0].first_position == 5
    k, _ = pool.read_rows_all_layers(torch.from_numpy(tails[0].host_rows))
    assert torch.equal(k, _kv(3, seed=2)[0].transpose(0, 1))  # the host path reads the tail as written
    exact = HostPool(4, LAYERS, BT, HEADS, DIM, torch.bfloat16)
    assert not exact.in_tails(rows).any() and split_tail_rows([op], exact) == ([op], [])


def test_a_write_into_a_block_whose_first_rows_are_gone_fails_its_slot():
    """Rows of a block that no tail holds and that the write does not start
    (offset 0): its earlier rows are gone, so the slot is failed and nothing
    of it changes."""
    pool = HostPool(2, LAYERS, BT, HEADS, DIM, torch.bfloat16, codec="fp8")
    pool.write_rows_all_layers(torch.arange(BT, 2 * BT), _kv(BT, scale=1000.0))
    before = pool.data[1].clone(), pool.scales[1].clone()
    rows = torch.arange(BT + 2, BT + 5)
    kv = _kv(3, seed=6, scale=0.1)
    for layer in range(LAYERS):
        pool.write_rows(layer, rows, kv[0, layer], kv[1, layer])
    assert pool.take_failed_slots() == {1}
    assert torch.equal(pool.data[1].view(torch.uint8), before[0].view(torch.uint8))
    assert torch.equal(pool.scales[1], before[1])


def test_a_slots_first_row_starts_it_afresh():
    pool = HostPool(2, LAYERS, BT, HEADS, DIM, torch.bfloat16, codec="fp8")
    pool.write_rows_all_layers(torch.arange(BT), _kv(BT, scale=1000.0))  # the slot's previous block: loud
    kv = _kv(BT, seed=5, scale=0.1)
    pool.write_rows_all_layers(torch.arange(0, 3), kv[:, :, :3])
    k, _ = pool.read_rows_all_layers(torch.arange(3, BT))
    assert bool((k == 0).all())  # rows not written yet are empty, not the old block's
    pool.write_rows_all_layers(torch.arange(3, BT), kv[:, :, 3:])
    centre = _centre(kv, token_dim=2)
    amax = (kv.float() - centre).abs().amax(dim=-1).amax(dim=2)
    torch.testing.assert_close(pool.scales[0, ..., 0], amax / FP8_MAX)  # not the old block's scale
    _check_rows_bounded(pool, torch.arange(BT), kv)


def test_tails_are_bounded_and_a_dropped_block_fails_when_written_again(monkeypatch):
    """Past `TAIL_BLOCKS` incomplete blocks the least recently written tail
    is dropped; a later write into that block fails its slot."""
    import vllm_sekv.store.host_pool as host_pool

    monkeypatch.setattr(host_pool, "TAIL_BLOCKS", 2)
    pool = HostPool(4, LAYERS, BT, HEADS, DIM, torch.bfloat16, codec="fp8")
    for slot in (0, 1, 2):  # three blocks started, two tails kept
        pool.write_rows_all_layers(torch.arange(slot * BT, slot * BT + 2), _kv(2, seed=slot))
    assert sorted(pool._tails) == [1, 2] and pool.take_failed_slots() == set()
    pool.write_rows_all_layers(torch.arange(2, 4), _kv(2))  # block 0 goes on: its first rows are gone
    assert pool.take_failed_slots() == {0}
    pool.write_rows_all_layers(torch.arange(BT + 2, 2 * BT), _kv(BT - 2))  # block 1 completes
    assert sorted(pool._tails) == [2] and pool.take_failed_slots() == set()


def test_non_finite_kv_fails_its_slot_and_never_reads_back_plausible():
    pool = HostPool(4, LAYERS, BT, HEADS, DIM, torch.bfloat16, codec="fp8")
    kv = _kv(2 * BT)
    kv[1, 2, BT + 3, 1, 4] = float("inf")  # slot 1's V, layer 2
    pool.write_rows_all_layers(torch.arange(2 * BT), kv)
    assert pool.take_failed_slots() == {1}
    assert pool.take_failed_slots() == set()
    k, v = pool.read_rows(2, torch.arange(BT, 2 * BT))
    assert v.shape == (BT, HEADS, DIM)
    assert bool(v[:, 1].isnan().all()) and bool(v[:, 0].isfinite().all()) and bool(k.isfinite().all())
    _check_rows_bounded(pool, torch.arange(BT), kv[:, :, :BT])  # slot 0 unaffected
    # a block completed from partial writes is checked when it is quantized
    bad = _kv(BT, seed=9)
    bad[0, 0, 5, 0, 0] = float("nan")
    pool.write_rows_all_layers(torch.arange(2 * BT, 2 * BT + 4), bad[:, :, :4])
    assert pool.take_failed_slots() == set()
    pool.write_rows_all_layers(torch.arange(2 * BT + 4, 3 * BT), bad[:, :, 4:])
    assert pool.take_failed_slots() == {2}


# ------------------------------------------------------------------ restores

def _caches(pages=10, page_size=4, dtype=torch.bfloat16, seed=3):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(LAYERS, 2, pages, page_size, HEADS, DIM, generator=g).to(dtype)
    return kv, [kv[l, 0] for l in range(LAYERS)], [kv[l, 1] for l in range(LAYERS)]


def _filled_fp8_pool(num_slots=6):
    pool = HostPool(num_slots, LAYERS, BT, HEADS, DIM, torch.bfloat16, codec="fp8")
    pool.write_rows_all_layers(torch.arange(num_slots * BT), _kv(num_slots * BT, seed=7, scale=4.0))
    return pool


@pytest.mark.parametrize("neox", [True, False])
def test_reference_scatter_with_scales_equals_dequantize_then_scatter(neox):
    pool = _filled_fp8_pool()
    slots = torch.tensor([4, 1, 2])
    rope = _rope(12, neox)  # partial rotary: dims 12..15 pass through
    g = torch.Generator().manual_seed(9)
    mapping = torch.randperm(40, generator=g)[: 3 * BT]
    mapping[::7] = -1
    deltas = torch.randint(-3000, 90000, (3 * BT,), generator=g)
    kv_a, ka, va = _caches()
    kv_b, kb, vb = kv_a.clone(), [None] * LAYERS, [None] * LAYERS
    kb, vb = [kv_b[l, 0] for l in range(LAYERS)], [kv_b[l, 1] for l in range(LAYERS)]
    scatter_rerope(pool.data[slots], ka, va, mapping, deltas, rope, scales=pool.scales[slots])
    # dequantized to float32, scattered into float32 caches, rounded once at the end
    wide = dequantize(pool.data[slots], pool.scales[slots], token_dim=3)
    kv_w = kv_b.float()
    scatter_rerope(wide, [kv_w[l, 0] for l in range(LAYERS)], [kv_w[l, 1] for l in range(LAYERS)], mapping,
                   deltas, rope)
    assert torch.equal(kv_a, kv_w.to(torch.bfloat16))
    # src_rows pick staging rows and their scales together
    kv_c, kc, vc = _caches()
    scatter_rerope(pool.data, kc, vc, mapping, deltas, rope, src_rows=slots, scales=pool.scales)
    assert torch.equal(kv_c, kv_a)
    with pytest.raises(ValueError, match="scales"):
        scatter_rerope(pool.data[slots], ka, va, mapping, deltas, rope, scales=pool.scales[:2])


def test_batched_pipeline_moves_fp8_bytes_and_matches_the_reference():
    pool = _filled_fp8_pool()
    slots = [5, 0, 1, 3]
    rope = _rope()
    g = torch.Generator().manual_seed(11)
    mapping = torch.randperm(40, generator=g)[: len(slots) * BT]
    deltas = torch.randint(0, 5000, (len(slots) * BT,), generator=g)
    pipe = RestorePipeline(tuple(pool.data.shape[1:]), pool.data.dtype, "cpu", batch_blocks=3)
    exact_pipe = RestorePipeline(tuple(pool.data.shape[1:]), torch.bfloat16, "cpu")
    assert pipe.block_bytes == pool.block_bytes
    assert pipe.block_bytes == exact_pipe.block_bytes // 2 + 2 * LAYERS * HEADS * 4 * (1 + DIM)  # + parameters
    kv_a, ka, va = _caches()
    handle = pipe.restore(pool.data, slots, ka, va, mapping, deltas, rope, scales=pool.scales)
    assert handle.num_bytes == len(slots) * pool.block_bytes
    kv_b, kb, vb = _caches()
    index = torch.tensor(slots)
    scatter_rerope(pool.data[index], kb, vb, mapping, deltas, rope, scales=pool.scales[index])
    assert torch.equal(kv_a, kv_b)
    seen = []
    pipe.restore(pool.data, slots, (), (), mapping, deltas, rope,
                 write=lambda staged, m, d, s: seen.append((staged.dtype, s.shape)), scales=pool.scales)
    assert seen == [(FP8_DTYPE, (3, 2, LAYERS, HEADS, 1 + DIM)), (FP8_DTYPE, (1, 2, LAYERS, HEADS, 1 + DIM))]
    with pytest.raises(ValueError, match="scales"):
        pipe.restore(pool.data, slots, ka, va, mapping, deltas, rope)
    pipe.close()
    exact_pipe.close()


def test_layerwise_restore_hands_fp8_layers_with_their_parameters():
    pool = _filled_fp8_pool(8)
    host_slots = np.array([6, 7, 0, 3])
    written = {}
    job = LayerwiseRestore(pool.data, host_slots,
                           lambda l, k, v, p: written.__setitem__(l, (k.clone(), v.clone(), p.clone())),
                           "cpu", depth=2, scales=pool.scales)
    job.start()
    for layer in (2, 0, 1):
        job.load(layer)
    job.finish()
    assert sorted(written) == list(range(LAYERS))
    assert job.num_bytes == len(host_slots) * pool.block_bytes
    index = torch.from_numpy(host_slots)
    wide = dequantize(pool.data[index], pool.scales[index], token_dim=3)
    for layer, (k, v, params) in written.items():
        assert k.dtype == v.dtype == FP8_DTYPE and k.shape == (len(host_slots), BT, HEADS, DIM)
        assert torch.equal(params, pool.scales[index][:, :, layer])
        assert torch.equal(dequantize(k, params[:, 0], token_dim=1), wide[:, 0, layer])
        assert torch.equal(dequantize(v, params[:, 1], token_dim=1), wide[:, 1, layer])
    with pytest.raises(ValueError, match="scales"):
        LayerwiseRestore(pool.data, host_slots, None, "cpu")


# ---------------------------------------------------------------------- NVMe

H0 = b"\x01" * 16
TENANT = b"\xaa" * 16
MODEL = b"\x11" * 32


def _fp8_io(root, folder="fp"):
    pool = _filled_fp8_pool(4)
    layout = RecordLayout.of_pool(MODEL, pool.data, 0, pool.scales, torch.bfloat16)
    return pool, RecordIO(NvmeLayout(root, folder), pool.data, layout, threads=2, sync=False,
                          pool_scales=pool.scales)


def test_nvme_round_trip_of_an_fp8_record_is_bit_identical(tmp_path):
    pool, io = _fp8_io(tmp_path)
    assert io.record_layout.codec == CODEC_FP8 and io.record_layout.payload_bytes == pool.block_bytes
    data, scales = pool.data[1].clone(), pool.scales[1].clone()
    io.submit_write(1, H0, 64, TENANT)
    (done,) = io.drain(wait=True)
    assert done.ok, done.reason
    assert io.layout.block_path(H0, 0).stat().st_size == record_bytes(pool.block_bytes)
    pool.data[3].view(torch.uint8).zero_()
    pool.scales[3].zero_()
    io.submit_read(H0, 3, 64, TENANT)
    (done,) = io.drain(wait=True)
    assert done.ok, done.reason
    assert torch.equal(pool.data[3].view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(pool.scales[3].view(torch.int32), scales.view(torch.int32))


def test_a_record_of_the_other_codec_is_a_miss(tmp_path):
    pool, io = _fp8_io(tmp_path, folder="shared")
    io.submit_write(0, H0, 0, TENANT)
    assert io.drain(wait=True)[0].ok
    exact = HostPool(4, LAYERS, BT, HEADS, DIM, torch.bfloat16)
    exact_io = RecordIO(NvmeLayout(tmp_path, "shared"), exact.data, RecordLayout.of_pool(MODEL, exact.data, 0),
                        threads=2, sync=False)
    exact_io.submit_read(H0, 1, 0, TENANT)
    (done,) = exact_io.drain(wait=True)
    assert not done.ok and "codec" in done.reason
    # and the reverse: an exact record read by an fp8 pool
    exact.data[2].copy_(torch.randn(exact.data[2].shape).to(torch.bfloat16))
    exact_io.submit_write(2, b"\x02" * 16, 0, TENANT)
    assert exact_io.drain(wait=True)[0].ok
    before = pool.data[1].clone(), pool.scales[1].clone()
    io.submit_read(b"\x02" * 16, 1, 0, TENANT)
    (done,) = io.drain(wait=True)
    assert not done.ok
    assert torch.equal(pool.data[1].view(torch.uint8), before[0].view(torch.uint8))  # never written wrong
    assert torch.equal(pool.scales[1], before[1])
    with pytest.raises(ValueError, match="fp8"):
        RecordIO(NvmeLayout(tmp_path, "x"), pool.data, io.record_layout, threads=1)  # fp8 layout, no scales
    for x in (io, exact_io):
        x.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_rows_read_on_a_device_equal_the_host_read_tails_included(device):
    """`rows_on` (the coarse summaries' reader): whole fp8 slots moved and
    dequantized on the device, rows picked there; rows of a block still in its
    tail come from the tail, as `read_rows_all_layers` reads them."""
    pool = HostPool(4, LAYERS, BT, HEADS, DIM, torch.bfloat16, codec="fp8", pin_memory=device == "cuda")
    pool.write_rows_all_layers(torch.arange(0, 2 * BT), _kv(2 * BT, seed=1))  # slots 0 and 1, whole
    pool.write_rows_all_layers(torch.arange(2 * BT, 2 * BT + 3), _kv(3, seed=2))  # slot 2: 3 rows in its tail
    rows = np.array([2 * BT + 1, 3, BT + 5, 2 * BT, 0, 2 * BT + 2])
    k, v = pool.rows_on(rows, torch.device(device))
    want_k, want_v = pool.read_rows_all_layers(torch.from_numpy(rows))
    assert k.device.type == device
    if device == "cpu":
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
    else:  # dequantized by the device's arithmetic: within one bfloat16 rounding
        torch.testing.assert_close(k.cpu(), want_k, rtol=2 ** -7, atol=1e-6)
        torch.testing.assert_close(v.cpu(), want_v, rtol=2 ** -7, atol=1e-6)
