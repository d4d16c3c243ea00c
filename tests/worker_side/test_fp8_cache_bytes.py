"""A capture over an fp8 paged cache (`--kv-cache-dtype fp8` with
`workspace_codec` fp8), through the worker's `ForwardCapture` on the CPU with
vLLM's own cache-update op writing the caches: the pool keeps the bytes the
cache holds, rows whose keys a capture moves are rounded once from the
attention layer's K/V, a
restore through the op gives back the cache's values, a restore through the
checked byte views gives back its bytes (moved keys rounded to nearest once
more), and a cache whose
layout the byte views do not know (the `amx` kernels') is noticed at the
first capture and captured from the attention layer's K/V instead, rounded to
the layer scales."""
import numpy as np
import pytest
import torch

from testbed.hardware import FP8_CACHE_SKIP_REASON, cpu_attention_holds_fp8
from vllm_sekv import compat
from vllm_sekv.model_identity import KVGeometry
from vllm_sekv.ops import RopeSpec, rotate_keys
from vllm_sekv.protocol.stats import SekvStats
from vllm_sekv.store import HostPool
from vllm_sekv.store.capture import CaptureWriter
from vllm_sekv.store.fp8 import FP8_DTYPE, cache_params
from vllm_sekv.worker_side.forward_capture import ForwardCapture
from vllm_sekv.worker_side.host_restores import HostRestores
from vllm_sekv.workspace.step_plan import StepPlan

LAYERS, BT, HEADS, D, PAGE, PAGES = 3, 16, 2, 64, 32, 6
ROPE = RopeSpec(inv_freq=1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)), rotary_dim=D)
K_SCALES, V_SCALES = [1.0, 0.5, 2.0], [1.0, 1.0, 0.25]

ops = pytest.importorskip("vllm._custom_ops")
pytestmark = [
    pytest.mark.skipif(not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"), reason="needs vLLM's CPU build"),
    pytest.mark.skipif(not cpu_attention_holds_fp8(), reason=FP8_CACHE_SKIP_REASON),
]


def _write(cache, key, value, slots, layer, isa):
    """vLLM's CPU backend's cache update (`CPUAttentionBackendImpl.do_kv_cache_update`)."""
    key_cache, value_cache = cache.view(PAGES, HEADS, 2 * PAGE, D).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, k_scale=K_SCALES[layer],
                                   v_scale=V_SCALES[layer], kv_cache_dtype="fp8")


def _forward(isa, dtype, deltas=None):
    """One forward of 40 tokens whose K/V every layer's cache update writes,
    captured into host rows 16..55 (slots 1 to 3, the last one in part)."""
    geometry = KVGeometry(num_layers=LAYERS, kv_heads=HEADS, head_dim=D, dtype=dtype, world_size=1)
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(PAGES, HEADS, 2 * PAGE, D, dtype=torch.uint8)
              for i in range(LAYERS)}
    layer_of = {name: i for i, name in enumerate(caches)}
    pool = HostPool(5, LAYERS, BT, HEADS, D, dtype, codec="fp8",
                    layer_params=cache_params(K_SCALES, V_SCALES, HEADS, D))
    capture = ForwardCapture(pool, CaptureWriter(pool, torch.device("cpu")), geometry, ROPE, BT, SekvStats(),
                             caches, layer_of)
    n = 40
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(PAGES * PAGE, generator=g)[:n]  # the batch's paged slots, rows in batch order
    host_rows = np.arange(BT, BT + n)
    plan = StepPlan(step_id=1, batch_tokens=n, capture_paged_slots=slots.numpy(), capture_host_rows=host_rows,
                    capture_rope_deltas=np.zeros(0, dtype=np.int64) if deltas is None else deltas)
    kv = (torch.randn(LAYERS, 2, n, HEADS, D, generator=g) * 3).to(dtype)
    for i, name in enumerate(caches):
        _write(caches[name], kv[i, 0], kv[i, 1], slots, i, isa)
        if i == 0:
            capture.begin_found(plan, np.ones(n, dtype=bool), np.arange(n), torch.device("cpu"))
            capture.first_layer(i, kv[i, 0], kv[i, 1])
        capture.take(i, kv[i, 0], kv[i, 1])
    capture.flush(plan, forward_begun=True)
    views = [compat.paged_kv_byte_views(caches[name], HEADS, D) for name in caches]
    stored = [(k[slots // PAGE, slots % PAGE], v[slots // PAGE, slots % PAGE]) for k, v in views]
    return pool, capture, host_rows, slots, kv, stored, geometry


def _pool_bytes(pool, host_rows):
    rows = torch.from_numpy(host_rows)
    return pool.data.view(torch.uint8)[rows // BT, :, :, rows % BT]  # [n, 2, L, H, D]


def test_the_pool_keeps_the_bytes_the_fp8_cache_holds():
    pool, capture, host_rows, _, _, stored, _ = _forward("vec", torch.float32)
    assert capture.bytes_checked and capture.take_failed() == set()
    got = _pool_bytes(pool, host_rows)
    for layer, (key, value) in enumerate(stored):
        assert torch.equal(got[:, 0, layer], key) and torch.equal(got[:, 1, layer], value)
    params = pool.scales[1:4]  # the captured slots: each layer's scale, zero centres
    assert torch.equal(params[:, 0, :, 0, 0], torch.tensor([K_SCALES] * 3))
    assert torch.equal(params[:, 1, :, 0, 0], torch.tensor([V_SCALES] * 3))
    assert not params[..., 1:].any()


def test_a_restore_through_the_cache_update_op_gives_back_the_caches_values():
    """What `HostRestores` does: rows read (dequantized with the layer scale)
    and written through the platform's op; e4m3 values map to themselves (a
    zero's sign aside: vLLM stores -0.0 as 0)."""
    pool, _, host_rows, slots, _, stored, _ = _forward("vec", torch.float32)
    for layer in range(LAYERS):
        key, value = pool.read_rows(layer, torch.from_numpy(host_rows), torch.float32)
        fresh = torch.zeros(PAGES, HEADS, 2 * PAGE, D, dtype=torch.uint8)
        _write(fresh, key, value, slots, layer, "vec")
        k, v = compat.paged_kv_byte_views(fresh, HEADS, D)
        for got, want in ((k[slots // PAGE, slots % PAGE], stored[layer][0]),
                          (v[slots // PAGE, slots % PAGE], stored[layer][1])):
            assert torch.equal(got.view(FP8_DTYPE).float(), want.view(FP8_DTYPE).float())


@pytest.mark.parametrize("moved", [False, True])
def test_a_restore_through_the_checked_byte_views_writes_the_bytes_back(moved):
    pool, capture, host_rows, slots, _, stored, geometry = _forward("vec", torch.float32)
    assert capture.bytes_checked
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(PAGES, HEADS, 2 * PAGE, D, dtype=torch.uint8)
              for i in range(LAYERS)}
    restores = HostRestores(pool, geometry, ROPE, BT, caches, {name: i for i, name in enumerate(caches)}, [])
    target = torch.randperm(PAGES * PAGE, generator=torch.Generator().manual_seed(1))[:len(host_rows)]
    deltas = np.full(len(host_rows), -9, dtype=np.int64) if moved else None
    restores.restore(None, target.numpy(), host_rows, deltas, cache_bytes=True)
    for layer, name in enumerate(caches):
        k, v = compat.paged_kv_byte_views(caches[name], HEADS, D)
        key, want = k[target // PAGE, target % PAGE], stored[layer][0]
        if moved:
            scale = K_SCALES[layer]
            want = rotate_keys(want.view(FP8_DTYPE).float() * scale, torch.from_numpy(deltas), ROPE) / scale
            want = want.clamp(-448, 448).to(FP8_DTYPE).view(torch.uint8)
        assert torch.equal(key, want)
        assert torch.equal(v[target // PAGE, target % PAGE], stored[layer][1])


def test_rows_a_capture_moves_are_rotated_from_the_attention_layers_kv_and_rounded_once():
    """A view step's new tokens, computed at compact positions: rotating the
    cache's bytes would round twice; their K/V come from the attention layer."""
    deltas = np.full(40, 7, dtype=np.int64)
    pool, capture, host_rows, _, kv, _, _ = _forward("vec", torch.float32, deltas)
    assert capture.byte_views is not None and not capture.bytes_checked  # views kept, not used for these rows
    got = _pool_bytes(pool, host_rows)
    for layer in range(LAYERS):
        key = rotate_keys(kv[layer, 0], torch.from_numpy(deltas), ROPE)
        for i, (x, scale) in enumerate(((key, K_SCALES[layer]), (kv[layer, 1], V_SCALES[layer]))):
            want = (x.float() / scale).clamp(-448, 448).to(FP8_DTYPE).view(torch.uint8)
            assert torch.equal(got[:, i, layer], want)


def test_an_unknown_cache_layout_falls_back_to_the_attention_layers_kv():
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("needs vLLM's amx kernels, whose K layout the byte views do not know")
    pool, capture, host_rows, _, kv, _, _ = _forward("amx", torch.bfloat16)
    assert capture.byte_views is None and capture.take_failed() == set()
    got = _pool_bytes(pool, host_rows)
    for layer in range(LAYERS):
        for i, scale in enumerate((K_SCALES[layer], V_SCALES[layer])):
            want = (kv[layer, i].float() / scale).clamp(-448, 448).to(FP8_DTYPE).view(torch.uint8)
            assert torch.equal(got[:, i, layer], want)
