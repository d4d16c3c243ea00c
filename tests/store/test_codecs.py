import pytest
import torch

from vllm_sekv.store.codecs import Encoded, ExactCodec, LowRankCodec, parse_codec

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def kv(tokens=64, heads=3, dim=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, heads, dim, generator=g).to(dtype),
            torch.randn(tokens, heads, dim, generator=g).to(dtype))


def low_rank_plus_noise(rank, noise, tokens=64, heads=3, dim=64, seed=0):
    """[T, H, D] fp32: per head, a rank-`rank` matrix (unit-scale singular values 8..1) plus noise."""
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(heads, tokens, rank, generator=g)).Q
    v = torch.linalg.qr(torch.randn(heads, dim, rank, generator=g)).Q
    s = torch.linspace(8.0, 1.0, rank)
    x = u * s @ v.transpose(1, 2) + noise * torch.randn(heads, tokens, dim, generator=g)
    return x.transpose(0, 1).contiguous()


def rel_err(x_hat, x):
    return float((x_hat.float() - x.float()).norm() / x.float().norm())


def same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


# ---------------------------------------------------------------- exact


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_exact_round_trip_is_bit_identical(dtype):
    k, v = kv(tokens=19, heads=2, dim=16, dtype=dtype)
    k[0, 0, :5] = torch.tensor([float("inf"), -0.0, 1e-40, -float("inf"), float("nan")]).to(dtype)
    k_in, v_in = k.clone(), v.clone()
    codec = ExactCodec()
    enc = codec.encode(k, v)
    k2, v2 = codec.decode(enc)
    assert same_bits(k2, k_in) and same_bits(v2, v_in)
    assert k2.data_ptr() != k.data_ptr() and v2.data_ptr() != v.data_ptr()   # no alias with the store
    assert codec.encoded_bytes(enc) == 2 * 19 * 2 * 16 * k.element_size()


def test_exact_decode_to_meta_and_cpu():
    k, v = kv(tokens=5, heads=2, dim=8, dtype=torch.bfloat16)
    codec = ExactCodec()
    km, vm = codec.decode(codec.encode(k, v), device="meta")
    assert km.is_meta and vm.is_meta and km.shape == k.shape and km.dtype == torch.bfloat16
    kc, vc = codec.decode(codec.encode(k, v), device="cpu")
    assert same_bits(kc, k) and same_bits(vc, v)


# ---------------------------------------------------------------- lowrank


@pytest.mark.parametrize("center", [False, True], ids=["uncentered", "centered"])
def test_lowrank_error_decreases_with_rank(center):
    x = low_rank_plus_noise(rank=6, noise=0.01)     # noise ~5% of the signal's norm
    y = low_rank_plus_noise(rank=10, noise=0.01, seed=1)
    errs_k, errs_v = [], []
    for r in (1, 2, 4, 6, 8, 12, 16, 24):
        codec = LowRankCodec(r, center=center)
        enc = codec.encode(x, y)
        assert "keys_a" in enc.tensors          # factored, not the exact fallback
        k2, v2 = codec.decode(enc)
        errs_k.append(rel_err(k2, x))
        errs_v.append(rel_err(v2, y))
    assert all(a > b for a, b in zip(errs_k, errs_k[1:])), errs_k
    assert all(a > b for a, b in zip(errs_v, errs_v[1:])), errs_v
    assert errs_k[0] > 0.3 and errs_k[3] < 0.08      # rank 6 recovers the rank-6 signal up to noise


def test_lowrank_error_is_the_truncated_svd_optimum_per_head():
    """Eckart-Young: per head, the rank-r error is the norm of the dropped singular values."""
    x = low_rank_plus_noise(rank=6, noise=0.2, tokens=40, heads=2, dim=32)
    r = 5
    k2, v2 = LowRankCodec(r).decode(LowRankCodec(r).encode(x, x))
    s = torch.linalg.svdvals(x.transpose(0, 1).double())            # [H, min(T, D)]
    best = s[:, r:].square().sum(-1).sqrt()
    got = (k2 - x).transpose(0, 1).double().square().sum((1, 2)).sqrt()
    torch.testing.assert_close(got, best, rtol=1e-4, atol=1e-5)
    assert torch.equal(k2, v2)


def test_each_head_has_its_own_basis():
    """Heads with different rank-2 subspaces are all recovered at rank 2 (no shared basis)."""
    x = low_rank_plus_noise(rank=2, noise=0.0, tokens=48, heads=4, dim=32, seed=3)
    k2, _ = LowRankCodec(2).decode(LowRankCodec(2).encode(x, x))
    assert rel_err(k2, x) < 1e-5
    mixed = torch.cat([x[:, :2], low_rank_plus_noise(2, 0.0, 48, 2, 32, seed=4)], dim=1)
    k3, _ = LowRankCodec(2).decode(LowRankCodec(2).encode(mixed, mixed))
    assert rel_err(k3, mixed) < 1e-5


def test_centering_helps_data_with_a_common_offset():
    offset = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(9))
    x = low_rank_plus_noise(rank=2, noise=0.0) + 0.5 * offset / offset.norm(dim=-1, keepdim=True)
    centered, plain = LowRankCodec(2, center=True), LowRankCodec(2, center=False)
    e_c = rel_err(centered.decode(centered.encode(x, x))[0], x)
    e_p = rel_err(plain.decode(plain.encode(x, x))[0], x)
    assert e_c < 1e-5 < 1e-2 < e_p


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,dim,rank", [(16, 64, 16), (16, 64, 40), (64, 64, 32), (64, 64, 64), (7, 8, 8)],
                         ids=["r=T", "r>T", "break-even", "r=T=D", "tiny"])
def test_lowrank_at_full_rank_falls_back_to_bit_identical_storage(dtype, tokens, dim, rank):
    k, v = kv(tokens=tokens, heads=3, dim=dim, dtype=dtype)
    codec = LowRankCodec(rank)
    assert codec.stores_exact(tokens, dim)
    enc = codec.encode(k, v)
    k2, v2 = codec.decode(enc)
    assert same_bits(k2, k) and same_bits(v2, v)
    assert codec.encoded_bytes(enc) == ExactCodec().encoded_bytes(ExactCodec().encode(k, v))


def test_one_rank_below_break_even_is_factored():
    codec = LowRankCodec(31)                 # 31 * (64 + 64) < 64 * 64
    assert not codec.stores_exact(64, 64)
    enc = codec.encode(*kv())
    assert set(enc.tensors) == {"keys_a", "keys_b", "values_a", "values_b"}
    # 5 x 5 at rank 2: factors take 20 < 25 elements, factors + mean 25: the centered codec stores exact
    assert not LowRankCodec(2).stores_exact(5, 5) and LowRankCodec(2, center=True).stores_exact(5, 5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("center", [False, True], ids=["uncentered", "centered"])
@pytest.mark.parametrize("tokens,heads,dim,rank", [(64, 3, 64, 4), (33, 2, 64, 16), (100, 1, 32, 7)])
def test_encoded_bytes_formula(dtype, center, tokens, heads, dim, rank):
    k, v = kv(tokens, heads, dim, dtype)
    codec = LowRankCodec(rank, center=center)
    enc = codec.encode(k, v)
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = (tokens * rank + rank * dim + (dim if center else 0)) * heads * 2 * itemsize
    assert codec.encoded_bytes(enc) == expected == codec.bytes_for(tokens, heads, dim, dtype)
    assert all(t.dtype == dtype for t in enc.tensors.values())
    assert enc.tensors["keys_a"].shape == (heads, tokens, rank) and enc.tensors["keys_b"].shape == (heads, rank, dim)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lowrank_decode_keeps_dtype_shape_and_inputs(dtype):
    k, v = kv(tokens=50, heads=3, dim=64, dtype=dtype)
    k_in, v_in = k.clone(), v.clone()
    codec = LowRankCodec(8)
    enc = codec.encode(k, v)
    saved = {n: t.clone() for n, t in enc.tensors.items()}
    k2, v2 = codec.decode(enc, device="cpu")
    assert k2.dtype == v2.dtype == dtype and k2.shape == v2.shape == (50, 3, 64) and k2.is_contiguous()
    assert same_bits(k, k_in) and same_bits(v, v_in)
    assert all(same_bits(enc.tensors[n], saved[n]) for n in saved)
    mk, mv = codec.decode(enc, device="meta")
    assert mk.is_meta and mv.is_meta and mk.shape == (50, 3, 64) and mk.dtype == dtype


# ---------------------------------------------------------------- parsing and validation


@pytest.mark.parametrize("text,name", [("exact", "exact"), ("lowrank(16)", "lowrank(16)"),
                                       (" lowrank( 4 ) ", "lowrank(4)"), ("lowrank(1)", "lowrank(1)")])
def test_parse_codec_accepts(text, name):
    codec = parse_codec(text)
    assert codec.name == name
    assert parse_codec(codec.name).name == name
    if name.startswith("lowrank"):
        assert isinstance(codec, LowRankCodec) and codec.rank == int(name[8:-1]) and not codec.center


@pytest.mark.parametrize("text", ["lowrank(0)", "lowrank(-1)", "lowrank(1.5)", "lowrank", "lowrank()", "fp8",
                                  "", "EXACT", "lowrank(4)x", "lowrank(4,centered)"])
def test_parse_codec_rejects_naming_the_text(text):
    with pytest.raises(ValueError, match=repr(text).replace("(", r"\(").replace(")", r"\)")):
        parse_codec(text)


@pytest.mark.parametrize("rank", [0, -3, True, 2.0, "4"])
def test_lowrank_rejects_bad_rank(rank):
    with pytest.raises(ValueError, match="rank"):
        LowRankCodec(rank)


@pytest.mark.parametrize("codec", [ExactCodec(), LowRankCodec(4)], ids=["exact", "lowrank"])
@pytest.mark.parametrize("keys,values,match", [
    (torch.zeros(8, 64), torch.zeros(8, 64), "keys_pre"),
    (torch.zeros(8, 2, 64), torch.zeros(8, 2, 64, 1), "values"),
    (torch.zeros(0, 2, 64), torch.zeros(0, 2, 64), "keys_pre"),
    (torch.zeros(8, 2, 64), torch.zeros(9, 2, 64), "shape"),
    (torch.zeros(8, 2, 64), torch.zeros(8, 2, 64, dtype=torch.float16), "dtype"),
    (torch.zeros(8, 2, 64, dtype=torch.int32), torch.zeros(8, 2, 64, dtype=torch.int32), "floating"),
    ([[0.0]], torch.zeros(8, 2, 64), "keys_pre"),
], ids=["2d", "4d-values", "empty", "shape-mismatch", "dtype-mismatch", "int", "not-tensor"])
def test_encode_rejects_bad_input(codec, keys, values, match):
    with pytest.raises(ValueError, match=match):
        codec.encode(keys, values)


def test_parse_codec_rejects_a_non_string():
    with pytest.raises(ValueError, match="None"):
        parse_codec(None)


def test_lowrank_rejects_bad_center():
    with pytest.raises(ValueError, match="center"):
        LowRankCodec(4, center="yes")


@pytest.mark.parametrize("codec", [ExactCodec(), LowRankCodec(4)], ids=["exact", "lowrank"])
def test_encode_rejects_keys_and_values_on_different_devices(codec):
    with pytest.raises(ValueError, match="device"):
        codec.encode(torch.zeros(8, 2, 64, device="meta"), torch.zeros(8, 2, 64))


def test_lowrank_rejects_non_finite_input():
    k, v = kv(tokens=64)
    v[3, 1, 5] = float("nan")
    with pytest.raises(ValueError, match="values.*non-finite"):
        LowRankCodec(4).encode(k, v)


def test_decode_rejects_another_codecs_encoding():
    k, v = kv(tokens=64)
    enc = LowRankCodec(4).encode(k, v)
    for other in (LowRankCodec(8), ExactCodec()):
        with pytest.raises(ValueError, match="lowrank\\(4\\)"):
            other.decode(enc)
    with pytest.raises(ValueError, match="not by codec"):
        LowRankCodec(4).decode(Encoded("exact", (64, 3, 64), torch.float32, {"keys": k, "values": v}))
