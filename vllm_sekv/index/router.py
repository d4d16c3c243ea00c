"""SeKV zoom router: which segments of a session to expand, and at what rank.

Pure torch, no vLLM. Inputs are the candidate segments of one step (history
segments outside the sink / recent windows that summarize at least one token)
and the new tokens' pre-RoPE queries:

* queries ``[L, M, Hq, D]``: pre-RoPE queries of ``M`` new tokens, every model layer;
* summary keys ``[L, S, H, D]``: surprisal-weighted mean pre-RoPE key per
  segment (``segment_summaries.summarize_segments``);
* segment tokens ``[S]`` (int, >= 1): the tokens a segment adds to a view when
  expanded (its summarized, non-anchor tokens ``n_s``: anchors are always kept);
* distances ``[S]`` (optional): tokens from the segment's end to the first new token.

**Score.** Per router layer ``l`` (all model layers by default) one projection
``W_l [d', D]`` (``d' = proj_dim = 32``), shared by the layer's query and KV heads
(GQA: query head ``h`` reads KV head ``h // (Hq // H)``). Per query head:

    logit[l,h,m,s] = (W_l q[l,m,h]) . (W_l k[l,s,h']) / sqrt(d')
                     + beta[l,h] * log n_s - gamma[l,h] * log(1 + dist_s)
    p[l,h,s]       = mean_m softmax_s(logit)                   (per-head share)
    P[s]           = sum_{l,h} pi[l,h] * p[l,h,s],  pi = softmax(head_logit)

``P`` (a distribution over candidates) ranks segments. ``gamma`` (a learned
per-head recency bias) exists only with ``use_distance``; off by default: the
score is then position-free and means the same at any distance, also beyond
the model's window and the distances calibration saw (on SmolLM2 the recency
term added 1.2-1.6 points of held-out coverage at 256-512 tokens; see
``benchmarks/results/router_calibration/report.md``).

**Gate and rank (per-head thresholds).** Head ``(l,h)`` votes for segment ``s``
at tier ``j`` with ``sigmoid(log(S * p[l,h,s]) - tau[l,h] - delta_j)`` (its share
against ``tau`` times the uniform share ``1/S``); the votes' ``pi``-weighted share
``V_j[s]`` is compared with a learned cut ``c``: ``E_j[s] = sigmoid(kappa * (V_j[s] - c))``
and ``tier[s] = #{j : V_j[s] > c}`` (``delta_0 = 0 < delta_1 < delta_2``, ``c`` and
``kappa`` learned). Tier 0 keeps the segment coarse (its summary); tiers 1..3
expand it at rank ``rank_levels[tier]`` = 8, 16, full (:data:`FULL_RANK`).
Training (:func:`distillation_loss`): KL from the frozen model's true attention
mass to ``P`` and to each ``p[l,h]``, plus a BCE teaching the tiers that a
segment holding more than ``tier_ratios = (2, 4, 8)`` times its uniform share of
the candidates' mass deserves tier 1, 2, 3 (the BCE moves only ``tau``,
``delta``, ``c`` and ``kappa``).

**Selection** fills a token budget greedily in order of ``P[s] / n_s`` (estimated
attention mass per token a segment adds: the greedy rule for a knapsack of
tokens), skipping segments that do not fit.

**Budget.** ``L * (d' * D + 3 * Hq) + 4`` parameters (``4 * Hq`` with
distance) must stay under :data:`PARAM_BUDGET_FRACTION` (0.05%) of the model's:
SmolLM2-135M (30 layers, D 64, Hq 9) 62,254 of 67,257 allowed; Llama-3-8B
(32 layers, D 128, Hq 32) 134,148 of 4.0M. A deeper or narrower model that
does not fit passes fewer ``layers``; the constructor raises ``ValueError``.

**File** (:meth:`ZoomRouter.save` / :meth:`ZoomRouter.load`): ``torch.save`` of a
dict (format name, version, geometry fingerprint, hyper-parameters, float32
tensors), ~250 KB for SmolLM2; loaded with ``weights_only=True``. Every
mismatch or unreadable file raises ``ValueError`` naming the field.

All methods are blocking and run on the caller's thread; ``select`` and
``scores`` never modify their inputs or the router (they run under
``torch.no_grad``); only an optimizer mutates the parameters. Bad arguments
raise ``ValueError`` naming the argument.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FILE_FORMAT", "FILE_VERSION", "FULL_RANK", "PARAM_BUDGET_FRACTION", "RouterGeometry",
           "RouterScores", "Selection", "ZoomRouter", "check_budget", "distillation_loss",
           "load_router", "read_router_file"]

FILE_FORMAT = "vllm-sekv-zoom-router"
FILE_VERSION = 1
PARAM_BUDGET_FRACTION = 5e-4          # router parameters <= 0.05% of the model's
FULL_RANK = -1                        # rank level meaning "expand at full resolution"
DEFAULT_RANK_LEVELS = (0, 8, 16, FULL_RANK)
DEFAULT_TIER_RATIOS = (2.0, 4.0, 8.0)


@dataclass(frozen=True)
class RouterGeometry:
    """The model a router belongs to (its fingerprint in the file)."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    model_params: int           # the model's parameter count (sets the budget)
    name: str = ""              # model name; compared by basename when both sides have one

    def __post_init__(self) -> None:
        for f in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "model_params"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"geometry '{f}' must be an int >= 1, got {v!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"geometry 'num_q_heads' ({self.num_q_heads}) must be a multiple of "
                             f"'num_kv_heads' ({self.num_kv_heads})")
        if not isinstance(self.name, str):
            raise ValueError(f"geometry 'name' must be a string, got {self.name!r}")

    def mismatches(self, other: "RouterGeometry") -> list[str]:
        """Fields in which two geometries differ (``model_params`` is informative only)."""
        out = [f"{f}: file {getattr(self, f)}, model {getattr(other, f)}"
               for f in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim")
               if getattr(self, f) != getattr(other, f)]
        a, b = (os.path.basename(n.rstrip("/")) for n in (self.name, other.name))
        if a and b and a != b:
            out.append(f"name: file {a!r}, model {b!r}")
        return out


def check_budget(num_params: int, model_params: int, fraction: float = PARAM_BUDGET_FRACTION) -> None:
    """ValueError unless ``num_params <= fraction * model_params``."""
    allowed = int(fraction * model_params)
    if num_params > allowed:
        raise ValueError(f"router has {num_params} parameters, over the budget of {allowed} "
                         f"({fraction:.4%} of model_params={model_params}); use fewer 'layers' or a "
                         f"smaller 'proj_dim'")


@dataclass
class RouterScores:
    """per_head [Lr, Hq, S] (p), combined [S] (P), tier_probs [J, S] (E_j; > 1/2 iff V_j > c)."""

    per_head: Tensor
    combined: Tensor
    tier_probs: Tensor

    @property
    def tiers(self) -> Tensor:
        """[S] int64 in 0..J: 0 keeps the segment coarse, j >= 1 expands it at rank level j."""
        return (self.tier_probs > 0.5).sum(0).to(torch.int64)


@dataclass(frozen=True)
class Selection:
    """segments: indices (ascending, int64) of the segments to expand; ranks: their
    rank levels (int64; :data:`FULL_RANK` = full); tokens: the tokens they add;
    scores: [S] combined score ``P`` of every candidate (the fill order is
    ``scores / segment_tokens``, best = highest)."""

    segments: Tensor
    ranks: Tensor
    tokens: int
    scores: Tensor


def _check_tensor(name: str, x: Any, dim: int) -> Tensor:
    if not isinstance(x, Tensor) or x.dim() != dim:
        raise ValueError(f"{name} must be a {dim}-D tensor")
    return x


class ZoomRouter(nn.Module):
    """The trained SeKV zoom router (see the module docstring for the maths)."""

    def __init__(self, geometry: RouterGeometry, proj_dim: int = 32, layers: Optional[Sequence[int]] = None,
                 use_distance: bool = False, tier_ratios: Sequence[float] = DEFAULT_TIER_RATIOS,
                 rank_levels: Sequence[int] = DEFAULT_RANK_LEVELS, seed: int = 0) -> None:
        super().__init__()
        if not isinstance(geometry, RouterGeometry):
            raise ValueError("geometry must be a RouterGeometry")
        if isinstance(proj_dim, bool) or not isinstance(proj_dim, int) or proj_dim < 1:
            raise ValueError(f"proj_dim must be an int >= 1, got {proj_dim!r}")
        layers = list(range(geometry.num_layers)) if layers is None else [int(x) for x in layers]
        if not layers or sorted(set(layers)) != layers or layers[0] < 0 or layers[-1] >= geometry.num_layers:
            raise ValueError(f"layers must be strictly increasing indices in 0..{geometry.num_layers - 1}")
        ratios = [float(r) for r in tier_ratios]
        if not ratios or any(not r > 0 for r in ratios) or sorted(ratios) != ratios or len(set(ratios)) < len(ratios):
            raise ValueError(f"tier_ratios must be strictly increasing and > 0, got {tier_ratios!r}")
        if len(rank_levels) != len(ratios) + 1 or int(rank_levels[0]) != 0:
            raise ValueError("rank_levels must have one entry per tier plus the coarse level 0 first")
        self.geometry, self.proj_dim, self.layers = geometry, proj_dim, layers
        self.use_distance, self.tier_ratios = bool(use_distance), ratios
        self.rank_levels = [int(r) for r in rank_levels]
        self.meta: dict = {}        # what the file's writer recorded (training figures)
        lr, hq, d = len(layers), geometry.num_q_heads, geometry.head_dim
        g = torch.Generator().manual_seed(int(seed))
        w = torch.linalg.qr(torch.randn(lr, max(proj_dim, d), max(proj_dim, d), generator=g))[0]
        # scale so that (Wq).(Wk)/sqrt(d') ~ q.k/sqrt(D) on average at initialization
        scale = (math.sqrt(proj_dim / d) * d / min(proj_dim, d)) ** 0.5
        self.proj = nn.Parameter(w[:, :proj_dim, :d].contiguous() * scale)       # [Lr, d', D]
        self.head_logit = nn.Parameter(torch.zeros(lr, hq))                        # pi = softmax
        self.length_coef = nn.Parameter(torch.ones(lr, hq))                        # beta
        if self.use_distance:
            self.distance_coef = nn.Parameter(torch.zeros(lr, hq))                 # gamma
        self.threshold = nn.Parameter(torch.full((lr, hq), math.log(ratios[0])))   # tau
        self.tier_gaps = nn.Parameter(torch.tensor([math.log(math.expm1(math.log(b / a)))
                                                    for a, b in zip(ratios, ratios[1:])]))
        self.vote_cut = nn.Parameter(torch.zeros(()))                             # c = sigmoid(.)
        self.vote_log_scale = nn.Parameter(torch.tensor(math.log(10.0)))          # kappa = exp(.)
        check_budget(self.num_parameters(), geometry.model_params)

    # ------------------------------------------------------------ introspection

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def hparams(self) -> dict:
        return {"proj_dim": self.proj_dim, "layers": list(self.layers), "use_distance": self.use_distance,
                "tier_ratios": list(self.tier_ratios), "rank_levels": list(self.rank_levels)}

    def tier_offsets(self) -> Tensor:
        """[J] delta_j: 0, then cumulative softplus gaps (strictly increasing)."""
        return torch.cat([self.threshold.new_zeros(1), torch.cumsum(F.softplus(self.tier_gaps), 0)])

    # ------------------------------------------------------------ scoring

    def _check_inputs(self, queries, summary_keys, segment_tokens, distances) -> None:
        g = self.geometry
        _check_tensor("queries", queries, 4)
        _check_tensor("summary_keys", summary_keys, 4)
        _check_tensor("segment_tokens", segment_tokens, 1)
        if queries.shape[0] != g.num_layers or queries.shape[2:] != (g.num_q_heads, g.head_dim):
            raise ValueError(f"queries must be [{g.num_layers}, M, {g.num_q_heads}, {g.head_dim}], "
                             f"got {tuple(queries.shape)}")
        s = summary_keys.shape[1]
        if summary_keys.shape != (g.num_layers, s, g.num_kv_heads, g.head_dim):
            raise ValueError(f"summary_keys must be [{g.num_layers}, S, {g.num_kv_heads}, {g.head_dim}], "
                             f"got {tuple(summary_keys.shape)}")
        if segment_tokens.shape != (s,) or (s and int(segment_tokens.min()) < 1):
            raise ValueError(f"segment_tokens must be [{s}] with every entry >= 1")
        if distances is not None and (_check_tensor("distances", distances, 1).shape != (s,)
                                      or (s and float(distances.min()) < 0)):
            raise ValueError(f"distances must be [{s}] and >= 0")

    def forward(self, queries: Tensor, summary_keys: Tensor, segment_tokens: Tensor,
                distances: Optional[Tensor] = None) -> RouterScores:
        """Differentiable scores of ``S >= 1`` candidate segments (shapes: module docstring)."""
        self._check_inputs(queries, summary_keys, segment_tokens, distances)
        if summary_keys.shape[1] == 0:
            raise ValueError("summary_keys must hold at least one segment")
        dev = self.proj.device
        idx = torch.tensor(self.layers, device=queries.device)
        q = queries.index_select(0, idx).to(dev, torch.float32)
        k = summary_keys.index_select(0, idx.to(summary_keys.device)).to(dev, torch.float32)
        lr, m, hq, _ = q.shape
        s, h = k.shape[1], k.shape[2]
        qp = torch.einsum("lmhd,led->lmhe", q, self.proj).reshape(lr, m, h, hq // h, self.proj_dim)
        kp = torch.einsum("lshd,led->lshe", k, self.proj)
        logits = torch.einsum("lmgre,lsge->lgrms", qp, kp).reshape(lr, hq, m, s) / math.sqrt(self.proj_dim)
        bias = self.length_coef[..., None] * torch.log(segment_tokens.to(dev, torch.float32))
        if self.use_distance and distances is not None:
            bias = bias - self.distance_coef[..., None] * torch.log1p(distances.to(dev, torch.float32))
        per_head = torch.softmax(logits + bias[:, :, None, :], dim=-1).mean(2)    # [Lr, Hq, S]
        pi = torch.softmax(self.head_logit.flatten(), 0).reshape(lr, hq, 1)
        combined = (pi * per_head).sum((0, 1))
        return RouterScores(per_head, combined, self._tier_probs(per_head.detach(), pi.detach()))

    def _tier_probs(self, per_head: Tensor, pi: Tensor) -> Tensor:
        s = per_head.shape[-1]
        x = torch.log((per_head * s).clamp_min(1e-12))                              # log(S p)
        votes = torch.sigmoid(x[None] - self.threshold[None, ..., None]
                              - self.tier_offsets()[:, None, None, None])          # [J, Lr, Hq, S]
        share = (pi[None] * votes).sum((1, 2))                                      # V: [J, S]
        return torch.sigmoid(self.vote_log_scale.exp() * (share - torch.sigmoid(self.vote_cut)))

    @torch.no_grad()
    def scores(self, queries: Tensor, summary_keys: Tensor, segment_tokens: Tensor,
               distances: Optional[Tensor] = None) -> RouterScores:
        """:meth:`forward` without gradients."""
        return self.forward(queries, summary_keys, segment_tokens, distances)

    @torch.no_grad()
    def select(self, queries: Tensor, summary_keys: Tensor, segment_tokens: Tensor, token_budget: int,
               distances: Optional[Tensor] = None, use_gate: bool = True) -> Selection:
        """Segments to expand within ``token_budget`` tokens (sum of their ``segment_tokens``).

        Candidates in order of ``P[s] / segment_tokens[s]`` (ties: lower index) are
        taken greedily while they fit; one that does not fit is skipped. With
        ``use_gate`` only tier >= 1 segments are eligible (the router may leave
        budget unused); without it the budget is filled by rank and an eligible
        tier-0 segment is expanded at the lowest expand rank. Deterministic.
        """
        if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget < 0:
            raise ValueError(f"token_budget must be an int >= 0, got {token_budget!r}")
        self._check_inputs(queries, summary_keys, segment_tokens, distances)
        if summary_keys.shape[1] == 0:
            empty = torch.zeros(0, dtype=torch.int64)
            return Selection(empty, empty.clone(), 0, torch.zeros(0))
        sc = self.forward(queries, summary_keys, segment_tokens, distances)
        combined, tiers = sc.combined.float().cpu(), sc.tiers.cpu()
        density = combined / segment_tokens.to("cpu", torch.float32)
        order = torch.argsort(density, descending=True, stable=True).tolist()
        cost = segment_tokens.to("cpu", torch.int64).tolist()
        chosen, used = [], 0
        for i in order:
            if use_gate and int(tiers[i]) == 0:
                continue
            if used + cost[i] <= token_budget:
                chosen.append(i)
                used += cost[i]
        chosen.sort()
        levels = torch.tensor(self.rank_levels, dtype=torch.int64)
        ranks = levels[tiers[chosen].clamp_min(1)] if chosen else torch.zeros(0, dtype=torch.int64)
        return Selection(torch.tensor(chosen, dtype=torch.int64), ranks, used, combined)

    # ------------------------------------------------------------ file

    def save(self, path: str, meta: Optional[dict] = None) -> int:
        """Write the router to ``path`` (atomically: a temporary file renamed); return its bytes."""
        blob = {"format": FILE_FORMAT, "version": FILE_VERSION, "geometry": asdict(self.geometry),
                "hparams": self.hparams(), "meta": dict(meta or {}),
                "state": {k: v.detach().to("cpu", torch.float32).clone() for k, v in self.state_dict().items()}}
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save(blob, tmp)
        os.replace(tmp, path)
        return os.path.getsize(path)

    @classmethod
    def load(cls, path: str, expected_geometry: Optional[RouterGeometry] = None) -> "ZoomRouter":
        """Read a router file; ValueError naming what is wrong (unreadable, format,
        version, geometry field, hyper-parameter, tensor) or what differs from
        ``expected_geometry``."""
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise ValueError(f"router file {path!r} does not exist") from None
        except Exception as e:  # torch raises many types for a damaged file
            raise ValueError(f"router file {path!r} cannot be read ({type(e).__name__}: {e})") from None
        if not isinstance(blob, dict) or blob.get("format") != FILE_FORMAT:
            raise ValueError(f"router file {path!r}: 'format' is not {FILE_FORMAT!r}")
        if blob.get("version") != FILE_VERSION:
            raise ValueError(f"router file {path!r}: 'version' {blob.get('version')!r} is not supported "
                             f"(this build reads version {FILE_VERSION})")
        geo, hp, state = blob.get("geometry"), blob.get("hparams"), blob.get("state")
        names = {f.name for f in fields(RouterGeometry)}
        if not isinstance(geo, dict) or set(geo) != names:
            raise ValueError(f"router file {path!r}: 'geometry' must have the fields {sorted(names)}")
        if not isinstance(hp, dict) or not isinstance(state, dict):
            raise ValueError(f"router file {path!r}: 'hparams' and 'state' must be dicts")
        try:
            router = cls(RouterGeometry(**geo), **hp)
        except (TypeError, ValueError) as e:
            raise ValueError(f"router file {path!r}: bad 'geometry' or 'hparams': {e}") from None
        own = router.state_dict()
        if set(state) != set(own):
            raise ValueError(f"router file {path!r}: 'state' tensors {sorted(state)} != {sorted(own)}")
        for k, v in state.items():
            if not isinstance(v, Tensor) or v.shape != own[k].shape or not torch.isfinite(v).all():
                raise ValueError(f"router file {path!r}: tensor {k!r} has the wrong shape or non-finite values")
        router.load_state_dict(state)
        router.meta = blob.get("meta", {})
        if expected_geometry is not None:
            diff = router.geometry.mismatches(expected_geometry)
            if diff:
                raise ValueError(f"router file {path!r} was trained for another model: " + "; ".join(diff))
        return router.eval()


def distillation_loss(scores: RouterScores, target_mass: Tensor, tier_ratios: Sequence[float],
                      head_weight: float = 0.5) -> tuple[Tensor, dict]:
    """Loss of one sample against the frozen model's attention.

    target_mass: [Lr, Hq, S] true attention mass of the new tokens on each
    candidate segment (summed over tokens; the router's layers only). Returns
    ``(loss, parts)``: ``kl_pooled`` (KL(pooled truth || P)), ``kl_head`` (mean over
    heads of KL(head's truth || p)), ``gate`` (BCE of each tier j's vote share
    against "the segment holds > tier_ratios[j] x its uniform share of the pooled
    mass"). loss = kl_pooled + head_weight * kl_head + gate.
    """
    _check_tensor("target_mass", target_mass, 3)
    if target_mass.shape != scores.per_head.shape:
        raise ValueError(f"target_mass must be {tuple(scores.per_head.shape)}, got {tuple(target_mass.shape)}")
    t = target_mass.to(scores.combined.device, torch.float32).clamp_min(0)
    s = t.shape[-1]
    pooled = t.sum((0, 1))
    pooled = pooled / pooled.sum().clamp_min(1e-12)
    per_head = t / t.sum(-1, keepdim=True).clamp_min(1e-12)
    kl_pooled = (pooled * (torch.log(pooled.clamp_min(1e-12)) - torch.log(scores.combined.clamp_min(1e-12)))).sum()
    kl_head = (per_head * (torch.log(per_head.clamp_min(1e-12))
                           - torch.log(scores.per_head.clamp_min(1e-12)))).sum(-1).mean()
    ratios = torch.tensor(list(tier_ratios), device=t.device)
    labels = (pooled[None] * s > ratios[:, None]).float()                          # [J, S]
    gate = F.binary_cross_entropy(scores.tier_probs.clamp(1e-6, 1 - 1e-6), labels)
    loss = kl_pooled + head_weight * kl_head + gate
    return loss, {"kl_pooled": kl_pooled.item(), "kl_head": kl_head.item(), "gate": gate.item()}


def read_router_file(path: str) -> ZoomRouter:
    """Load and validate a router file on its own (no model yet): ValueError naming
    'router_path' when it is missing or invalid. Used by the config at start-up."""
    if not path or not os.path.isfile(path):
        raise ValueError(f"sekv config 'router_path': {path!r} is not a file")
    try:
        return ZoomRouter.load(path)
    except ValueError as e:
        raise ValueError(f"sekv config 'router_path': {e}") from None


def load_router(config: Any, geometry: RouterGeometry) -> Optional[ZoomRouter]:
    """The router named by ``config.router_path`` checked against the served model's
    ``geometry``, or None when the key is "" (training-free selection). Call at
    start-up: ValueError naming 'router_path' on any problem."""
    path = getattr(config, "router_path", "")
    if not path:
        return None
    if not os.path.isfile(path):
        raise ValueError(f"sekv config 'router_path': {path!r} is not a file")
    try:
        return ZoomRouter.load(path, geometry)
    except ValueError as e:
        raise ValueError(f"sekv config 'router_path': {e}") from None
