"""(a) Restore of a working set from a pinned host pool into vLLM's paged CUDA
layout with re-RoPE, against plain pinned H2D bandwidth measured in the same run.

Table-driven: `WORKING_SETS` (tokens) x `VARIANTS` (pipeline settings). For each
working set: the host pool holds 2x the working set's blocks, the working set is
a random half of its slots (scattered, as after eviction), the destination pages
are a random permutation of the cache's pages. Figures:
  plain_h2d      one contiguous pinned->device copy of the same bytes (baseline)
  naive          one copy per (block, layer, K/V, page) straight into the cache,
                 no re-RoPE at all (a generous lower bound on that path's cost)
  pipeline/*     RestorePipeline.restore + wait (H2D per run of slots, scatter+re-RoPE)
  scatter_only   the Triton scatter+re-RoPE from device staging, and its
                 PyTorch reference, for one working set (HBM read+write GB/s)

    python benchmarks/gpu/bench_restore.py [--out benchmarks/results/gpu_restore_pipeline/report.json]
    python benchmarks/gpu/report.py restore     # its Markdown report, headed by machine, commit, command
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from common import LLAMA3_8B, KvGeometry, event_ms, machine_facts, median, wall_ms, write_json
from vllm_sekv.store.transfer import RestorePipeline
from vllm_sekv.ops.rope import scatter as rope_kernel
from vllm_sekv.ops.rope import scatter_reference
from vllm_sekv.ops import RopeSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import report_header as RH  # noqa: E402

WORKING_SETS = [8192, 65536]  # tokens
VARIANTS = [  # name, batch_blocks, num_buffers
    ("b16", 16, 2),
    ("b64", 64, 2),  # RestorePipeline's default
    ("b64-nb3", 64, 3),
    ("b128", 128, 2),
]
SCATTER_HEADS_PER_PROG = [1, 2, 8]


def llama3_rope(geo: KvGeometry) -> RopeSpec:
    d = geo.head_dim
    inv = 1.0 / 500000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    return RopeSpec(inv, d, True)


def fill_random_pinned(host: torch.Tensor, chunk_rows: int = 128) -> None:
    for r in range(0, host.shape[0], chunk_rows):
        part = host[r:r + chunk_rows]
        part.copy_(torch.randn(part.shape, device="cuda", dtype=host.dtype))


def copy_probe(pool, n_blocks, repeats) -> dict:
    """Per-copy cost of the direct path alone: n block-sized (4 MiB) H2D copies
    issued by torch, from scattered or from consecutive pinned slots."""
    dst = torch.empty((n_blocks, *pool.shape[1:]), dtype=pool.dtype, device="cuda")
    gen = torch.Generator().manual_seed(1)
    scattered = torch.randperm(pool.shape[0], generator=gen)[:n_blocks].tolist()
    out = {"copies": n_blocks, "bytes": dst.numel() * dst.element_size()}

    def torch_copies(slots):
        for j, s in enumerate(slots):
            dst[j].copy_(pool[s], non_blocking=True)

    for name, slots in (("scattered", scattered), ("consecutive", list(range(n_blocks)))):
        ms = median(wall_ms(lambda: torch_copies(slots), repeats))
        out[f"torch_{name}_GBps"] = out["bytes"] / ms / 1e6
    del dst
    return out


def run(geo: KvGeometry, working_sets, variants, repeats: int, naive_max_tokens: int) -> dict:
    rope = llama3_rope(geo)
    max_blocks = max(working_sets) // geo.block_tokens
    pool = torch.empty((2 * max_blocks, 2, geo.num_layers, geo.block_tokens, geo.kv_heads, geo.head_dim),
                       dtype=geo.dtype, pin_memory=True)
    fill_random_pinned(pool)
    results = {"geometry": geo.as_dict(), "block_bytes": geo.block_bytes, "pool_slots": pool.shape[0], "sets": []}
    gen = torch.Generator().manual_seed(0)
    for tokens in working_sets:
        n_blocks = tokens // geo.block_tokens
        nbytes = n_blocks * geo.block_bytes
        num_pages = math.ceil(tokens * 1.25 / geo.page_size)
        kv = torch.empty((geo.num_layers, 2, num_pages, geo.page_size, geo.kv_heads, geo.head_dim),
                         dtype=geo.dtype, device="cuda")
        keys = [kv[l, 0] for l in range(geo.num_layers)]
        vals = [kv[l, 1] for l in range(geo.num_layers)]
        host_slots = sorted(torch.randperm(pool.shape[0], generator=gen)[:n_blocks].tolist())
        pages = torch.randperm(num_pages, generator=gen)[: tokens // geo.page_size]
        slot_mapping = (pages[:, None] * geo.page_size + torch.arange(geo.page_size)).reshape(-1)
        deltas = torch.randint(-100000, 100000, (tokens,), generator=gen)
        entry = {"tokens": tokens, "blocks": n_blocks, "bytes": nbytes}

        # Baseline: one contiguous pinned -> device copy of the same bytes.
        dst = torch.empty((n_blocks, *pool.shape[1:]), dtype=geo.dtype, device="cuda")
        ms = wall_ms(lambda: dst.copy_(pool[:n_blocks], non_blocking=True), repeats)
        entry["plain_h2d"] = {"ms": median(ms), "GBps": nbytes / median(ms) / 1e6, "runs_ms": ms}
        base = entry["plain_h2d"]["GBps"]
        del dst

        if tokens <= naive_max_tokens:
            pages_per_block = geo.block_tokens // geo.page_size

            def naive():
                for j, s in enumerate(host_slots):
                    for p in range(pages_per_block):
                        page = int(pages[j * pages_per_block + p])
                        lo = p * geo.page_size
                        for l in range(geo.num_layers):
                            keys[l][page].copy_(pool[s, 0, l, lo:lo + geo.page_size], non_blocking=True)
                            vals[l][page].copy_(pool[s, 1, l, lo:lo + geo.page_size], non_blocking=True)

            ms = wall_ms(naive, repeats=1 if tokens > 8192 else 3)
            entry["naive"] = {"ms": median(ms), "GBps": nbytes / median(ms) / 1e6,
                              "fraction_of_plain_h2d": nbytes / median(ms) / 1e6 / base, "runs_ms": ms,
                              "copies": n_blocks * pages_per_block * geo.num_layers * 2}

        entry["pipeline"] = {}
        for name, batch_blocks, buffers in variants:
            pipe = RestorePipeline(pool.shape[1:], geo.dtype, "cuda", batch_blocks=batch_blocks, num_buffers=buffers)
            sm, dl = slot_mapping.cuda(), deltas.cuda()
            ms = wall_ms(lambda: pipe.restore(pool, host_slots, keys, vals, sm, dl, rope).wait(), repeats)
            entry["pipeline"][name] = {"batch_blocks": batch_blocks, "num_buffers": buffers,
                                       "ms": median(ms), "GBps": nbytes / median(ms) / 1e6,
                                       "fraction_of_plain_h2d": nbytes / median(ms) / 1e6 / base, "runs_ms": ms}
            pipe.close()
            del pipe
        entry["copy_probe"] = copy_probe(pool, n_blocks, repeats)
        # Check the last pipeline result against the reference on a sample of layers.
        staged = pool[host_slots[:64]].cuda()
        kv_ref = torch.zeros_like(kv[:2])
        scatter_reference.scatter_rerope(staged[:, :, :2].contiguous(), [kv_ref[l, 0] for l in range(2)],
                                         [kv_ref[l, 1] for l in range(2)], slot_mapping[:64 * geo.block_tokens].cuda(),
                                         deltas[:64 * geo.block_tokens].cuda(), rope)
        touched = pages[: 64 * geo.block_tokens // geo.page_size].cuda()
        err = (kv[:2, :, touched].float() - kv_ref[:, :, touched].float()).abs().max().item()
        entry["check_max_abs_err_vs_reference"] = err
        results["sets"].append(entry)
        del kv, keys, vals, kv_ref, staged
        torch.cuda.empty_cache()

    # Scatter+re-RoPE alone, device staging -> paged cache: Triton vs PyTorch reference.
    tokens = min(working_sets)
    n_blocks = tokens // geo.block_tokens
    staging = pool[:n_blocks].cuda()
    num_pages = tokens // geo.page_size
    kv = torch.empty((geo.num_layers, 2, num_pages, geo.page_size, geo.kv_heads, geo.head_dim),
                     dtype=geo.dtype, device="cuda")
    keys = [kv[l, 0] for l in range(geo.num_layers)]
    vals = [kv[l, 1] for l in range(geo.num_layers)]
    sm = torch.randperm(tokens, generator=gen).cuda()
    dl = torch.randint(-100000, 100000, (tokens,), generator=gen).cuda()
    nbytes = n_blocks * geo.block_bytes
    d2d = torch.empty_like(staging)
    copy_ms = median(event_ms(lambda: d2d.copy_(staging), repeats=10, warmup=2))
    ref = event_ms(lambda: scatter_reference.scatter_rerope(staging, keys, vals, sm, dl, rope), repeats=3)
    results["scatter_only"] = {
        "tokens": tokens, "bytes_moved": 2 * nbytes, "reference_ms": median(ref),
        "d2d_copy_ms": copy_ms, "d2d_copy_GBps": 2 * nbytes / copy_ms / 1e6, "triton": {},
    }
    for hpp in SCATTER_HEADS_PER_PROG:
        tri = median(event_ms(lambda: rope_kernel.scatter_rerope(staging, keys, vals, sm, dl, rope,
                                                                 heads_per_prog=hpp), repeats=10, warmup=2))
        results["scatter_only"]["triton"][f"heads_per_prog={hpp}"] = {
            "ms": tri, "hbm_GBps": 2 * nbytes / tri / 1e6, "fraction_of_d2d_copy": copy_ms / tri,
            "speedup_vs_reference": median(ref) / tri}
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(RH.results_dir("gpu_restore_pipeline") / "report.json"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, nargs="*", default=WORKING_SETS)
    ap.add_argument("--naive-max-tokens", type=int, default=65536)
    args = ap.parse_args()
    res = run(LLAMA3_8B, args.tokens, VARIANTS, args.repeats, args.naive_max_tokens)
    res["machine"] = machine_facts()
    res["meta"] = RH.meta([RH.command(__file__), "python benchmarks/gpu/report.py restore"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, res)
    for s in res["sets"]:
        print(f"restore {s['tokens']:>6} tok  plain {s['plain_h2d']['GBps']:.1f} GB/s  "
              + (f"naive {s['naive']['GBps']:.1f}  " if "naive" in s else "")
              + "  ".join(f"{k} {v['GBps']:.1f} ({v['fraction_of_plain_h2d']:.2f})" if "GBps" in v else f"{k} {v}"
                          for k, v in s["pipeline"].items())
              + f"  err {s['check_max_abs_err_vs_reference']:.3g}  probe {s['copy_probe']}")
    so = res["scatter_only"]
    print(f"scatter-only {so['tokens']} tok: d2d copy {so['d2d_copy_ms']:.2f} ms, reference {so['reference_ms']:.1f} ms, "
          + ", ".join(f"{k} {v['ms']:.2f} ms ({v['hbm_GBps']:.0f} GB/s)" for k, v in so["triton"].items()))


if __name__ == "__main__":
    main()
