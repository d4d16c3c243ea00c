"""The worker's layer-by-layer restore and its head start (`DeviceRestores`),
driven on the CPU, where its copies run synchronously: every planned token
lands in its paged slot with the pool's bytes, keys re-RoPE'd by their
deltas; a head start of the same step is adopted (its copies are the ones
that land), one of another step or other slots is dropped and the step
restores on its own; one begun at the match lands only once the step's plan
claims it for the request that restores exactly its slots, the plan's other
requests restored by a second job. On CUDA the same code runs with copy streams inside vLLM
(tests/gpu/test_cuda_engine.py). vLLM's attention layers are stand-ins here:
their cache-update op writes rows into a flat cache by slot, as the
platform's does."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_sekv.model_identity import KVGeometry
from vllm_sekv.worker_side.device_restores import DeviceRestores
from vllm_sekv.ops import RopeSpec, rotate_keys
from vllm_sekv.store import HostPool
from vllm_sekv.store.capture import CaptureWriter
from vllm_sekv.workspace.step_plan import RestoreOp

LAYERS, BT, HEADS, D, SLOTS, PAGED = 3, 4, 2, 8, 40, 200
ROPE = RopeSpec(inv_freq=1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)), rotary_dim=D)
GEOMETRY = KVGeometry(num_layers=LAYERS, kv_heads=HEADS, head_dim=D, dtype=torch.float32, world_size=1)


class Layer:
    """An attention layer's cache-update op: rows into `cache[slot]`, -1 skipped."""

    def __init__(self):
        self.impl = self

    def write_kv(self, layer, key, value, kv_cache, slots):
        keep = slots >= 0
        kv_cache[0, slots[keep]] = key[keep]
        kv_cache[1, slots[keep]] = value[keep]


def _setup(restore_mode="layerwise", codec="exact", resident_bytes=0):
    pool = HostPool(SLOTS, LAYERS, BT, HEADS, D, torch.float32, codec=codec)
    kv = torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(0))
    if codec == "exact":
        pool.data.copy_(kv)
    else:  # every slot written whole, as captures fill them
        pool.write_rows_all_layers(torch.arange(SLOTS * BT),
                                   kv.permute(1, 2, 0, 3, 4, 5).reshape(2, LAYERS, SLOTS * BT, HEADS, D))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    caches = {name: torch.zeros(2, PAGED, HEADS, D) for name in names}
    context = SimpleNamespace(no_compile_layers={name: Layer() for name in names})
    restores = DeviceRestores(pool, CaptureWriter(pool, torch.device("cpu")), caches,
                              {name: i for i, name in enumerate(names)}, GEOMETRY, ROPE, BT, restore_mode,
                              torch.device("cpu"), layerwise_copies=True, resident_bytes=resident_bytes)
    return pool, caches, context, restores


def _op(rope_deltas=None):
    host_rows = np.concatenate([np.arange(4 * BT, 7 * BT), np.arange(20 * BT, 21 * BT + 2)])  # two runs
    paged = np.arange(len(host_rows), dtype=np.int64) * 3 + 5
    return RestoreOp("r", paged_slots=paged, host_rows=host_rows, rope_deltas=rope_deltas)


def _check(pool, caches, op):
    rows = torch.from_numpy(op.host_rows)
    slots = torch.from_numpy(op.paged_slots)
    for layer, cache in enumerate(caches.values()):
        key, value = pool.read_rows(layer, rows)  # fp8 pools: dequantized (float32 here: no rounding)
        if op.rope_deltas is not None:
            key = rotate_keys(key, torch.from_numpy(op.rope_deltas), ROPE)
        assert torch.equal(cache[0, slots], key) and torch.equal(cache[1, slots], value), f"layer {layer}"


def _run(restores, context, step_id, op, order=()):
    assert restores.start(context, step_id, [op]) == []  # layerwise: its timing comes with `finish`
    assert restores.layerwise
    for name in order:
        restores.load(name)
    assert restores.finish() == []  # no timing events on the CPU
    assert not restores.layerwise


@pytest.mark.parametrize("codec", ["exact", "fp8"])
@pytest.mark.parametrize("deltas", [None, "moved"])
def test_every_planned_token_lands_in_its_paged_slot(deltas, codec):
    """fp8 pools: the fp8 bytes and scales move, K/V are dequantized and keys
    rotated in float32 on the device: what lands is the dequantized pool's."""
    pool, caches, context, restores = _setup(codec=codec)
    op = _op(None if deltas is None else np.arange(len(_op().host_rows), dtype=np.int64) * 7 - 50)
    _run(restores, context, 1, op, order=list(caches)[::-1])
    _check(pool, caches, op)


@pytest.mark.parametrize("deltas", [None, "moved"])
def test_rows_of_an_incomplete_fp8_block_come_from_its_tail(deltas):
    """An fp8 block is quantized once complete; until then its rows wait in
    a tail and the slot's bytes are not written. A restore that reaches such
    rows (a view's most recent tokens) writes them from the tail, the rest
    from the copies; a head start of the plan is still adopted."""
    pool, caches, context, restores = _setup(codec="fp8")
    tail_rows = torch.arange(30 * BT, 30 * BT + 3)  # slot 30 taken afresh: 3 of its rows so far
    pool.write_rows_all_layers(tail_rows, torch.randn(2, LAYERS, 3, HEADS, D) * 100)
    op = _op()
    host_rows = np.concatenate([op.host_rows, tail_rows.numpy()])
    paged = np.arange(len(host_rows), dtype=np.int64) * 3 + 5
    moved = None if deltas is None else np.arange(len(host_rows), dtype=np.int64) * 7 - 50
    op = RestoreOp("r", paged_slots=paged, host_rows=host_rows, rope_deltas=moved)
    assert pool.in_tails(host_rows).sum() == 3
    restores.head_start(1, [op])
    job = restores._head_start.jobs[0][1]
    assert job.num_blocks == 5  # the copies leave the tail's slot out
    assert restores.start(context, 1, [op]) == []
    assert restores._jobs[0][0] is job  # adopted
    restores.finish()
    _check(pool, caches, op)  # every row as the pool reads it, the tail's as written


def test_a_head_start_of_the_same_step_is_adopted():
    pool, caches, context, restores = _setup()
    op = _op()
    saved = pool.data.clone()
    restores.head_start(1, [op])  # every layer's copy is made here (ring depth >= LAYERS)
    pool.data.zero_()  # so what lands must be what the head start copied
    _run(restores, context, 1, op)
    pool.data.copy_(saved)
    _check(pool, caches, op)


@pytest.mark.parametrize("stale", ["another step", "other slots"])
def test_a_head_start_of_another_step_or_other_slots_is_dropped(stale):
    pool, caches, context, restores = _setup()
    op = _op()
    if stale == "another step":
        restores.head_start(1, [op])
    else:
        restores.head_start(2, [RestoreOp("r", paged_slots=op.paged_slots[:3 * BT],
                                          host_rows=np.arange(9 * BT, 12 * BT))])
    pool.data.mul_(-1)  # what the stale copies read is not what this step restores
    _run(restores, context, 2, op)
    assert restores._head_start is None
    _check(pool, caches, op)


def _slots(op):
    return np.unique(op.host_rows // BT)  # the op's runs keep their slots in ascending order


def test_a_head_start_begun_at_the_match_is_claimed_by_the_plan_of_the_same_slots():
    pool, caches, context, restores = _setup()
    op = _op()
    saved = pool.data.clone()
    restores.head_start_match(_slots(op))
    pool.data.zero_()  # so what lands must be what the match's head start copied
    restores.head_start(1, [op])
    _run(restores, context, 1, op)
    pool.data.copy_(saved)
    _check(pool, caches, op)


@pytest.mark.parametrize("plan", ["other slots", "no restore"])
def test_a_head_start_begun_at_the_match_is_dropped_by_a_plan_that_does_not_restore_it(plan):
    pool, caches, context, restores = _setup()
    op = _op()
    restores.head_start_match(np.arange(9, 12))
    pool.data.mul_(-1)  # what the match's copies read is not what this step restores
    restores.head_start(1, [op] if plan == "other slots" else [])
    if plan == "no restore":
        assert restores._head_start is None
        return
    begun = restores._head_start  # the plan's own head start took its place
    assert begun.step_id == 1 and [indices for indices, _ in begun.jobs] == [[0]]
    assert np.array_equal(begun.jobs[0][1].host_slots, _slots(op))
    _run(restores, context, 1, op)
    _check(pool, caches, op)


def test_a_head_start_begun_at_the_match_is_never_adopted_unclaimed():
    pool, caches, context, restores = _setup()
    op = _op()
    restores.head_start_match(_slots(op))
    pool.data.mul_(-1)
    _run(restores, context, 1, op)  # no plan claimed it: the step copies for itself
    _check(pool, caches, op)


def test_a_second_restore_matched_in_the_same_pass_leaves_the_first_its_head_start():
    pool, caches, context, restores = _setup()
    op = _op()
    restores.head_start_match(_slots(op))
    first = restores._head_start
    restores.head_start_match(np.arange(9, 12))
    assert restores._head_start is first
    saved = pool.data.clone()
    pool.data.zero_()  # so what lands must be what the first match's head start copied
    restores.head_start(1, [op])
    _run(restores, context, 1, op)
    pool.data.copy_(saved)
    _check(pool, caches, op)


def test_a_plan_of_two_restores_claims_the_match_head_start_for_its_request_and_copies_the_other():
    pool, caches, context, restores = _setup()
    a = _op()
    b = RestoreOp("b", paged_slots=np.arange(100, 100 + 3 * BT, dtype=np.int64), host_rows=np.arange(9 * BT, 12 * BT))
    saved = pool.data.clone()
    restores.head_start_match(_slots(a))
    pool.data.zero_()  # a's bytes can only come from the match's copies ...
    pool.data[9:12] = saved[9:12]  # ... and b's from the plan's
    restores.head_start(1, [b, a])
    assert [indices for indices, _ in restores._head_start.jobs] == [[1], [0]]
    pool.data.zero_()  # so what lands must be what the two head starts copied
    assert restores.start(context, 1, [b, a]) == [] and restores.layerwise
    assert restores.finish() == [] and not restores.layerwise
    pool.data.copy_(saved)
    _check(pool, caches, a)
    _check(pool, caches, b)


def test_scattered_slots_go_batched_in_auto_mode_and_get_no_head_start():
    _, _, _, restores = _setup(restore_mode="auto")
    scattered = np.concatenate([np.arange(s * BT, s * BT + BT) for s in (1, 5, 9, 13)])
    restores.head_start(1, [RestoreOp("r", paged_slots=np.arange(len(scattered)), host_rows=scattered)])
    assert restores._head_start is None
    restores.head_start_match(np.array([1, 5, 9, 13]))
    assert restores._head_start is None


class Counts:
    """A stats stand-in: sums what is added."""

    def __init__(self):
        self.data = {}

    def add(self, key, amount):
        self.data[key] = self.data.get(key, 0) + amount


@pytest.mark.parametrize("codec", ["exact", "fp8"])
def test_a_view_step_places_the_blocks_an_earlier_step_brought_and_moves_only_the_rest(codec):
    """Diff restores (`resident_bytes`): batched restores keep their blocks on
    the device; the next step's restore of mostly the same slots, elsewhere in
    the cache and at other positions, copies those there and moves only the
    new ones, and every token lands as a full restore writes it. A slot the
    step rewrites is never placed from its old copy."""
    pool, caches, context, restores = _setup("batched", codec, resident_bytes=16 * pool_slot_bytes(codec))
    first = _op(np.arange(len(_op().host_rows), dtype=np.int64) * 7 - 50)
    assert restores.start(context, 1, [first]) == []  # no timing events on the CPU
    counts = Counts()
    assert restores.account("r", 0, counts) > 0 and counts.data["resident_blocks"] == 0
    _check(pool, caches, first)
    # next step: slots 5, 6 and 20 again, 9 new; slot 4 rewritten since (a capture, an NVMe read)
    restores.drop_rewritten({4})
    pool.write_rows_all_layers(torch.arange(4 * BT, 5 * BT), torch.randn(2, LAYERS, BT, HEADS, D))
    host_rows = np.concatenate([np.arange(9 * BT, 10 * BT), np.arange(4 * BT, 7 * BT), np.arange(20 * BT, 21 * BT)])
    paged = np.arange(len(host_rows), dtype=np.int64) * 2 + 1
    second = RestoreOp("r", paged_slots=paged, host_rows=host_rows, rope_deltas=np.full(len(host_rows), 300))
    restores.start(context, 2, [second])
    counts = Counts()
    moved = restores.account("r", 0, counts)
    assert counts.data["resident_blocks"] == 3  # 5, 6, 20
    assert moved == 2 * pool.block_bytes + 3 * (pool.block_bytes - pool_slot_bytes(codec))  # 9 and 4 whole, scales
    _check(pool, caches, second)


def pool_slot_bytes(codec):
    """Bytes of one slot's K/V in the pool (its scales aside)."""
    pool = HostPool(1, LAYERS, BT, HEADS, D, torch.float32, codec=codec)
    return pool.data[0].numel() * pool.data.element_size()


def test_a_resident_pool_too_small_for_one_block_fails_at_start_naming_the_key():
    with pytest.raises(ValueError, match="'resident_bytes'"):
        _setup("batched", resident_bytes=pool_slot_bytes("exact") - 1)


def test_with_a_resident_pool_a_restore_of_long_runs_goes_batched_and_is_placed_next_time():
    """`restore_mode` auto would restore a history's long runs of host slots
    layer by layer, which the resident pool cannot serve: with a pool they go
    batched, and a view that restores the same slots again at other
    positions places them all from the device."""
    pool, caches, context, restores = _setup("auto", resident_bytes=32 * pool_slot_bytes("exact"))
    host_rows = np.arange(2 * BT, 30 * BT)  # one run of 28 slots
    first = RestoreOp("r", paged_slots=np.arange(len(host_rows), dtype=np.int64), host_rows=host_rows)
    restores.start(context, 1, [first])
    assert not restores.layerwise
    counts = Counts()
    restores.account("r", 0, counts)
    assert counts.data["resident_blocks"] == 0
    again = RestoreOp("r", paged_slots=np.arange(len(host_rows), dtype=np.int64) + 80, host_rows=host_rows,
                      rope_deltas=np.full(len(host_rows), -64))
    restores.start(context, 2, [again])
    counts = Counts()
    assert restores.account("r", 0, counts) == 0 and counts.data["resident_blocks"] == 28
    _check(pool, caches, again)


@pytest.mark.parametrize("deltas", [None, "moved"])
def test_an_fp8_paged_caches_own_bytes_are_written_back_as_they_are(deltas):
    """A pool of an fp8 paged cache's bytes (`HostPool.layer_params`), the
    caches' byte views checked (`cache_bytes`): a layerwise restore writes
    the pool's bytes into the pages through those views, never through the
    cache-update op (the stand-in's would not fit these caches); keys it moves
    are dequantized, rotated and rounded to nearest at their layer's scale.
    Paged slots the restore does not write (-1 in its route) stay as they
    were."""
    from vllm_sekv import compat
    from vllm_sekv.store.fp8 import FP8_DTYPE, cache_params

    page = 8
    scales = [1.0, 0.5, 2.0]
    pool = HostPool(SLOTS, LAYERS, BT, HEADS, D, torch.float32, codec="fp8",
                    layer_params=cache_params(scales, scales, HEADS, D))
    codes = torch.randint(0, 256, (2, LAYERS, SLOTS * BT, HEADS, D), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(0))
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN
    pool.write_fp8_rows(torch.arange(SLOTS * BT), codes)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    caches = {name: torch.zeros(PAGED // page, HEADS, page, 2 * D, dtype=torch.uint8) for name in names}
    context = SimpleNamespace(no_compile_layers={name: Layer() for name in names})
    restores = DeviceRestores(pool, CaptureWriter(pool, torch.device("cpu")), caches,
                              {name: i for i, name in enumerate(names)}, GEOMETRY, ROPE, BT, "layerwise",
                              torch.device("cpu"), layerwise_copies=True)
    op = _op(None if deltas is None else np.arange(len(_op().host_rows), dtype=np.int64) * 7 - 50)
    assert restores.start(context, 1, [op], cache_bytes=True) == []
    restores.finish()
    slots, rows = torch.from_numpy(op.paged_slots), torch.from_numpy(op.host_rows)
    for layer, name in enumerate(names):
        keys, values = compat.paged_kv_byte_views(caches[name], HEADS, D)
        want_k, want_v = codes[0, layer, rows], codes[1, layer, rows]
        if deltas is not None:
            moved = rotate_keys(want_k.view(FP8_DTYPE).float() * scales[layer], torch.from_numpy(op.rope_deltas), ROPE)
            want_k = (moved / scales[layer]).clamp(-448, 448).to(FP8_DTYPE).view(torch.uint8)
        assert torch.equal(keys[slots // page, slots % page], want_k), f"layer {layer}"
        assert torch.equal(values[slots // page, slots % page], want_v), f"layer {layer}"
        untouched = torch.ones(PAGED, dtype=torch.bool)
        untouched[slots] = False
        flat = torch.arange(PAGED)[untouched]
        assert not keys[flat // page, flat % page].any() and not values[flat // page, flat % page].any()


def _compiled_kernels() -> int:
    """Kernels Triton has compiled so far for sekv's ops, over every specialization and device."""
    import sys

    from triton.runtime.jit import JITFunction

    kernels = {id(obj): obj for name, module in list(sys.modules.items()) if name.startswith("vllm_sekv.ops")
               for obj in vars(module).values() if isinstance(obj, JITFunction)}
    return sum(len(cache[0]) for kernel in kernels.values() for cache in kernel.device_caches.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("codec", ["exact", "fp8"])
def test_after_the_warm_up_no_restore_compiles_a_kernel(codec):
    """`warm_up` launches what real restores launch: afterwards restores
    layer by layer and batched, moving keys or not, compile nothing more."""
    from vllm_sekv.store import cudart

    layers, bt, heads, dim, device = 3, 32, 2, 128, torch.device("cuda")
    geometry = KVGeometry(num_layers=layers, kv_heads=heads, head_dim=dim, dtype=torch.bfloat16, world_size=1)
    rope = RopeSpec(inv_freq=1.0 / (1e6 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)), rotary_dim=dim)
    pool = HostPool(SLOTS, layers, bt, heads, dim, torch.bfloat16, pin_memory=True, codec=codec)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    caches = {name: torch.zeros(2, PAGED * bt, heads, dim, dtype=torch.bfloat16, device=device) for name in names}
    context = SimpleNamespace(no_compile_layers={name: Layer() for name in names})

    def restores(mode):
        return DeviceRestores(pool, CaptureWriter(pool, device), caches, {name: i for i, name in enumerate(names)},
                              geometry, rope, bt, mode, device, layerwise_copies=cudart.available())

    layerwise = restores("layerwise")
    layerwise.warm_up()
    compiled = _compiled_kernels()
    assert compiled > 0
    host_rows = np.arange(4 * bt, 13 * bt)  # 9 whole slots, one run
    for mode in ("layerwise", "batched") if cudart.available() else ("batched",):
        r = layerwise if mode == "layerwise" else restores(mode)
        for deltas in (None, np.arange(len(host_rows), dtype=np.int64) * 3 + 100):
            op = RestoreOp("r", paged_slots=np.arange(len(host_rows), dtype=np.int64), host_rows=host_rows,
                           rope_deltas=deltas)
            r.start(context, 1, [op])
            if r.layerwise:
                r.finish()
    torch.cuda.synchronize()
    assert _compiled_kernels() == compiled


class PagedLayer:
    """An attention layer's cache-update op over a `[2, pages, page_size, kv_heads, head_dim]` cache (the
    layout `compat.paged_kv_views` knows): rows by slot, -1 skipped; counts its calls."""

    def __init__(self):
        self.impl = self
        self.calls = 0

    def write_kv(self, layer, key, value, kv_cache, slots):
        self.calls += 1
        keep = slots >= 0
        kv_cache[0].view(-1, HEADS, D)[slots[keep]] = key[keep]
        kv_cache[1].view(-1, HEADS, D)[slots[keep]] = value[keep]


PAGE = 5


def _paged_setup(resident_bytes, names=None, device="cpu"):
    """bf16 pool and paged caches (pages of PAGE tokens), some keys -0.0 (a rotation by zero would turn
    some of them into +0.0)."""
    device = torch.device(device)
    geometry = KVGeometry(num_layers=LAYERS, kv_heads=HEADS, head_dim=D, dtype=torch.bfloat16, world_size=1)
    pool = HostPool(SLOTS, LAYERS, BT, HEADS, D, torch.bfloat16, pin_memory=device.type == "cuda")
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(0)))
    pool.data[:, 0, :, :, :, :3] = -0.0
    names = names or {f"model.layers.{i}.self_attn.attn": i for i in range(LAYERS)}
    caches = {name: torch.zeros(2, PAGED // PAGE, PAGE, HEADS, D, dtype=torch.bfloat16, device=device)
              for name in names}
    context = SimpleNamespace(no_compile_layers={name: PagedLayer() for name in names})
    restores = DeviceRestores(pool, CaptureWriter(pool, device), caches, names, geometry, ROPE, BT, "batched", device,
                              layerwise_copies=False, resident_bytes=resident_bytes)
    return pool, caches, context, restores


def _view_steps(deltas):
    """Restore ops of consecutive view steps: mostly the same slots, in other orders, at other paged slots
    and positions; the first of 9 slots, one of them cut short, so a slot's tail rows are skipped."""
    gen = np.random.default_rng(3)
    steps = [[4, 5, 6, 20, 21, 22, 30, 31, 2], [22, 21, 20, 6, 5, 4, 31, 30, 2], [5, 6, 7, 8, 20, 21, 30, 31],
             [5, 6, 7, 8, 20, 21, 30, 31]]
    ops = []
    for slots in steps:
        host_rows = np.concatenate([np.arange(s * BT, s * BT + BT) for s in slots])[:-2]
        paged = gen.permutation(PAGED)[:len(host_rows)].astype(np.int64)
        moved = gen.integers(-500, 5000, len(host_rows)) if deltas else None
        ops.append(RestoreOp("r", paged_slots=paged, host_rows=host_rows, rope_deltas=moved))
    return ops


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs CUDA")])


@pytest.mark.parametrize("deltas", [True, False], ids=["moved", "not-moved"])
@pytest.mark.parametrize("resident", [16, 0], ids=["resident", "no-pool"])
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_batched_restores_through_checked_views_write_what_the_cache_update_op_writes(device, resident, deltas):
    """With the caches' K/V views checked (`cache_views`) a batched restore
    of an exact pool writes every layer with the scatter (resident blocks
    straight from the resident pool), never through the cache-update op, and
    every step's caches equal, bit for bit, those the cache-update op writes
    (keys not moved: as the pool holds them, signed zeros too); the same
    blocks are placed from the resident pool. On CUDA (the Triton scatter,
    the copy stream, a pinned pool) after the warm-up, which compiled every
    kernel the restores launch."""
    block = HostPool(1, LAYERS, BT, HEADS, D, torch.bfloat16).block_bytes
    _, kernel_caches, kernel_context, kernel = _paged_setup(resident * block, device=device)
    pool, op_caches, op_context, by_op = _paged_setup(resident * block, device=device)
    assert kernel._scatter_views is not None
    if device == "cuda":
        kernel.warm_up()
        by_op.warm_up()
        compiled = _compiled_kernels()
    for step, op in enumerate(_view_steps(deltas)):
        kernel.start(kernel_context, step, [op], cache_views=True)
        by_op.start(op_context, step, [op])
        got, want = Counts(), Counts()
        assert kernel.account("r", 0, got) == by_op.account("r", 0, want)
        assert got.data == want.data
        assert got.data["resident_blocks"] == ([0, 9, 6, 8][step] if resident else 0)
        for name in kernel_caches:
            assert torch.equal(kernel_caches[name].view(torch.int16), op_caches[name].view(torch.int16)), name
        _check_rows(pool, {name: cache.cpu() for name, cache in op_caches.items()}, op)
    assert all(layer.calls == 0 for layer in kernel_context.no_compile_layers.values())
    assert all(layer.calls > 0 for layer in op_context.no_compile_layers.values())
    if device == "cuda":
        assert _compiled_kernels() == compiled


def _check_rows(pool, caches, op):
    """Every restored row of `op` at its paged slot, as the pool holds it (keys rotated by its deltas)."""
    rows, slots = torch.from_numpy(op.host_rows), torch.from_numpy(op.paged_slots)
    for layer, cache in enumerate(caches.values()):
        key, value = pool.read_rows(layer, rows)
        if op.rope_deltas is not None:
            key = rotate_keys(key, torch.from_numpy(op.rope_deltas), ROPE)
        got_k, got_v = cache[0].view(-1, HEADS, D)[slots], cache[1].view(-1, HEADS, D)[slots]
        assert torch.equal(got_k.view(torch.int16), key.view(torch.int16)), f"layer {layer}"
        assert torch.equal(got_v.view(torch.int16), value.view(torch.int16)), f"layer {layer}"


def test_caches_the_scatter_cannot_take_keep_the_cache_update_op():
    """Two caches for one layer index (the scatter writes one per layer), an
    fp8 pool, or caches without K/V views: restores go through the
    cache-update op even with `cache_views`."""
    names = {f"model.layers.{i}.self_attn.attn": i for i in range(LAYERS)}
    names["model.layers.0.cross_attn.attn"] = 0
    _, _, context, restores = _paged_setup(0, names)
    assert restores._scatter_views is None
    restores.start(context, 1, [_view_steps(True)[0]], cache_views=True)
    assert all(layer.calls > 0 for layer in context.no_compile_layers.values())
    pool, caches, context, fp8 = _setup("batched", codec="fp8")
    assert fp8._scatter_views is None
    _, caches, context, flat = _setup("batched")  # [2, slots, heads, head_dim]: no paged views
    assert flat._scatter_views is None
