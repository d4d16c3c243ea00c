"""The Triton rotation (`ops.rotate_keys` on CUDA) is bit-identical to the
reference, for every RoPE style, dtype, layout and delta range; the in-place
layer form (`ops.rotate_layer_keys_`) too. CPU runs of the kernel go through
Triton's interpreter (`_interpreter_check.py`)."""
import pytest
import torch

from vllm_sekv import ops
from vllm_sekv.ops import RopeSpec
from vllm_sekv.ops.rope import rotate_reference as reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _rope(rotary_dim, neox):
    inv = 1.0 / (500000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    return RopeSpec(inv, rotary_dim, neox)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rotary_dim,head_dim,neox", [(128, 128, True), (64, 64, False), (48, 96, True)])
def test_rotation_is_bit_identical_to_the_reference(dtype, rotary_dim, head_dim, neox):
    torch.manual_seed(0)
    rope = _rope(rotary_dim, neox)
    keys = torch.randn(1000, 8, head_dim, device="cuda").to(dtype)
    deltas = torch.randint(-600_000, 600_000, (1000,), device="cuda")
    assert torch.equal(ops.rotate_keys(keys, deltas, rope), reference.rotate_keys(keys, deltas, rope))
    strided = keys[::3]  # token stride 3 rows
    assert torch.equal(ops.rotate_keys(strided, deltas[::3], rope), reference.rotate_keys(strided, deltas[::3], rope))


def test_layer_keys_rotate_in_place_like_the_reference():
    torch.manual_seed(1)
    rope = _rope(128, True)
    keys = torch.randn(32, 7, 8, 128, device="cuda").to(torch.bfloat16)  # [layers, tokens, H, D]
    deltas = torch.tensor([0, 1, -1, 65536, 500_000, -3, 12], device="cuda")
    want = torch.stack([reference.rotate_keys(k, deltas, rope) for k in keys])
    ops.rotate_layer_keys_(keys, deltas, rope)
    assert torch.equal(keys, want)


def test_cpu_deltas_and_empty_keys():
    rope = _rope(64, True)
    keys = torch.randn(5, 2, 64, device="cuda")
    deltas = torch.tensor([3, 1, 4, 1, 5])
    assert torch.equal(ops.rotate_keys(keys, deltas, rope), reference.rotate_keys(keys, deltas, rope))
    assert ops.rotate_keys(keys[:0], deltas[:0], rope).shape == (0, 2, 64)


def test_a_rotation_never_waits_for_the_device():
    """Re-RoPE runs inside the forward pass (captures, probes, restores): it
    must enqueue and return while the GPU is still busy. Copying the RoPE's
    frequencies from host memory at every call made the host wait for every
    queued kernel; they are copied to the device once."""
    rope = _rope(128, True)
    keys = torch.randn(16, 8, 128, device="cuda").to(torch.bfloat16)
    deltas = torch.arange(16, device="cuda")
    ops.rotate_keys(keys, deltas, rope)  # the frequencies' one copy to the device
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # the GPU is busy for about half a second
    rotated = ops.rotate_keys(keys, deltas + 1, rope)
    assert not torch.cuda.current_stream().query()  # the host went on
    assert torch.equal(rotated, reference.rotate_keys(keys, deltas + 1, rope))
