"""Render the GPU restore pipeline benchmark's JSON as its Markdown report.

    python benchmarks/gpu/report.py restore   # benchmarks/results/gpu_restore_pipeline/report.{json -> md}

The report starts with the JSON's header (machine, commit, command: `meta`);
hand-written notes after `report_header.NOTES_MARK` in an existing report are
kept. `--dir` reads and writes another folder.
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


TITLES = {"restore": "GPU restore pipeline: pinned host -> paged cache with re-RoPE, against plain H2D"}
FOLDERS = {"restore": "gpu_restore_pipeline"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=sorted(TITLES))
    ap.add_argument("--dir", help="folder of report.json (default: the benchmark's results folder)")
    args = ap.parse_args()
    d = Path(args.dir) if args.dir else RH.results_dir(FOLDERS[args.what])
    data = json.loads((d / "report.json").read_text())
    lines = RH.header_from(data["meta"], TITLES[args.what])
    lines += restore_tables(data)
    RH.write_report(d / "report.md", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
