"""A step's capture into an fp8 host tier (`workspace_codec` fp8), through the
worker's `ForwardCapture` on the CPU: finite blocks are stored, a block whose
K/V is not finite fails its slot in the report of the step that completes it
(a miss, never committed, never stored wrong), and the other slots of the
step are not affected."""
import numpy as np
import torch

from vllm_sekv.model_identity import KVGeometry
from vllm_sekv.ops import RopeSpec
from vllm_sekv.protocol.stats import SekvStats
from vllm_sekv.store import HostPool
from vllm_sekv.store.capture import CaptureWriter
from vllm_sekv.worker_side.forward_capture import ForwardCapture
from vllm_sekv.workspace.step_plan import StepPlan

LAYERS, BT, HEADS, D = 3, 4, 2, 8
ROPE = RopeSpec(inv_freq=1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)), rotary_dim=D)
GEOMETRY = KVGeometry(num_layers=LAYERS, kv_heads=HEADS, head_dim=D, dtype=torch.bfloat16, world_size=1)


def _step(poison_layer=None):
    pool = HostPool(6, LAYERS, BT, HEADS, D, torch.bfloat16, codec="fp8")
    stats = SekvStats()
    capture = ForwardCapture(pool, CaptureWriter(pool, torch.device("cpu")), GEOMETRY, ROPE, BT, stats, {}, {})
    host_rows = np.concatenate([np.arange(2 * BT, 3 * BT), np.arange(5 * BT, 5 * BT + 2)])  # slot 2 whole, 5 partly
    plan = StepPlan(step_id=1, batch_tokens=len(host_rows), capture_paged_slots=np.arange(len(host_rows)),
                    capture_host_rows=host_rows, capture_rope_deltas=np.zeros(0, dtype=np.int64))
    capture.begin_found(plan, np.ones(len(host_rows), dtype=bool), np.arange(len(host_rows)), torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(LAYERS, 2, len(host_rows), HEADS, D, generator=g).to(torch.bfloat16)
    if poison_layer is not None:
        kv[poison_layer, 0, 1, 1, 3] = float("nan")  # slot 2's K, one element
    for layer in range(LAYERS):
        capture.take(layer, kv[layer, 0], kv[layer, 1])
    capture.flush(plan, forward_begun=True)
    return pool, capture, stats, host_rows, kv


def test_finite_blocks_are_stored_and_no_slot_fails():
    pool, capture, stats, host_rows, kv = _step()
    assert capture.take_failed() == set()
    k, v = pool.read_rows_all_layers(torch.from_numpy(host_rows))  # [n, L, H, D]
    want_k, want_v = kv[:, 0].transpose(0, 1).float(), kv[:, 1].transpose(0, 1).float()
    params = pool.scales[torch.from_numpy(host_rows) // BT]  # [n, 2, L, H, 1 + D]: scale, centre per channel
    for i, (got, want) in enumerate(((k, want_k), (v, want_v))):
        scale, centre = params[:, i, ..., :1], params[:, i, ..., 1:]
        bound = (want - centre).abs() * 2.0 ** -4 + scale * 2.0 ** -10 + 2.0 ** -8 * want.abs() + 1e-6  # + bf16 read
        assert bool(((got.float() - want).abs() <= bound).all())


def test_a_block_with_non_finite_kv_fails_its_slot_only():
    pool, capture, stats, host_rows, kv = _step(poison_layer=1)
    assert capture.take_failed() == {2}
    assert stats.data["capture_failures"] == 1
    k, _ = pool.read_rows_all_layers(torch.from_numpy(host_rows[BT:]))  # slot 5: begun as usual
    assert bool(k.isfinite().all())
