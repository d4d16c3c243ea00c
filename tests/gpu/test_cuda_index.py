"""The views' block index on the GPU (where the worker keeps it on CUDA)
gives the entries and scores of the host index (skipped without CUDA), the
kinds the fused Triton kernel scores (`sub4_pre`, `mean_pre`, `anchor_pre`)
included."""
import numpy as np
import pytest
import torch

from vllm_sekv.ops import RopeSpec
from vllm_sekv.store import HostPool
from vllm_sekv.index.block_index import BlockIndex
from vllm_sekv.store.capture import CaptureWriter, StepCapture
from vllm_sekv.worker_side.index_feed import IndexFeed
from vllm_sekv.workspace.step_plan import ScoreOp, StepPlan

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

L, T, H, HQ, D, SLOTS = 3, 32, 2, 6, 64, 40


@pytest.mark.parametrize("kind", ["sub4_pre", "mean_pre", "anchor_pre", "minmax_post"])
def test_a_gpu_index_scores_like_the_host_index(kind):
    g = torch.Generator().manual_seed(0)
    rope = RopeSpec(inv_freq=1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D), rotary_dim=D)
    pool = HostPool(SLOTS, L, T, H, D, torch.bfloat16, pin_memory=True)
    pool.data.copy_(torch.randn(pool.data.shape, generator=g))
    slots = list(range(3, 37))
    starts = [s * T for s in range(len(slots))]
    surprisal = torch.rand(len(slots), T, generator=g) * 5
    host, gpu = (BlockIndex(SLOTS, L, H, D, rope, kind=kind, device=dev) for dev in ("cpu", "cuda"))
    for index in (host, gpu):
        index.add_many(pool, slots, starts, surprisal, chunk=16)
    torch.testing.assert_close(gpu.entries.cpu(), host.entries, atol=2e-2, rtol=2e-2)
    assert torch.equal(gpu.valid.cpu(), host.valid)
    queries = torch.randn(9, HQ, D, generator=g)
    candidates = torch.tensor([0, *slots[::2], 39])  # two never indexed: they score 0
    assert gpu.fused == (kind in ("sub4_pre", "mean_pre", "anchor_pre"))
    for layer in range(L):
        want = host.score(layer, queries, candidates)
        got = gpu.score(layer, queries.cuda(), candidates)
        assert got.is_cuda
        torch.testing.assert_close(got.cpu(), want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("kind", ["sub4_pre", "mean_pre"])
def test_indexing_and_scoring_on_the_gpu_never_synchronize(kind):
    """Blocks committed during decode are indexed inside a step, and probes
    score inside the forward: neither may make the host wait for the GPU
    (PyTorch raises on any synchronizing call in this mode)."""
    rope = RopeSpec(inv_freq=1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D), rotary_dim=D)
    pool = HostPool(SLOTS, L, T, H, D, torch.bfloat16, pin_memory=True)
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(0)))
    index = BlockIndex(SLOTS, L, H, D, rope, kind=kind, device="cuda")
    index.add_many(pool, [1, 2], [0, T])  # first use: kernels compiled, tables cached
    queries = torch.randn(9, HQ, D, device="cuda")
    candidates = torch.tensor([1, 2, 5, 6], device="cuda")
    index.score(0, queries, candidates)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        index.add_many(pool, [5, 6, 7], [2 * T, 3 * T, 4 * T])
        index.score(1, queries, candidates)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_index_is_fed_on_its_own_stream_and_only_a_scoring_step_waits_for_it():
    """Committed blocks are indexed behind the captures still being copied to
    the host, on the feed's stream: the compute stream goes on (a forward never
    waits for the last step's capture copies); a step that scores waits for
    the feed on the device, and its entries are the host index's of the
    captured bytes."""
    rope = RopeSpec(inv_freq=1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D), rotary_dim=D)
    g = torch.Generator().manual_seed(1)
    pool = HostPool(SLOTS, L, T, H, D, torch.bfloat16, pin_memory=True)
    pool.data.copy_(torch.randn(pool.data.shape, generator=g))
    writer = CaptureWriter(pool, torch.device("cuda"))
    index = BlockIndex(SLOTS, L, H, D, rope, device="cuda")
    feed = IndexFeed(index, pool, writer, T)
    blocks = [(5, 0), (6, T), (7, 2 * T)]
    compute = torch.cuda.current_stream()
    # Allocating device or page-locked memory makes the host wait for the
    # device: the feed's buffers and the capture's first, as a serving worker has them.
    feed.update(StepPlan(step_id=0, index_blocks=blocks))
    capture = StepCapture(torch.arange(T, device="cuda"), np.arange(7 * T, 8 * T), None, L, H, D, torch.bfloat16)
    for layer in range(L):
        capture.take(layer, torch.randn(T, H, D, generator=g).cuda(), torch.randn(T, H, D, generator=g).cuda())
    torch.cuda.synchronize()
    with torch.cuda.stream(writer.stream):
        torch.cuda._sleep(2_000_000_000)  # the capture's copy below starts about a second from now
    assert writer.write(capture, rope)  # slot 7, every row
    feed.update(StepPlan(step_id=1, index_blocks=blocks))
    compute.synchronize()
    assert not feed.stream.query()  # the feed waits for the capture; the compute stream did not
    probe = ScoreOp("r", np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([5, 6, 7]), np.array([0, T, 2 * T]),
                    True)
    feed.update(StepPlan(step_id=2, scores=[probe]))
    assert not compute.query()  # a scoring step waits for the feed on the device
    writer.settle()
    host = BlockIndex(SLOTS, L, H, D, rope)
    host.add_many(pool, [s for s, _ in blocks], [t for _, t in blocks])
    torch.testing.assert_close(index.entries.cpu(), host.entries, atol=2e-2, rtol=2e-2)
    assert torch.equal(index.valid.cpu(), host.valid)


def _compiled_variants() -> int:
    from vllm_sekv.ops.scoring import sub_block_scoring as k

    device = torch.cuda.current_device()
    return sum(len(fn.device_caches[device][0]) for fn in (k._lse_kernel, k._combine_kernel, k._accum_kernel))


def test_after_the_warm_up_no_probe_size_compiles_a_kernel():
    """`warm_up` compiles every variant of the fused scoring kernel: probes of
    any query count against any number of candidates then reuse them (a
    compile inside a step costs about a second)."""
    rope = RopeSpec(inv_freq=1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D), rotary_dim=D)
    slots = 4096
    pool = HostPool(slots, L, T, H, D, torch.bfloat16, pin_memory=True)
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(0)))
    index = BlockIndex(slots, L, H, D, rope, kind="sub4_pre", device="cuda")
    index.add_many(pool, list(range(slots)), [s * T for s in range(slots)])
    index.warm_up(HQ)
    compiled = _compiled_variants()
    assert compiled >= 3
    for m in (1, 2, 3, 7, 16, 31, 32, 33, 100, 257):
        for b in (1, 5, 64, 1000, 4095):
            queries = torch.randn(m, HQ, D, device="cuda")
            index.score(m % L, queries, torch.randint(0, slots, (b,), device="cuda"))
    torch.cuda.synchronize()
    assert _compiled_variants() == compiled
