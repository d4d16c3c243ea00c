"""Layerwise restore: every layer is written exactly once, with exactly the
pool's bytes of the restored slots, whatever order the forward asks for the
layers in and however deep the buffer ring; on CPU (CI) and, with CUDA, with
the pitched copies on a copy stream."""
import random

import numpy as np
import pytest
import torch

from vllm_sekv.store import cudart
from vllm_sekv.store.layerwise import LayerwiseRestore

LAYERS, BT, HEADS, DIM = 6, 4, 2, 8
HOST_SLOTS = np.array([3, 4, 5, 17, 0, 9, 10, 11, 12, 22, 1])  # runs and jumps


def _pool(device: str, dtype=torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(24, 2, LAYERS, BT, HEADS, DIM, generator=gen).to(dtype)
    return pool.pin_memory() if device == "cuda" else pool


def _run(pool, device, order, depth, stream=None, write_after_start=False):
    written: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def write(layer, key, value):
        assert layer not in written, f"layer {layer} written twice"
        assert key.is_contiguous() and key.shape == (len(HOST_SLOTS) * BT, HEADS, DIM)
        written[layer] = (key.clone(), value.clone())  # clone on the compute stream, in order

    job = LayerwiseRestore(pool, HOST_SLOTS, None if write_after_start else write, device, depth=depth,
                           copy_stream=stream)
    job.start()
    if write_after_start:  # a head start: copies enqueued before the step's destinations are known
        job.write = write
    for layer in order:
        job.load(layer)
    job.finish()
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = job.transfer_events()
        assert start.elapsed_time(end) > 0
    else:
        assert job.transfer_events() is None
    return written


def _check(pool, written):
    assert sorted(written) == list(range(LAYERS))
    slots = torch.from_numpy(HOST_SLOTS)
    for layer, (key, value) in written.items():
        want_k = pool[slots, 0, layer].reshape(-1, HEADS, DIM)
        want_v = pool[slots, 1, layer].reshape(-1, HEADS, DIM)
        assert torch.equal(key.cpu(), want_k) and torch.equal(value.cpu(), want_v), f"layer {layer}"


ORDERS = {
    "forward": list(range(LAYERS)),
    "reversed": list(range(LAYERS))[::-1],
    "shuffled": random.Random(1).sample(range(LAYERS), LAYERS),
    "none (finish writes all)": [],
    "repeated": [0, 0, 1, 3, 3, 2],
}


@pytest.mark.parametrize("depth", [1, 2, 4, 8])
@pytest.mark.parametrize("order", list(ORDERS), ids=list(ORDERS))
def test_cpu_every_layer_written_once_with_the_pools_bytes(order, depth):
    pool = _pool("cpu")
    _check(pool, _run(pool, "cpu", ORDERS[order], depth))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or not cudart.available(), reason="needs CUDA and libcudart"))])
def test_the_writer_may_come_after_the_first_copies(device):
    pool = _pool(device)
    stream = torch.cuda.Stream() if device == "cuda" else None
    _check(pool, _run(pool, device, ORDERS["shuffled"], 2, stream, write_after_start=True))


def test_a_layer_loaded_before_the_writer_is_given_raises():
    job = LayerwiseRestore(_pool("cpu"), HOST_SLOTS, None, "cpu")
    job.start()
    with pytest.raises(RuntimeError, match="before it was given its `write`"):
        job.load(0)


def test_rejects_bad_arguments():
    pool = _pool("cpu")
    noop = lambda *a: None  # noqa: E731
    with pytest.raises(ValueError, match="host_slots"):
        LayerwiseRestore(pool, np.array([], dtype=np.int64), noop, "cpu")
    with pytest.raises(ValueError, match="depth"):
        LayerwiseRestore(pool, HOST_SLOTS, noop, "cpu", depth=0)
    with pytest.raises(ValueError, match="pool"):
        LayerwiseRestore(pool[:, 0], HOST_SLOTS, noop, "cpu")
    job = LayerwiseRestore(pool, HOST_SLOTS, noop, "cpu")
    job.start()
    with pytest.raises(ValueError, match="layer"):
        job.load(LAYERS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("order", ["forward", "shuffled"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_pitched_copies_equal_the_pool(order, depth, dtype):
    assert cudart.available()
    pool = _pool("cuda", dtype)
    _check(pool, _run(pool, "cuda", ORDERS[order], depth, torch.cuda.Stream()))
