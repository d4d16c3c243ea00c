"""Phase 2 of the lowrank study: encode/decode every history segment, measure errors.

`analyze_text` works on one captured text (see `lowrank_study.capture_text`) and
returns raw per-(segment, layer, head) and per-layer numbers; `summarize` pools
texts into the reported statistics. Pure torch; blocking; inputs are not modified.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from vllm_sekv.ops import RopeSpec, rotate_keys
from vllm_sekv.store.codecs import Codec, ExactCodec, LowRankCodec

ROUNDING = "rounding fp32 -> dtype (reference)"
SEG_MEAN = "segment mean, r=0 (study only)"


def segment_spans(kind: str, surprisal: torch.Tensor, alpha: float | None) -> list[tuple[int, int]]:
    """History segments as half-open token spans tiling [0, len(surprisal)).

    kind: "fixed<N>" (N-token segments, the last one shorter) or "surprisal"
    (`vllm_sekv.workspace.segments.segment(surprisal, alpha)`, its default
    `max_segment_tokens`; alpha None = its `DEFAULT_ALPHA`)."""
    hist = int(surprisal.shape[0])
    if kind.startswith("fixed") and kind[5:].isdigit() and int(kind[5:]) > 0:
        n = int(kind[5:])
        return [(s, min(s + n, hist)) for s in range(0, hist, n)]
    if kind != "surprisal":
        raise ValueError(f"segments {kind!r} is not 'fixed<N>' or 'surprisal'")
    try:
        from vllm_sekv.workspace import segments as sg
    except ImportError as e:
        raise SystemExit(f"--segments surprisal needs vllm_sekv/workspace/segments.py ({e}); use fixed64") from e
    segs = sg.segment(surprisal, sg.DEFAULT_ALPHA if alpha is None else alpha)
    return list(zip(segs.starts.tolist(), segs.ends.tolist()))


def codecs_for(ranks: list[int]) -> list[Codec]:
    """exact, then lowrank(r) (the default: uncentered) and lowrank(r,centered) for every rank."""
    return [ExactCodec()] + [LowRankCodec(r, center=c) for r in ranks for c in (False, True)]


def rel_err_per_head(x_hat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Relative Frobenius error per head of [T, H, D] tensors -> [H] (fp32)."""
    x, d = x.float(), x_hat.float() - x.float()
    return d.square().sum((0, 2)).sqrt() / x.square().sum((0, 2)).sqrt().clamp_min(1e-30)


def attention(q_post: torch.Tensor, k_post: torch.Tensor, v: torch.Tensor, hist: int) -> torch.Tensor:
    """Causal GQA attention of queries [N, Hq, D] at positions hist.. over K/V [hist+N, H, D]
    (fp32) -> output [N, Hq, D]."""
    n, hq, d = q_post.shape
    rep = hq // k_post.shape[1]
    k, vv = k_post.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    logits = torch.einsum("nhd,thd->hnt", q_post, k) / math.sqrt(d)
    mask = torch.arange(k.shape[0])[None, :] > torch.arange(hist, hist + n)[:, None]
    a = torch.softmax(logits.masked_fill(mask[None], float("-inf")), -1)
    return torch.einsum("hnt,thd->nhd", a, vv)


def rel(x_hat: torch.Tensor, x: torch.Tensor) -> float:
    return float((x_hat - x).norm() / x.norm())


@dataclass
class Text:
    """One captured text prepared for analysis (all tensors indexed [layer, ...])."""

    k32: torch.Tensor          # pre-RoPE keys, fp32 [L, T, H, D]
    v32: torch.Tensor          # values, fp32 [L, T, H, D]
    kd: torch.Tensor           # keys in the storage dtype (what exact stores)
    vd: torch.Tensor
    q_post: list[torch.Tensor]     # per layer: the new tokens' queries at their positions [N, Hq, D]
    k_post: list[torch.Tensor]     # per layer: rot(kd) [T, H, D] fp32
    ref: list[torch.Tensor]        # per layer: attention output with exact K/V [N, Hq, D]
    spans: list[tuple[int, int]]   # history segments
    hist: int
    rot: Callable[[torch.Tensor], torch.Tensor]   # pre-RoPE [T, H, D] -> post-RoPE fp32

    @property
    def num_layers(self) -> int:
        return self.k32.shape[0]


def prepare(text: dict, seg: str, alpha: float, dtype: torch.dtype, new_tokens: int) -> Text:
    k32, v32, q_pre = text["k_pre"], text["values"], text["q_pre"]
    num_layers, total, _, head_dim = k32.shape
    hist = total - new_tokens
    rope, pos = RopeSpec(text["inv_freq"], head_dim, True), torch.arange(total)
    rot = lambda k: rotate_keys(k.float(), pos, rope)  # noqa: E731
    kd, vd = k32.to(dtype), v32.to(dtype)
    q_post = [rotate_keys(q_pre[l], pos[hist:], rope) for l in range(num_layers)]
    k_post = [rot(kd[l]) for l in range(num_layers)]
    ref = [attention(q_post[l], k_post[l], vd[l], hist) for l in range(num_layers)]
    spans = segment_spans(seg, text["surprisal"][:hist], alpha)
    return Text(k32, v32, kd, vd, q_post, k_post, ref, spans, hist, rot)


def attn_errors(t: Text, k_hat: torch.Tensor, v_hat: torch.Tensor) -> dict[str, list[float]]:
    """Per-layer attention output errors with the history's K/V replaced by k_hat / v_hat:
    every segment (`attn_all`); the first (sink) segment kept exact (`attn`, and with only
    K or only V reconstructed)."""
    out = {"attn_all": [], "attn": [], "attn_k_only": [], "attn_v_only": []}
    first, hist = t.spans[0][1], t.hist
    for l in range(t.num_layers):
        kd, vd, q = t.kd[l], t.vd[l], t.q_post[l]
        k_all = t.rot(torch.cat([k_hat[l, :hist], kd[hist:]]))
        v_all = torch.cat([v_hat[l, :hist], vd[hist:]])
        k_sink = t.rot(torch.cat([kd[:first], k_hat[l, first:hist], kd[hist:]]))
        v_sink = torch.cat([vd[:first], v_hat[l, first:hist], vd[hist:]])
        out["attn_all"].append(rel(attention(q, k_all, v_all, hist), t.ref[l]))
        out["attn"].append(rel(attention(q, k_sink, v_sink, hist), t.ref[l]))
        out["attn_k_only"].append(rel(attention(q, k_sink, vd, hist), t.ref[l]))
        out["attn_v_only"].append(rel(attention(q, t.k_post[l], v_sink, hist), t.ref[l]))
    return out


def codec_row(t: Text, codec: Codec) -> dict:
    """Encode + decode every (layer, segment) with `codec`; bytes, K/V errors, attention errors."""
    exact = ExactCodec()
    k_hat, v_hat = t.kd.clone(), t.vd.clone()
    ke, ve = [], []
    moved = raw = moved_first_exact = stored_exact = 0
    for l in range(t.num_layers):
        for s, e in t.spans:
            k, v = t.kd[l, s:e], t.vd[l, s:e]
            enc = codec.encode(k, v)
            kh, vh = codec.decode(enc)
            n, n_raw = codec.encoded_bytes(enc), exact.encoded_bytes(exact.encode(k, v))
            moved, raw, moved_first_exact = moved + n, raw + n_raw, moved_first_exact + (n_raw if s == 0 else n)
            stored_exact += int("keys" in enc.tensors)
            ke.append(rel_err_per_head(kh, k))
            ve.append(rel_err_per_head(vh, v))
            k_hat[l, s:e], v_hat[l, s:e] = kh, vh
    return {"bytes": moved, "bytes_first_exact": moved_first_exact, "exact_bytes": raw,
            "stored_exact": stored_exact, "encodings": t.num_layers * len(t.spans),
            "key_err": torch.cat(ke), "value_err": torch.cat(ve), **attn_errors(t, k_hat, v_hat)}


def segment_mean_row(t: Text) -> dict:
    """Study-only rank 0: every token of a segment replaced by the segment's per-head mean."""
    k_hat, v_hat = t.kd.clone(), t.vd.clone()
    for s, e in t.spans:
        k_hat[:, s:e] = t.kd[:, s:e].float().mean(1, keepdim=True).to(t.kd.dtype)
        v_hat[:, s:e] = t.vd[:, s:e].float().mean(1, keepdim=True).to(t.vd.dtype)
    _, _, heads, head_dim = t.kd.shape
    vec_bytes = 2 * t.num_layers * heads * head_dim * t.kd.element_size()   # one K and one V vector per layer
    first = t.spans[0][1]
    pairs = [(l, s, e) for l in range(t.num_layers) for s, e in t.spans]
    return {"bytes": vec_bytes * len(t.spans), "bytes_first_exact": vec_bytes * (len(t.spans) - 1 + first),
            "exact_bytes": vec_bytes * t.hist, "stored_exact": 0, "encodings": len(pairs),
            "key_err": torch.cat([rel_err_per_head(k_hat[l, s:e], t.kd[l, s:e]) for l, s, e in pairs]),
            "value_err": torch.cat([rel_err_per_head(v_hat[l, s:e], t.vd[l, s:e]) for l, s, e in pairs]),
            **attn_errors(t, k_hat, v_hat)}


def rounding_row(t: Text) -> dict:
    """Reference: what rounding fp32 K/V to the storage dtype costs (errors vs fp32)."""
    h, layers = t.hist, range(t.num_layers)
    attn = [rel(t.ref[l], attention(t.q_post[l], t.rot(t.k32[l]), t.v32[l], h)) for l in layers]
    return {"bytes": None, "key_err": torch.cat([rel_err_per_head(t.kd[l, :h], t.k32[l, :h]) for l in layers]),
            "value_err": torch.cat([rel_err_per_head(t.vd[l, :h], t.v32[l, :h]) for l in layers]),
            "attn": attn, "attn_all": None, "attn_k_only": None, "attn_v_only": None}


@torch.no_grad()
def analyze_text(text: dict, seg: str, alpha: float, ranks: list[int], dtype: torch.dtype,
                 new_tokens: int) -> dict:
    """All rows of one captured text under one segmentation (raw, per segment x layer x head)."""
    t = prepare(text, seg, alpha, dtype, new_tokens)
    rows = {codec.name: codec_row(t, codec) for codec in codecs_for(ranks)}
    rows[ROUNDING] = rounding_row(t)
    rows[SEG_MEAN] = segment_mean_row(t)
    hist_mass, first_mass = _attention_mass(t)
    return {"rows": rows, "segment_tokens": [e - s for s, e in t.spans], "hist_tokens": t.hist,
            "history_attention_mass": hist_mass, "first_segment_attention_mass": first_mass}


def _attention_mass(t: Text) -> tuple[float, float]:
    """Share of the new tokens' attention mass on the history and on its first segment
    (mean over layers, query heads and new tokens)."""
    hist_share, first_share = [], []
    for q, k in zip(t.q_post, t.k_post):
        n, hq, d = q.shape
        kk = k.repeat_interleave(hq // k.shape[1], 1)
        logits = torch.einsum("nhd,thd->hnt", q, kk) / math.sqrt(d)
        mask = torch.arange(kk.shape[0])[None, :] > torch.arange(t.hist, t.hist + n)[:, None]
        a = torch.softmax(logits.masked_fill(mask[None], float("-inf")), -1)
        hist_share.append(float(a[..., :t.hist].sum() / a.sum()))
        first_share.append(float(a[..., :t.spans[0][1]].sum() / a.sum()))
    return sum(hist_share) / len(hist_share), sum(first_share) / len(first_share)


def summarize(per_text: list[dict]) -> dict:
    """Pool texts: per row, bytes ratio, key/value error mean + p90, attention error
    (mean over texts and layers, worst layer, per layer)."""
    out = {}
    for name in per_text[0]["rows"]:
        rs = [t["rows"][name] for t in per_text]
        row = {}
        if rs[0]["bytes"] is not None:
            row["bytes_vs_exact"] = sum(r["bytes"] for r in rs) / sum(r["exact_bytes"] for r in rs)
            row["bytes_vs_exact_first_exact"] = sum(r["bytes_first_exact"] for r in rs) / sum(
                r["exact_bytes"] for r in rs)
            row["stored_exact_share"] = sum(r["stored_exact"] for r in rs) / sum(r["encodings"] for r in rs)
        for key in ("key_err", "value_err"):
            x = torch.cat([r[key] for r in rs])
            row[key] = {"mean": float(x.mean()), "p90": float(x.quantile(0.9))}
        for key in ("attn_all", "attn", "attn_k_only", "attn_v_only"):
            if rs[0][key] is None:
                continue
            per_layer = torch.tensor([r[key] for r in rs]).mean(0)
            row[key] = {"mean": float(per_layer.mean()), "max_layer": float(per_layer.max()),
                        "worst_layer": int(per_layer.argmax()), "per_layer": per_layer.tolist()}
        out[name] = row
    seg = [n for t in per_text for n in t["segment_tokens"]]
    return {"rows": out, "segments": len(seg), "segment_tokens": {
                "mean": sum(seg) / len(seg), "min": min(seg), "max": max(seg)},
            "hist_tokens": per_text[0]["hist_tokens"], "texts": len(per_text),
            **{k: sum(t[k] for t in per_text) / len(per_text)
               for k in ("history_attention_mass", "first_segment_attention_mass")}}
