"""Render the GPU component benchmarks' JSON as their Markdown reports.

    python benchmarks/gpu/report.py restore   # benchmarks/results/gpu_restore_pipeline/report.{json -> md}
    python benchmarks/gpu/report.py scoring   # benchmarks/results/gpu_scoring/report.json (+ queries*.json) -> report.md

`restore`: `bench_restore.py`'s JSON; `scoring`: `bench_scoring.py`'s (the
Mean-K scoring kernel and GPU memory), plus the same kernel at 64 and 512
query tokens measured in one later invocation (`queries64.json`,
`queries512.json`) where present. Each report starts with the JSON's header
(machine, commit, command: `meta`); hand-written notes after
`report_header.NOTES_MARK` in an existing report are kept. `--dir` reads and
writes another folder.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import report_header as RH  # noqa: E402

GiB = 2 ** 30


def restore_tables(r: dict) -> list[str]:
    out = ["### (a) Restore into paged layout with re-RoPE (Llama-3-8B KV, bf16, 4 MiB per 32-token block)", ""]
    names = list(r["sets"][0]["pipeline"])
    out.append("| working set | plain pinned H2D (baseline) | naive per-page copies | "
               + " | ".join(names) + " |")
    out.append("|---" * (3 + len(names)) + "|")
    for s in r["sets"]:
        cells = [f"{s['tokens'] // 1024}K tokens, {s['bytes'] / GiB:.0f} GiB",
                 f"{s['plain_h2d']['GBps']:.1f} GB/s ({s['plain_h2d']['ms']:.1f} ms)"]
        nv = s.get("naive")
        cells.append(f"{nv['GBps']:.1f} GB/s ({nv['fraction_of_plain_h2d']:.2f})" if nv else "-")
        for n in names:
            v = s["pipeline"][n]
            cells.append(f"{v['GBps']:.1f} GB/s (**{v['fraction_of_plain_h2d']:.2f}**)")
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "Fractions in parentheses are of the plain pinned H2D copy of the same bytes, same run.", ""]
    out += ["| working set | 4 MiB torch copies, scattered slots | same, consecutive slots | step, 50% of blocks "
            "already in the GPU pool | step, 100% in the GPU pool | max abs err vs reference |", "|---|---|---|---|---|---|"]
    for s in r["sets"]:
        p, g = s["copy_probe"], s.get("gpu_pool_steps")  # runs before the pool's removal measured it
        reuse = (f"{g['reuse_50pct_ms']:.1f} ms | {g['reuse_100pct_ms']:.1f} ms" if g else "- | -")
        out.append(f"| {s['tokens'] // 1024}K | {p['torch_scattered_GBps']:.1f} GB/s | {p['torch_consecutive_GBps']:.1f} GB/s"
                   f" | {reuse} | {s['check_max_abs_err_vs_reference']:.3g} |")
    so = r["scatter_only"]
    out += ["", f"Scatter + re-RoPE alone ({so['tokens'] // 1024}K tokens, device staging -> paged cache, "
            f"{so['bytes_moved'] / GiB:.0f} GiB read+written): device-to-device copy of the same bytes "
            f"{so['d2d_copy_ms']:.2f} ms ({so['d2d_copy_GBps']:.0f} GB/s); PyTorch reference {so['reference_ms']:.1f} ms.", "",
            "| Triton variant | time | HBM GB/s | fraction of D2D copy | speed-up vs reference |", "|---|---|---|---|---|"]
    for k, v in so["triton"].items():
        out.append(f"| {k} | {v['ms']:.2f} ms | {v['hbm_GBps']:.0f} | {v['fraction_of_d2d_copy']:.2f} | "
                   f"{v['speedup_vs_reference']:.1f}x |")
    return out


def scoring_tables(s: dict) -> list[str]:
    out = ["", f"### (b) Mean-K scoring, {s['query_tokens']} query tokens (config `{s['config']}`)", "",
           f"Baseline in the same run: dense bf16 matmul {s['matmul_bf16_TFLOPs']:.0f} TFLOP/s.", "",
           "| workspace | blocks | Triton, max | Triton, mean | pass 1 of 2 | TFLOP/s (fraction of matmul) | "
           "PyTorch reference | speed-up | rel. err vs reference | top-64 agreement | top-2048 select |",
           "|---" * 11 + "|"]
    for e in s["sizes"]:
        ref = f"{e['reference_ms']:.0f} ms" if e.get("reference_ms") else "-"
        sp = f"{e['speedup_vs_reference']:.1f}x" if e.get("speedup_vs_reference") else "-"
        out.append(f"| {e['workspace_tokens']:,} | {e['blocks']:,} | {e['triton_max_ms']:.1f} ms | "
                   f"{e['triton_mean_ms']:.1f} ms | {e['triton_pass1_ms']:.1f} ms | {e['triton_TFLOPs']:.0f} "
                   f"({e['fraction_of_matmul_rate']:.2f}) | {ref} | {sp} | {e.get('rel_err_max', float('nan')):.1e} | "
                   f"{e.get('top64_overlap_max', float('nan')):.2f} | {e['select_top2048_ms']:.2f} ms |")
    out += ["", "Index variants through the same kernel (combine=max):", "",
            "| workspace | variant | time | top-64 agreement with bf16 | rel. difference vs bf16 |", "|---|---|---|---|---|"]
    for e in s["sizes"]:
        for k, v in e.get("variants", {}).items():
            if "error" in v:
                out.append(f"| {e['workspace_tokens']:,} | {k} | error: {v['error'][:80]} | | |")
                continue
            out.append(f"| {e['workspace_tokens']:,} | {k} | {v['ms']:.1f} ms | {v.get('top64_overlap_vs_bf16', '-')} | "
                       f"{v.get('rel_diff_vs_bf16', float('nan')):.1e} |")
    if "sweep_1M" in s:
        out += ["", "Tile sweep at 1M tokens: " + ", ".join(
            f"`{k}` {v['ms']:.1f} ms" if "ms" in v else f"`{k}` error" for k, v in s["sweep_1M"].items()) + "."]
    fm = s["fixed_memory"]
    out += ["", "### (c) GPU memory", "",
            f"Fixed parts, allocated for real and kept alive through all sizes: GPU block pool of "
            f"{fm['gpu_pool_tokens'] // 1024}K tokens {fm['gpu_pool_bytes'] / GiB:.2f} GiB; restore staging "
            f"{fm['restore_staging_bytes'] / GiB:.2f} GiB; queries {fm['query_bytes'] / GiB:.3f} GiB.", "",
            "| workspace | index bf16 | index fp8 | index d'=32 bf16 | scoring transient | total allocated | index / GPU |",
            "|---|---|---|---|---|---|---|"]
    for e in s["sizes"]:
        m = e["memory"]
        out.append(f"| {e['workspace_tokens']:,} | {m['index_bf16_bytes'] / GiB:.2f} GiB | {m['index_fp8_bytes'] / GiB:.2f} GiB"
                   f" | {m['index_proj32_bf16_bytes'] / GiB:.2f} GiB | {m['scoring_transient_bytes'] / 2**20:.0f} MiB | "
                   f"{m['total_allocated_bytes'] / GiB:.2f} GiB | {m['index_fraction_of_gpu']:.1%} |")
    return out


def queries_table(d: Path) -> list[str]:
    """The kernel at 64 and 512 query tokens, one invocation (`queries64.json`, `queries512.json`)."""
    runs = {q: json.loads((d / f"queries{q}.json").read_text()) for q in (64, 512) if (d / f"queries{q}.json").exists()}
    if not runs:
        return []
    by = {q: {e["workspace_tokens"]: e for e in r["sizes"]} for q, r in runs.items()}
    sizes = sorted({t for q in by for t in by[q]})
    out = ["", "### (d) The same kernel at 512 and at 64 query tokens, one invocation", "",
           "| workspace | " + " | ".join(f"{q} queries" for q in runs) + " | PyTorch reference, 64 queries |",
           "|---" * (len(runs) + 2) + "|"]
    for t in sizes:
        cells = [f"{by[q][t]['triton_max_ms']:.2f} ms" if t in by[q] else "-" for q in runs]
        ref = by.get(64, {}).get(t, {}).get("reference_ms")
        out.append(f"| {t:,} | " + " | ".join(cells) + f" | {f'{ref:.1f} ms' if ref else '-'} |")
    return out


TITLES = {"restore": "GPU restore pipeline: pinned host -> paged cache with re-RoPE, against plain H2D",
          "scoring": "GPU Mean-K scoring latency and GPU memory"}
FOLDERS = {"restore": "gpu_restore_pipeline", "scoring": "gpu_scoring"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=sorted(TITLES))
    ap.add_argument("--dir", help="folder of report.json (default: the benchmark's results folder)")
    args = ap.parse_args()
    d = Path(args.dir) if args.dir else RH.results_dir(FOLDERS[args.what])
    data = json.loads((d / "report.json").read_text())
    lines = RH.header_from(data["meta"], TITLES[args.what])
    if args.what == "restore":
        lines += restore_tables(data)
    else:
        lines += scoring_tables(data) + queries_table(d)
    RH.write_report(d / "report.md", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
