"""SeKV zoom router (vllm_sekv.index.router): file round trip and validation,
parameter budget, learning on a synthetic problem, budgeted deterministic selection,
and the `router_path` config key."""
import os

import pytest
import torch

from vllm_sekv.config import SekvConfig
from vllm_sekv.index.router import (FILE_FORMAT, FILE_VERSION, FULL_RANK, PARAM_BUDGET_FRACTION,
                                        RouterGeometry, ZoomRouter, check_budget, distillation_loss,
                                        load_router, read_router_file)

TINY = RouterGeometry(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, model_params=10_000_000,
                      name="tiny")
SMOLLM2 = RouterGeometry(30, 9, 3, 64, 134_515_008, "SmolLM2-135M-Instruct")


def _inputs(seed, geometry=TINY, segments=12, queries=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(geometry.num_layers, queries, geometry.num_q_heads, geometry.head_dim, generator=g)
    k = torch.randn(geometry.num_layers, segments, geometry.num_kv_heads, geometry.head_dim, generator=g)
    n = torch.randint(1, 30, (segments,), generator=g)
    dist = torch.randint(0, 4000, (segments,), generator=g).float()
    return q, k, n, dist


def _perturbed(seed=1, use_distance=True):
    """A router (with the recency term) whose every parameter differs from its initialization."""
    r = ZoomRouter(TINY, seed=seed, use_distance=use_distance)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in r.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return r


# ---------------------------------------------------------------- file


def test_file_round_trips_parameters_and_selection(tmp_path):
    r = _perturbed()
    path = str(tmp_path / "router.pt")
    size = r.save(path, meta={"note": "test"})
    assert size == os.path.getsize(path) and size < 64 << 10
    back = ZoomRouter.load(path, TINY)
    assert back.hparams() == r.hparams() and back.geometry == TINY and back.meta == {"note": "test"}
    for (name, a), (name_b, b) in zip(r.state_dict().items(), back.state_dict().items()):
        assert name == name_b and torch.equal(a, b)
    q, k, n, dist = _inputs(3)
    for budget in (0, 20, 60, 1000):
        for gate in (True, False):
            s1, s2 = r.select(q, k, n, budget, dist, use_gate=gate), back.select(q, k, n, budget, dist, use_gate=gate)
            assert torch.equal(s1.segments, s2.segments) and torch.equal(s1.ranks, s2.ranks)
            assert torch.equal(s1.scores, s2.scores)


def _blob(router):
    return {"format": FILE_FORMAT, "version": FILE_VERSION, "geometry": router.geometry.__dict__.copy(),
            "hparams": router.hparams(), "meta": {}, "state": dict(router.state_dict())}


@pytest.mark.parametrize("change,match", [
    (lambda b: b.update(version=FILE_VERSION + 1), "version"),
    (lambda b: b.update(format="something-else"), "format"),
    (lambda b: b["geometry"].pop("head_dim"), "geometry"),
    (lambda b: b["hparams"].update(proj_dim=8), "proj"),
    (lambda b: b["state"].pop("threshold"), "state"),
    (lambda b: b["state"].update(threshold=torch.full((2, 4), float("nan"))), "threshold"),
], ids=["version", "format", "geometry-field", "shape", "missing-tensor", "nan"])
def test_load_rejects_a_bad_file_naming_what_is_wrong(tmp_path, change, match):
    blob = _blob(_perturbed())
    change(blob)
    path = tmp_path / "r.pt"
    torch.save(blob, path)
    with pytest.raises(ValueError, match=match):
        ZoomRouter.load(str(path))


def test_load_rejects_a_corrupted_or_missing_file(tmp_path):
    path = tmp_path / "r.pt"
    _perturbed().save(str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cannot be read"):
        ZoomRouter.load(str(path))
    path.write_bytes(b"not a router at all")
    with pytest.raises(ValueError, match="cannot be read"):
        ZoomRouter.load(str(path))
    with pytest.raises(ValueError, match="does not exist"):
        ZoomRouter.load(str(tmp_path / "missing.pt"))


@pytest.mark.parametrize("other,field", [
    (RouterGeometry(3, 4, 2, 16, 10_000_000, "tiny"), "num_layers"),
    (RouterGeometry(2, 8, 2, 16, 10_000_000, "tiny"), "num_q_heads"),
    (RouterGeometry(2, 4, 4, 16, 10_000_000, "tiny"), "num_kv_heads"),
    (RouterGeometry(2, 4, 2, 32, 10_000_000, "tiny"), "head_dim"),
    (RouterGeometry(2, 4, 2, 16, 10_000_000, "/models/other"), "name"),
])
def test_load_rejects_another_models_geometry(tmp_path, other, field):
    path = str(tmp_path / "r.pt")
    _perturbed().save(path)
    with pytest.raises(ValueError, match=field):
        ZoomRouter.load(path, other)
    # the same model under a path, or without a name, is accepted
    ZoomRouter.load(path, RouterGeometry(2, 4, 2, 16, 1, "/srv/models/tiny/"))
    ZoomRouter.load(path, RouterGeometry(2, 4, 2, 16, 1, ""))


# ---------------------------------------------------------------- budget


def test_parameter_count_is_under_the_budget_and_follows_the_rule():
    r = ZoomRouter(SMOLLM2)
    assert r.num_parameters() == 30 * (32 * 64 + 3 * 9) + 4 == 62_254
    assert r.num_parameters() <= PARAM_BUDGET_FRACTION * SMOLLM2.model_params
    with_distance = ZoomRouter(SMOLLM2, use_distance=True).num_parameters()
    assert with_distance == 30 * (32 * 64 + 4 * 9) + 4 <= PARAM_BUDGET_FRACTION * SMOLLM2.model_params
    assert ZoomRouter(SMOLLM2, layers=range(0, 30, 2)).num_parameters() == 15 * (32 * 64 + 3 * 9) + 4
    llama3_8b = RouterGeometry(32, 32, 8, 128, 8_030_261_248, "Meta-Llama-3-8B")
    assert ZoomRouter(llama3_8b).num_parameters() == 32 * (32 * 128 + 3 * 32) + 4


def test_budget_check_raises():
    too_small = RouterGeometry(30, 9, 3, 64, 100_000_000, "small")   # allows 50,000
    with pytest.raises(ValueError, match="budget"):
        ZoomRouter(too_small)
    ZoomRouter(too_small, layers=range(0, 30, 2))                    # 31,129: fits
    with pytest.raises(ValueError, match="budget"):
        check_budget(501, 1_000_000)
    check_budget(500, 1_000_000)


@pytest.mark.parametrize("kw", [{"proj_dim": 0}, {"layers": [0, 0]}, {"layers": [2]}, {"tier_ratios": (4, 2, 8)},
                                {"rank_levels": (8, 16)}])
def test_bad_hyper_parameters_raise(kw):
    with pytest.raises(ValueError):
        ZoomRouter(TINY, **kw)


# ---------------------------------------------------------------- learning


def _synthetic(g, num_segments=10):
    """Queries = u + v; a distractor segment's key 6u, the target's 3v (v random,
    orthogonal to u); the true attention mass sits on the target. Plain dot
    products prefer the distractor; a learned projection can drop u."""
    L, Hq, H, D = TINY.num_layers, TINY.num_q_heads, TINY.num_kv_heads, TINY.head_dim
    u = torch.zeros(D)
    u[0] = 1
    v = torch.randn(D, generator=g)
    v[0] = 0
    v /= v.norm()
    target, distractor = torch.randperm(num_segments, generator=g)[:2].tolist()
    q = (u + v).expand(L, 8, Hq, D) + 0.1 * torch.randn(L, 8, Hq, D, generator=g)
    k = 0.3 * torch.randn(L, num_segments, H, D, generator=g)
    k[:, distractor], k[:, target] = 6 * u, 3 * v
    mass = torch.full((L, Hq, num_segments), 0.01)
    mass[:, :, target] = 1.0
    return q, k, torch.full((num_segments,), 8), mass, target, distractor


def test_training_on_a_synthetic_problem_ranks_the_matching_segment_first():
    g = torch.Generator().manual_seed(0)
    train, test = [_synthetic(g) for _ in range(32)], [_synthetic(g) for _ in range(16)]
    router = ZoomRouter(TINY, seed=0)
    before = [router.select(q, k, n, 8, use_gate=False).segments.tolist() for q, k, n, _, _, _ in test]
    assert before == [[d] for *_, d in test]            # untrained: the distractor wins every time
    opt = torch.optim.Adam(router.parameters(), lr=0.05)
    losses = []
    for step in range(100):
        q, k, n, mass, _, _ = train[step % len(train)]
        loss, _ = distillation_loss(router(q, k, n), mass, router.tier_ratios)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) < 0.2 * sum(losses[:10])
    after = [router.select(q, k, n, 8).segments.tolist() for q, k, n, _, _, _ in test]
    assert after == [[t] for _, _, _, _, t, _ in test]  # trained, gate on: the target, on unseen samples
    sel = router.select(*test[0][:3], 8)
    assert sel.ranks.tolist()[0] in (8, 16, FULL_RANK)


# ---------------------------------------------------------------- selection


@pytest.mark.parametrize("budget", [0, 1, 25, 80, 10_000])
def test_select_respects_the_budget_and_is_deterministic(budget):
    r = _perturbed(seed=2)
    q, k, n, dist = _inputs(5, segments=20)
    for gate in (False, True):
        sel = r.select(q, k, n, budget, dist, use_gate=gate)
        chosen = sel.segments.tolist()
        assert chosen == sorted(set(chosen)) and sel.tokens == int(n[sel.segments].sum()) <= budget
        again = r.select(q.clone(), k.clone(), n.clone(), budget, dist.clone(), use_gate=gate)
        assert torch.equal(again.segments, sel.segments) and torch.equal(again.ranks, sel.ranks)
        sc = r.scores(q, k, n, dist)
        eligible = set(range(20)) if not gate else set(torch.nonzero(sc.tiers > 0).squeeze(1).tolist())
        assert set(chosen) <= eligible
        # greedy and maximal: nothing eligible left out would still fit
        assert all(int(n[i]) > budget - sel.tokens for i in eligible - set(chosen))
        levels = torch.tensor(r.rank_levels)[sc.tiers[sel.segments].clamp_min(1)]
        assert torch.equal(sel.ranks, levels)
    full = r.select(q, k, n, int(n.sum()), dist, use_gate=False)
    assert full.segments.tolist() == list(range(20))


def test_select_fills_the_budget_in_score_order():
    r = _perturbed(seed=4)
    q, k, _, dist = _inputs(6, segments=15)
    n = torch.full((15,), 10)
    sel = r.select(q, k, n, 50, dist, use_gate=False)
    top5 = torch.argsort(sel.scores, descending=True, stable=True)[:5].sort().values
    assert torch.equal(sel.segments, top5)


def test_select_rejects_bad_arguments():
    r = ZoomRouter(TINY)
    q, k, n, dist = _inputs(7)
    with pytest.raises(ValueError, match="token_budget"):
        r.select(q, k, n, -1)
    with pytest.raises(ValueError, match="queries"):
        r.select(q[:1], k, n, 10)
    with pytest.raises(ValueError, match="summary_keys"):
        r.select(q, k[:, :, :1], n, 10)
    with pytest.raises(ValueError, match="segment_tokens"):
        r.select(q, k, torch.zeros_like(n), 10)
    with pytest.raises(ValueError, match="distances"):
        r.select(q, k, n, 10, dist[:3])
    assert r.select(q, k[:, :0], n[:0], 10).segments.numel() == 0


def test_distillation_loss_checks_the_target_shape():
    r = ZoomRouter(TINY)
    q, k, n, dist = _inputs(8)
    with pytest.raises(ValueError, match="target_mass"):
        distillation_loss(r(q, k, n, dist), torch.ones(2, 4, 3), r.tier_ratios)


# ---------------------------------------------------------------- config key


def test_router_path_config_key(tmp_path):
    assert SekvConfig().router_path == "" and load_router(SekvConfig(), TINY) is None
    path = str(tmp_path / "router.pt")
    _perturbed().save(path)
    cfg = SekvConfig.from_sources({"router_path": path, "surprisal": "on"}, environ={})
    assert isinstance(load_router(cfg, TINY), ZoomRouter)
    with pytest.raises(ValueError, match="'router_path'.*surprisal"):
        SekvConfig.from_sources({"router_path": path}, environ={})
    assert isinstance(read_router_file(path), ZoomRouter)
    with pytest.raises(ValueError, match="'router_path'.*num_layers"):
        load_router(cfg, RouterGeometry(3, 4, 2, 16, 1, "tiny"))
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"garbage")
    for value in (str(bad), str(tmp_path / "missing.pt"), str(tmp_path)):
        with pytest.raises(ValueError, match="'router_path'"):
            SekvConfig.from_sources({"router_path": value, "surprisal": "on"}, environ={})
    with pytest.raises(ValueError, match="'router_path'"):
        SekvConfig.from_sources({}, environ={"SEKV_ROUTER_PATH": str(bad)})
