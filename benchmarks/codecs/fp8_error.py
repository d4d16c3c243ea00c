"""fp8 workspace codec study: reconstruction error of K and V (and of each
layer's attention output) on real SmolLM2 KV.

Uses the lowrank study's captured texts (``benchmarks/sekv/lowrank_study.py``:
SmolLM2-135M-Instruct, fp32, CPU, Paul Graham essays; captured once per text
under ``--cache-dir``, the same cache as that study). Keys are rotated to their
positions (the host tier's canonical, post-RoPE form) and cast to ``--dtype``
(bf16: what a served model stores); that cast is the reference, i.e. what the
``exact`` workspace codec stores. Each ``--block-tokens`` block of each layer
is then quantized exactly as the fp8 host pool does (``vllm_sekv.store.fp8``:
e4m3 with one scale per block, K or V, layer and KV head, around a centre in
the channels whose block mean is a bias) and dequantized.

Over an fp8 paged cache (`--kv-cache-dtype fp8`, the workspace keeping the
cache's own bytes) the error is the cache's, at vLLM's default per-layer
scale 1.0: measured as vLLM's CPU cache-update op rounds (read back through
the byte views the worker captures with) and to nearest (as CUDA rounds).
And for keys a step moves (computed at a compact position, stored at their
own): rounded by the cache, dequantized, rotated and rounded again, against
rotated from the exact key and rounded once (`--moved-by` positions).

Reported, per text and overall: relative Frobenius error of K and of V per
(block, layer, KV head), mean and p90, and the largest element error relative
to its group's amax; the relative error of the attention output of the last
``--new-tokens`` queries (at their positions, causal, per layer, then
averaged) with the history's K/V replaced by the fp8 round trip (the new
tokens' own K/V exact); the bytes per token of both codecs. Then the
centring rule's choice: the attention output's error with each of
`--gates` as the codec's `CENTRE_GATE` (0: every channel centred on its
block mean; inf: none). Writes OUT.json and OUT.md::

    OMP_NUM_THREADS=1 python benchmarks/codecs/fp8_error.py
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "sekv"))

import report_header as H  # noqa: E402
from lowrank_analysis import attention, rel  # noqa: E402
from lowrank_study import load_texts  # noqa: E402
from vllm_sekv.ops import RopeSpec, rotate_keys  # noqa: E402
from vllm_sekv.store import HostPool  # noqa: E402
from vllm_sekv.store import fp8  # noqa: E402
from vllm_sekv.store.fp8 import dequantize, quantize  # noqa: E402


def fp8_round_trip(x: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """x [L, T, H, D] (T a multiple of block_tokens) through the fp8 pool's
    quantizer, block by block -> float32 [L, T, H, D]."""
    num_layers, total, heads, dim = x.shape
    blocks = x.reshape(num_layers, total // block_tokens, block_tokens, heads, dim)
    q, params, finite = quantize(blocks, token_dim=2)
    assert bool(finite.all())
    return dequantize(q, params, token_dim=2).reshape(num_layers, total, heads, dim)


def vllm_cpu_cache_round_trip(x: torch.Tensor, page_tokens: int = 32) -> torch.Tensor | None:
    """x [L, T, H, D] written by vLLM's CPU cache-update op into an fp8 paged
    cache (scale 1.0, its `vec` kernels) and read back through the worker's
    byte views -> float32; None without vLLM's CPU build."""
    try:
        import vllm._custom_ops as ops
        if not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
            return None
    except ImportError:
        return None
    from vllm_sekv import compat

    num_layers, total, heads, dim = x.shape
    pages = -(-total // page_tokens)
    slots = torch.arange(total)
    out = torch.empty_like(x, dtype=torch.float32)
    for layer in range(num_layers):
        cache = torch.zeros(pages, heads, 2 * page_tokens, dim, dtype=torch.uint8)
        key_cache, value_cache = cache.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(x[layer], x[layer], key_cache, value_cache, slots, "vec",
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="fp8")
        keys, _ = compat.paged_kv_byte_views(cache, heads, dim)
        out[layer] = keys[slots // page_tokens, slots % page_tokens].view(fp8.FP8_DTYPE).float()
    return out


def nearest_cache_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x [L, T, H, D] rounded to the nearest e4m3 at scale 1.0 (CUDA's cache rounding) -> float32."""
    num_layers, _, heads, dim = x.shape
    params = fp8.cache_params([1.0] * num_layers, [1.0] * num_layers, heads, dim)[0]  # [L, H, 1 + D]
    return dequantize(fp8.quantize_with(x, params, token_dim=1), params, token_dim=1)


def cache_errors(k_post, v, k_pre, q, rope, hist: int, moved_by: int) -> dict[str, list[float]]:
    """Attention output's relative error per layer with the history's K/V as
    an fp8 paged cache holds them; and of keys moved by `moved_by` positions,
    rounded twice (by vLLM's CPU op at the compact position, then to nearest
    after the rotation) or once (rotated exact, rounded to nearest)."""
    num_layers = k_post.shape[0]
    hk, hv = k_post[:, :hist].float(), v[:, :hist].float()
    out: dict[str, list[float]] = {}
    ref = [attention(q[l], k_post[l].float(), v[l].float(), hist) for l in range(num_layers)]

    def err(keys, values):
        return [rel(attention(q[l], torch.cat([keys[l], k_post[l, hist:].float()]),
                              torch.cat([values[l], v[l, hist:].float()]), hist), ref[l]) for l in range(num_layers)]
    cpu_k, cpu_v = vllm_cpu_cache_round_trip(hk), vllm_cpu_cache_round_trip(hv)
    if cpu_k is not None:
        out["vllm_cpu_op"] = err(cpu_k, cpu_v)
        compact = torch.arange(hist) - moved_by
        at_compact = torch.stack([rotate_keys(k_pre[l, :hist], compact, rope) for l in range(num_layers)])
        cached = vllm_cpu_cache_round_trip(at_compact.to(k_post.dtype).float())
        moved = torch.stack([rotate_keys(cached[l], torch.full((hist,), moved_by), rope) for l in range(num_layers)])
        out["moved_twice"] = err(nearest_cache_round_trip(moved), cpu_v)
        out["moved_once"] = err(nearest_cache_round_trip(hk), cpu_v)
    out["nearest"] = err(nearest_cache_round_trip(hk), nearest_cache_round_trip(hv))
    return out


def group_errors(x_hat: torch.Tensor, x: torch.Tensor, block_tokens: int) -> dict[str, list[float]]:
    """Per (layer, block, head): relative Frobenius error; largest element error / group amax."""
    num_layers, total, heads, dim = x.shape
    shape = (num_layers, total // block_tokens, block_tokens, heads, dim)
    d, r = (x_hat - x).reshape(shape), x.reshape(shape)
    fro = d.pow(2).sum((2, 4)).sqrt() / r.pow(2).sum((2, 4)).sqrt().clamp_min(1e-30)
    amax = d.abs().amax((2, 4)) / r.abs().amax((2, 4)).clamp_min(1e-30)
    return {"fro": fro.flatten().tolist(), "max_over_amax": amax.flatten().tolist()}


def stats(values: list[float]) -> dict[str, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return {"mean": float(t.mean()), "p90": float(t.quantile(0.9)), "max": float(t.max())}


def analyze(text: dict, dtype: torch.dtype, block_tokens: int, new_tokens: int, moved_by: int | None = None) -> dict:
    k_pre, values, q_pre = text["k_pre"], text["values"], text["q_pre"]
    num_layers, total, heads, dim = k_pre.shape
    hist = (total - new_tokens) // block_tokens * block_tokens
    total_used = hist + new_tokens
    rope, pos = RopeSpec(text["inv_freq"], dim, True), torch.arange(total_used)
    k_post = torch.stack([rotate_keys(k_pre[l, :total_used], pos, rope) for l in range(num_layers)]).to(dtype)
    v = values[:, :total_used].to(dtype)
    k_hat = fp8_round_trip(k_post[:, :hist].float(), block_tokens)
    v_hat = fp8_round_trip(v[:, :hist].float(), block_tokens)
    ke = group_errors(k_hat, k_post[:, :hist].float(), block_tokens)
    ve = group_errors(v_hat, v[:, :hist].float(), block_tokens)
    q_start = total - new_tokens
    attn, queries = [], []
    for l in range(num_layers):
        q = rotate_keys(q_pre[l], pos[hist:hist + new_tokens] if q_start == hist else torch.arange(hist, total_used),
                        rope)
        queries.append(q)
        ref = attention(q, k_post[l].float(), v[l].float(), hist)
        got = attention(q, torch.cat([k_hat[l], k_post[l, hist:].float()]), torch.cat([v_hat[l], v[l, hist:].float()]),
                        hist)
        attn.append(rel(got, ref))
    result = {"seed": text["seed"], "hist_tokens": hist, "k": ke, "v": ve, "attn": attn}
    if moved_by is not None:
        result["cache"] = cache_errors(k_post, v, k_pre, queries, rope, hist, moved_by)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", type=int, default=2)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--block-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-dir", default=".cache/lowrank_study")
    ap.add_argument("--gates", type=float, nargs="*", default=[0, 1, 2, 4, 8, float("inf")])
    ap.add_argument("--moved-by", type=int, default=1000,
                    help="positions a moved key travels in the fp8 paged cache comparison")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "fp8_codec", "report"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.cache_dir, exist_ok=True)
    t0 = time.time()
    texts = load_texts(args)
    dtype = getattr(torch, args.dtype)
    per_text = [analyze(t, dtype, args.block_tokens, args.new_tokens, args.moved_by) for t in texts]
    by_gate, codec_gate = {}, fp8.CENTRE_GATE
    for gate in args.gates:
        fp8.CENTRE_GATE = gate
        runs = [analyze(t, dtype, args.block_tokens, args.new_tokens) for t in texts]
        by_gate[str(gate)] = stats([x for t in runs for x in t["attn"]])
    fp8.CENTRE_GATE = codec_gate
    num_layers, _, heads, dim = texts[0]["k_pre"].shape
    bytes_exact = HostPool.bytes_per_block(num_layers, args.block_tokens, heads, dim, dtype) / args.block_tokens
    bytes_fp8 = HostPool.bytes_per_block(num_layers, args.block_tokens, heads, dim, dtype, "fp8") / args.block_tokens
    summary = {
        "k_rel_fro": stats([x for t in per_text for x in t["k"]["fro"]]),
        "v_rel_fro": stats([x for t in per_text for x in t["v"]["fro"]]),
        "k_max_err_over_amax": stats([x for t in per_text for x in t["k"]["max_over_amax"]]),
        "v_max_err_over_amax": stats([x for t in per_text for x in t["v"]["max_over_amax"]]),
        "attn_rel": stats([x for t in per_text for x in t["attn"]]),
        "bytes_per_token": {"exact": bytes_exact, "fp8": bytes_fp8, "ratio": bytes_fp8 / bytes_exact},
        "attn_rel_by_centre_gate": by_gate,
        "attn_rel_fp8_paged_cache": {name: stats([x for t in per_text for x in t["cache"][name]])
                                     for name in per_text[0]["cache"]},
    }
    command = H.command(__file__, prefix="OMP_NUM_THREADS=1 python")
    res = {"command": command, "meta": H.meta(command), "args": vars(args),
           "setup": {"model": "SmolLM2-135M-Instruct (fp32 capture, cast to --dtype)", "layers": int(num_layers),
                     "kv_heads": int(heads), "head_dim": int(dim)},
           "summary": summary,
           "per_text": [{"seed": t["seed"], "hist_tokens": t["hist_tokens"], "attn_rel_per_layer": t["attn"],
                         "k_rel_fro": stats(t["k"]["fro"]), "v_rel_fro": stats(t["v"]["fro"])} for t in per_text],
           "elapsed_s": time.time() - t0}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    json.dump(res, open(args.out + ".json", "w"), indent=1)
    rows = [f"| {name} | {s['mean']:.4f} | {s['p90']:.4f} | {s['max']:.4f} |"
            for name, s in summary.items()
            if name not in ("bytes_per_token", "attn_rel_by_centre_gate", "attn_rel_fp8_paged_cache")]
    labels = {"vllm_cpu_op": "as vLLM's CPU cache-update op rounds", "nearest": "rounded to nearest (CUDA)",
              "moved_twice": f"keys moved {args.moved_by} positions, rounded twice (the cache's bytes rotated)",
              "moved_once": f"keys moved {args.moved_by} positions, rounded once (rotated from exact keys)"}
    cache_rows = [f"| {labels[name]} | {s['mean']:.4f} | {s['p90']:.4f} | {s['max']:.4f} |"
                  for name, s in summary["attn_rel_fp8_paged_cache"].items()]
    gates = [f"| {g}{' (the codec)' if float(g) == codec_gate else ''} | {s['mean']:.4f} | {s['p90']:.4f} | "
             f"{s['max']:.4f} |" for g, s in by_gate.items()]
    b = summary["bytes_per_token"]
    table = ["", f"fp8 workspace codec against {args.dtype} K/V, {len(texts)} texts x {args.length} tokens, "
             f"{args.block_tokens}-token blocks, last {args.new_tokens} tokens as queries.", "",
             "| quantity | mean | p90 | max |", "|---|---|---|---|", *rows, "",
             f"Host bytes per token: exact {b['exact']:.0f}, fp8 {b['fp8']:.0f} (ratio {b['ratio']:.3f}).", "",
             "Attention output's relative error by centring rule (a channel is centred where its block mean is more "
             "than GATE of its standard deviations from 0; 0: every channel, inf: none):", "",
             "| gate | mean | p90 | max |", "|---|---|---|---|", *gates, "",
             "An fp8 paged cache's own error, which a workspace keeping its bytes carries (scale 1.0, per layer; "
             "attention output's relative error; moved keys with the cache's values):", "",
             "| history K/V | mean | p90 | max |", "|---|---|---|---|", *cache_rows, ""]
    H.write_report(args.out + ".md", H.header_from(res["meta"], "fp8 workspace codec error") + table)
    print("\n".join(table))
    print(f"wrote {args.out}.json / .md in {res['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
