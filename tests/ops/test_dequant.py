"""fp8 blocks -> model-dtype K/V (`ops.dequantize_rerope`): the reference
against the codec's own dequantize followed by the rotation (CPU), its
argument checks (CPU), and the Triton kernel bit-identical to the reference
(GPU; the CPU check of the kernel runs in Triton's interpreter:
test_interpreter.py)."""
import pytest
import torch

from vllm_sekv import ops
from vllm_sekv.ops import RopeSpec
from vllm_sekv.ops.rope.dequant_reference import dequantize_rerope
from vllm_sekv.ops.rope.rotate_reference import rotate_keys
from vllm_sekv.store.fp8 import dequantize, quantize

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rope(rotary_dim, neox=True):
    inv = 1.0 / 1e6 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    return RopeSpec(inv_freq=inv, rotary_dim=rotary_dim, is_neox_style=neox)


def _blocks(n=3, layers=2, bt=8, heads=2, dim=16, device="cpu", seed=0):
    """fp8 blocks `[n, 2, layers, bt, heads, dim]` with large per-channel
    offsets (as Qwen's key bias gives), and their parameters."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, layers, bt, heads, dim, generator=gen) * 3 + torch.randn(heads, dim, generator=gen) * 50
    q, params, finite = quantize(x.to(device), token_dim=3)
    assert finite.all()
    return q, params


@pytest.mark.parametrize("rotary_dim,neox", [(16, True), (8, False), (12, True)], ids=["neox", "gptj", "partial"])
@pytest.mark.parametrize("rerope", [True, False], ids=["rerope", "in-place"])
def test_reference_is_dequantize_then_rotate(rotary_dim, neox, rerope):
    q, params = _blocks()
    n, _, layers, bt, heads, dim = q.shape
    rope = _rope(rotary_dim, neox)
    deltas = torch.randint(-5000, 200000, (n * bt,)) if rerope else None
    keys, values = dequantize_rerope(q[:, 0], q[:, 1], params, deltas, rope, torch.bfloat16)
    full = dequantize(q, params, token_dim=3)  # float32 [n, 2, layers, bt, heads, dim]
    for layer in range(layers):
        k = full[:, 0, layer].reshape(n * bt, heads, dim)
        if rerope:
            k = rotate_keys(k, deltas, rope)
        assert torch.equal(keys[layer], k.to(torch.bfloat16))
        assert torch.equal(values[layer], full[:, 1, layer].reshape(n * bt, heads, dim).to(torch.bfloat16))
    assert keys.is_contiguous() and values.is_contiguous()


def test_reference_checks_its_arguments():
    q, params = _blocks()
    rope = _rope(16)
    with pytest.raises(ValueError, match="float8"):
        dequantize_rerope(q[:, 0].float(), q[:, 1].float(), params, None, rope, torch.bfloat16)
    with pytest.raises(ValueError, match="params"):
        dequantize_rerope(q[:, 0], q[:, 1], params[:, :, :1], None, rope, torch.bfloat16)
    with pytest.raises(ValueError, match="delta_positions"):
        dequantize_rerope(q[:, 0], q[:, 1], params, torch.zeros(5, dtype=torch.int64), rope, torch.bfloat16)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rerope", [True, False], ids=["rerope", "in-place"])
def test_triton_matches_reference_bit_for_bit(dtype, rerope):
    q, params = _blocks(n=70, layers=3, bt=32, heads=8, dim=128, device="cuda")
    rope = _rope(128)
    deltas = torch.randint(-5000, 500_000, (70 * 32,), device="cuda") if rerope else None
    got = ops.dequantize_rerope(q[:, 0], q[:, 1], params, deltas, rope, dtype)
    want = dequantize_rerope(q[:, 0], q[:, 1], params, deltas, rope, dtype)
    for g, w in zip(got, want):
        assert torch.equal(g, w), (g.float() - w.float()).abs().max()
    # one layer of a layerwise restore's ring buffer `[2, n, bt, heads, dim]`
    ring = q[:, :, 2].transpose(0, 1).contiguous()
    got = ops.dequantize_rerope(ring[0].unsqueeze(1), ring[1].unsqueeze(1), params[:, :, 2:3], deltas, rope, dtype)
    want = dequantize_rerope(q[:, 0, 2:3], q[:, 1, 2:3], params[:, :, 2:3], deltas, rope, dtype)
    for g, w in zip(got, want):
        assert torch.equal(g, w), (g.float() - w.float()).abs().max()
