"""Markdown report of the lowrank study (tables and a "what it says" section made
only of measured numbers). Pure formatting; writes one file."""
from __future__ import annotations

import sys
from pathlib import Path

from lowrank_analysis import ROUNDING, SEG_MEAN

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import report_header as H  # noqa: E402


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _all(a: dict | None) -> str:
    return "-" if a is None else f"{_f(a['mean'])} ({_f(a['max_layer'])})"


def _table(seg: dict) -> list[str]:
    out = ["| codec | bytes vs exact | key err mean | key err p90 | value err mean | value err p90 "
           "| attn err, all segments (worst layer) | bytes, first seg. exact | attn err, first seg. exact "
           "| worst layer | K only | V only |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in seg["rows"].items():
        a, aa, ak, av = r["attn"], r.get("attn_all"), r.get("attn_k_only"), r.get("attn_v_only")
        if name == ROUNDING:   # rounds every token, the first segment included
            a, aa = None, a
        out.append(f"| {name} | {_pct(r.get('bytes_vs_exact'))} "
                   f"| {_f(r['key_err']['mean'])} | {_f(r['key_err']['p90'])} "
                   f"| {_f(r['value_err']['mean'])} | {_f(r['value_err']['p90'])} "
                   f"| {_all(aa)} "
                   f"| {_pct(r.get('bytes_vs_exact_first_exact'))} | {_f(a['mean'] if a else None)} "
                   f"| {_f(a['max_layer']) + ' (layer ' + str(a['worst_layer']) + ')' if a else '-'} "
                   f"| {_f(ak['mean'] if ak else None)} | {_f(av['mean'] if av else None)} |")
    return out


def _says(seg_name: str, seg: dict, ranks: list[int], dtype: str) -> list[str]:
    rows = seg["rows"]
    out = [f"**{seg_name}** ({seg['segments']} segments of {seg['segment_tokens']['mean']:.1f} tokens on "
           f"average, {seg['segment_tokens']['min']}-{seg['segment_tokens']['max']}; the new tokens put "
           f"{_pct(seg['history_attention_mass'])} of their attention mass on the history, "
           f"{_pct(seg['first_segment_attention_mass'])} on its first segment):"]
    for r in ranks:
        c = rows[f"lowrank({r})"]
        out.append(f"* lowrank({r}) moves {_pct(c['bytes_vs_exact'])} of exact's bytes "
                   f"({_pct(c['stored_exact_share'])} of segments stored exact); key error "
                   f"{_f(c['key_err']['mean'])} mean / {_f(c['key_err']['p90'])} p90, value error "
                   f"{_f(c['value_err']['mean'])} / {_f(c['value_err']['p90'])}; attention output error "
                   f"{_f(c['attn_all']['mean'])} with every segment reconstructed, {_f(c['attn']['mean'])} "
                   f"with the first segment exact ({_pct(c['bytes_vs_exact_first_exact'])} of the bytes; worst "
                   f"layer {_f(c['attn']['max_layer'])}; K alone {_f(c['attn_k_only']['mean'])}, V alone "
                   f"{_f(c['attn_v_only']['mean'])}).")
    cen = [(r, rows[f"lowrank({r})"], rows[f"lowrank({r},centered)"]) for r in ranks]
    cen = [(r, u, c) for r, u, c in cen if c["stored_exact_share"] < 1]
    if cen:
        pairs = lambda key, sub: ", ".join(  # noqa: E731
            f"{_f(u[key][sub])} -> {_f(c[key][sub])}" for _, u, c in cen)
        out.append("* Centering (per-head mean stored, +" + ", +".join(
            f"{100 * (c['bytes_vs_exact'] - u['bytes_vs_exact']):.1f}" for _, u, c in cen)
            + " points of bytes at r = " + ", ".join(str(r) for r, _, _ in cen) + "), uncentered -> centered: "
            f"mean key error {pairs('key_err', 'mean')}; mean value error {pairs('value_err', 'mean')}; "
            f"attention output error, first segment exact {pairs('attn', 'mean')}; every segment "
            f"reconstructed {pairs('attn_all', 'mean')}.")
    m, rd = rows[SEG_MEAN], rows[ROUNDING]
    out.append(f"* References: every token replaced by its segment mean ({_pct(m['bytes_vs_exact'])} of the bytes) "
               f"gives attention output error {_f(m['attn_all']['mean'])} ({_f(m['attn']['mean'])} with the first "
               f"segment exact); rounding fp32 K/V to {dtype} (what exact stores) gives {_f(rd['attn']['mean'])} "
               "against the fp32 model.")
    return out


def _by_bytes(res: dict) -> list[str]:
    """Every segmentation's default codecs (and segment mean), first segment exact, sorted by bytes."""
    items = []
    for seg_name, seg in res["segmentations"].items():
        for name, r in seg["rows"].items():
            if name == SEG_MEAN or (name.startswith("lowrank(") and "," not in name):
                items.append((r["bytes_vs_exact_first_exact"], seg_name, name, r))
    out = ["| bytes vs exact | segments | codec | attn err (mean over layers) | worst layer | key err mean "
           "| value err mean |", "|---|---|---|---|---|---|---|"]
    for b, seg_name, name, r in sorted(items, key=lambda x: x[0]):
        out.append(f"| {_pct(b)} | {seg_name} | {name} | {_f(r['attn']['mean'])} | {_f(r['attn']['max_layer'])} "
                   f"| {_f(r['key_err']['mean'])} | {_f(r['value_err']['mean'])} |")
    return out


def _cheapest(res: dict, bounds=(0.05, 0.1, 0.2)) -> list[str]:
    """For each error bound, the fewest bytes at which a default codec stays under it."""
    items = [(r["bytes_vs_exact_first_exact"], r["attn"]["mean"], seg_name, name)
             for seg_name, seg in res["segmentations"].items() for name, r in seg["rows"].items()
             if name.startswith("lowrank(") and "," not in name]
    out = []
    for bound in bounds:
        ok = sorted(x for x in items if x[1] < bound)
        if ok:
            b, err, seg_name, name = ok[0]
            out.append(f"* Fewest bytes with mean attention output error below {bound} (first segment exact, "
                       f"any segmentation): {_pct(b)} of exact ({seg_name}, {name}: {_f(err)}).")
        else:
            out.append(f"* No codec and segmentation kept the mean attention output error below {bound}.")
    return out


def write_md(res: dict, path: str) -> None:
    a = res["setup"]["args"]
    meta = res.get("meta") or {"commands": [res["command"]]}
    lines = ["\n".join(H.header("lowrank(r) codec study: bytes moved vs reconstruction error", meta["commands"],
                                 meta.get("machine"), meta.get("commit"), meta.get("date"))),
             f"Produced by `benchmarks/sekv/lowrank_study.py` in {res['elapsed_s'] / 60:.1f} min on CPU "
             "(captured K/V are cached under `--cache-dir`; a re-run reuses them). "
             f"Model: {res['setup']['model']}, {res['setup']['layers']} layers, {res['setup']['kv_heads']} KV heads, "
             f"head_dim {res['setup']['head_dim']}. Data: {a['texts']} texts of {a['length']} tokens "
             "(essays in a seeded order after a ChatML user prefix); the last "
             f"{a['new_tokens']} tokens are the step's queries, the rest is the history that is cut into "
             "segments and stored with each codec.\n",
             f"K (pre-RoPE) and V are cast to {a['dtype']} before encoding; every error is relative to that "
             "cast (what `exact` returns), except the rounding row (relative to fp32). Key / value error: "
             "relative Frobenius error per (segment, layer, KV head). Attention output error: for each layer, "
             "relative Frobenius error of the new tokens' attention output (all query heads, causal over history "
             "+ themselves, keys re-rotated to their positions) with the history's K/V reconstructed, then the "
             "mean over layers (and texts). It is given with every history segment reconstructed (`all segments`) "
             "and with the history's first segment kept exact (the sink, which the design always keeps at full "
             "resolution; its bytes then count in full); `K only` / `V only` reconstruct one of the two, first "
             "segment exact. `lowrank(r)` is the codec's default (uncentered); `lowrank(r,centered)` also stores "
             "the per-head mean and factors the residual. A segment is stored exact (bit-identical) when its "
             "factors would not be smaller. `segment mean` (study only) replaces every token of a segment by the "
             "segment's per-head mean K and V.\n"]
    for name, seg in res["segmentations"].items():
        how = (f"`vllm_sekv.workspace.segments.segment` on the model's own surprisal, alpha = {a['alpha']}"
               if name == "surprisal" else f"fixed {name[5:]}-token segments")
        lines.append(f"## Segments: {name} ({how})\n")
        lines.append(f"{seg['texts']} texts, {seg['hist_tokens']} history tokens each, {seg['segments']} segments "
                     f"(tokens per segment: mean {seg['segment_tokens']['mean']:.1f}, min "
                     f"{seg['segment_tokens']['min']}, max {seg['segment_tokens']['max']}).\n")
        lines += _table(seg)
        lines.append("")
    lines.append("## Attention output error against bytes moved (first segment exact)\n")
    lines.append("The default codec (uncentered) of every segmentation, sorted by bytes; the first "
                 "segment's bytes are counted at full size.\n")
    lines += _by_bytes(res)
    lines.append("")
    lines.append("## What it says\n")
    for name, seg in res["segmentations"].items():
        lines += _says(name, seg, a["ranks"], a["dtype"])
        lines.append("")
    lines += _cheapest(res)
    H.write_report(path, lines)
