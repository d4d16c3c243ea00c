"""BlockIndex.score's eager torch path vs the fused Triton sub-block kernel.

One probe = all `--layers` layers of `BlockIndex.score` (Llama-3-8B geometry:
8 KV heads, head_dim 128, 32 query heads; 64 float32 queries) over `--blocks`
candidate blocks (all of them; a few not indexed) of a random bfloat16 index
[blocks + spare, 32, S, 8, 128] on the GPU. For each kind (`sub4_pre`: S = 8,
`mean_pre`: S = 1) it times (a) `BlockIndex.score`, the eager path (gather,
float32 copy, batched matmul, logsumexp, masked softmax, sum) and (b)
`sub_block_scoring.score_sub_blocks`, each over all layers between CUDA events
(median of `--repeats` after a warm-up), checks the kernel against the eager
scores on every layer, and writes JSON and a Markdown table headed by the
machine, commit and command (`--out`, default $OUT/bench_sub_scoring.json when
OUT is set, else benchmarks/results/gpu_sub_scoring/report.json; the Markdown
beside it, `.md`; `--report-only` writes it again from the JSON). `--sweep`
also times a few tile configs for the first kind. About 10-30 s of GPU time (mostly filling
the index and the eager path).

Run from anywhere: python benchmarks/gpu/bench_sub_scoring.py [--blocks 16384] [--kinds sub4_pre mean_pre]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import torch

from common import event_ms, machine_facts, median, write_json

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import report_header as RH  # noqa: E402

KINDS = ("sub4_pre", "mean_pre")
LAYERS, KV_HEADS, HEAD_DIM, Q_HEADS, QUERIES = 32, 8, 128, 32, 64
SPARE_SLOTS = 64
SWEEP = {  # name -> SubBlockConfig kwargs
    "default": {},
    "lse m64v64": {"lse_block_m": 64},
    "lse m128v128": {"lse_block_v": 128},
    "lse w4s4": {"lse_warps": 4, "lse_stages": 4},
    "acc m64v64": {"acc_block_v": 64},
    "acc m64v256 w8s2": {"acc_block_v": 256, "acc_stages": 2},
    "waves 8": {"lse_waves": 8},
}


def default_out() -> str:
    if os.environ.get("OUT"):
        return os.path.join(os.environ["OUT"], "bench_sub_scoring.json")
    return str(RH.results_dir("gpu_sub_scoring") / "report.json")


def report(out: dict, path: pathlib.Path) -> list[str]:
    """The Markdown of a run's JSON (`out`), written beside it (`.md`)."""
    blocks = out["results"][0]["blocks"] if out["results"] else 0
    lines = [*RH.header_from(out["meta"], "Probe scoring: the fused sub-block kernel vs the eager path"),
             f"{blocks} candidate blocks, {LAYERS} layers, {QUERIES} queries x {Q_HEADS} heads, "
             f"{KV_HEADS} KV heads, D={HEAD_DIM}, bf16 entries ({out['machine']['gpu']}, torch "
             f"{out['machine']['torch']}, Triton {out['machine']['triton']}); median of the timed repeats.", "",
             "| kind | S | eager ms | kernel ms | eager/kernel | kernel TFLOP/s | max abs diff | rel L2 | top-64 overlap |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in out["results"]:
        lines.append(f"| {r['kind']} | {r['S']} | {r['eager_ms']:.2f} | {r['kernel_ms']:.2f} | "
                     f"{r['eager_over_kernel']:.1f}x | {r['kernel_TFLOPs']:.0f} | {r['max_abs_diff_vs_eager']:.2e} | "
                     f"{r['max_rel_l2_vs_eager']:.1e} | {r['min_top64_overlap_vs_eager']:.2f} |")
    RH.write_report(path.with_suffix(".md"), lines)
    return lines


def build_index(kind: str, blocks: int, invalid_every: int):
    from vllm_sekv.ops import RopeSpec
    from vllm_sekv.index.block_index import BlockIndex

    inv = 1.0 / 500000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    index = BlockIndex(blocks + SPARE_SLOTS, LAYERS, KV_HEADS, HEAD_DIM, RopeSpec(inv_freq=inv, rotary_dim=HEAD_DIM),
                       kind=kind, dtype=torch.bfloat16, device="cuda")
    for r in range(0, index.entries.shape[0], 1024):  # in chunks: randn's float32 temporary stays small
        index.entries[r:r + 1024].normal_()
    index.valid.fill_(True)
    index.valid[::invalid_every] = False  # a few candidates not indexed
    return index


def run_kind(kind: str, args, sweep: bool) -> dict:
    from vllm_sekv.ops.scoring import sub_block_scoring as sub_blocks

    torch.manual_seed(0)
    index = build_index(kind, args.blocks, args.invalid_every)
    index.fused = False  # `score` takes its eager PyTorch path: the baseline
    s = index.entries.shape[2]
    slots = torch.arange(args.blocks, device="cuda")
    queries = torch.randn(QUERIES, Q_HEADS, HEAD_DIM, device="cuda")

    def eager():
        return [index.score(layer, queries, slots) for layer in range(LAYERS)]

    def kernel(cfg=None):
        return [sub_blocks.score_sub_blocks(queries, index.entries, layer, slots, index.valid, cfg)
                for layer in range(LAYERS)]

    want, got = eager(), kernel()
    max_abs = max((g - w).abs().max().item() for g, w in zip(got, want))
    rel_l2 = max(((g - w).norm() / w.norm()).item() for g, w in zip(got, want))
    k = min(64, args.blocks)  # top-k blocks by the head-summed score, per layer
    top64 = min(len(set(g.sum(0).topk(k).indices.tolist()) & set(w.sum(0).topk(k).indices.tolist())) / k
                for g, w in zip(got, want))
    peak_scores = max(w.max().item() for w in want)
    del want, got
    torch.cuda.empty_cache()

    eager_runs = event_ms(eager, repeats=args.repeats, warmup=1)
    kernel_runs = event_ms(kernel, repeats=args.repeats, warmup=2)
    flops = 2 * 2 * Q_HEADS * QUERIES * args.blocks * s * HEAD_DIM * LAYERS  # two passes of the dots
    entry_bytes = args.blocks * s * KV_HEADS * HEAD_DIM * 2 * LAYERS
    res = {
        "kind": kind, "S": s, "blocks": args.blocks, "layers": LAYERS, "queries": QUERIES,
        "invalid_candidates": len(range(0, args.blocks, args.invalid_every)),
        "eager_ms": median(eager_runs), "eager_runs_ms": eager_runs,
        "kernel_ms": median(kernel_runs), "kernel_runs_ms": kernel_runs,
        "eager_over_kernel": median(eager_runs) / median(kernel_runs),
        "kernel_TFLOPs": flops / median(kernel_runs) / 1e9,
        "kernel_entry_GBps": entry_bytes / median(kernel_runs) / 1e6,
        "entry_bytes_all_layers": entry_bytes,
        "max_abs_diff_vs_eager": max_abs, "max_rel_l2_vs_eager": rel_l2,
        "min_top64_overlap_vs_eager": top64, "max_score": peak_scores,
    }
    if sweep:
        res["sweep"] = {}
        for name, kw in SWEEP.items():
            try:
                cfg = sub_blocks.SubBlockConfig(**kw)
                res["sweep"][name] = {"ms": median(event_ms(lambda: kernel(cfg), repeats=3, warmup=1))}
            except Exception as exc:  # a config that does not compile or fit is reported, not fatal
                res["sweep"][name] = {"error": repr(exc)[:300]}
            print(f"sweep {kind} {name}: {res['sweep'][name]}", flush=True)
    del index
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=16384, help="candidate blocks (all indexed slots but a few)")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--invalid-every", type=int, default=997, help="every n-th candidate is not indexed")
    ap.add_argument("--sweep", action="store_true", help="also time a few tile configs (first kind)")
    ap.add_argument("--out", default=default_out())
    ap.add_argument("--report-only", action="store_true", help="only write the Markdown again from --out's JSON")
    args = ap.parse_args()
    if args.report_only:
        print("\n".join(report(json.loads(pathlib.Path(args.out).read_text()), pathlib.Path(args.out))))
        return
    if not torch.cuda.is_available():
        sys.exit("bench_sub_scoring.py needs CUDA (an NVIDIA GPU); nothing was run")
    out = {"geometry": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "q_heads": Q_HEADS,
                        "queries": QUERIES, "entries_dtype": "bfloat16", "queries_dtype": "float32"},
           "results": []}
    for i, kind in enumerate(args.kinds):
        r = run_kind(kind, args, args.sweep and i == 0)
        out["results"].append(r)
        print(f"{kind}: eager {r['eager_ms']:.2f} ms, kernel {r['kernel_ms']:.2f} ms "
              f"({r['eager_over_kernel']:.1f}x), max |diff| {r['max_abs_diff_vs_eager']:.2e}", flush=True)
    out["machine"] = machine_facts()
    out["meta"] = RH.meta(RH.command(__file__))
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, out)
    print("\n" + "\n".join(report(out, pathlib.Path(args.out))))
    print(f"\nwrote {args.out} and its .md")


if __name__ == "__main__":
    main()
