"""The fidelity report: trial lines (`run.py --out`) -> summary.json, report.md, accuracy.png.

    python benchmarks/fidelity/report.py TRIALS.jsonl [MORE.jsonl ...] [--out-dir benchmarks/results/fidelity]

One cell per (family, history tokens, method, budget): n trials, correct,
accuracy with a 95% Wilson interval, the share of trials whose prompt or view
held the answer, the median time to first token and bytes moved per step,
the median device KV per step (the tokens whose K/V the step held on the
GPU: the prompt for text methods, the final view for views), and for views
the median time from admission to the final pass.
`summary.json` is `{"model", "commit", "rows": [...]}` with one row per
cell (`task`, `history_tokens`, `method`, `view_tokens`, `n`, `correct`,
`accuracy`, `ci95`, `answer_in_view`, `ttft_s_median`, `bytes_moved_median`,
and `device_kv_tokens_median`, `final_pass_at_s_median`, `later_questions`
beside them);
"all" rows pool the families. A trial is one (family, history tokens, seed,
question, method): where several files hold it, the last file's line counts
(a rerun of the same session is not a new sample). Run headers (`<trials>.meta.json`, written by
run.py: machine, commit, command) make the Markdown's header, with this
command last. `accuracy.png` plots accuracy against history length for the
headline methods (`PLOTTED`), one panel per family and one pooled.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import report_header as H  # noqa: E402

ORDER = ("full", "sliding", "rag", "oracle", "views", "meank", "sekv")
# The plot's methods: the baselines, the views by default, re-ranked (restored and recomputed in
# order), the configuration of the project README's "Views that keep answers right", KVMEM's Mean-K
# and SeKV; every cell of every method is in report.md and summary.json.
BEST_VIEW = "views-rerank-rh-lexhop-hop3-sel32-psg8-lines-drop-rcall-ord"
PLOTTED = ("full", "sliding", "rag", "oracle", "views", "views-rerank", "views-rerank-rcall-ord", BEST_VIEW, "meank",
           "sekv")
PLOT_NAMES = {BEST_VIEW: "views, best configuration"}


def read_trials(paths) -> dict[tuple, dict]:
    """The trial lines of `paths`, keyed by (family, history tokens, seed,
    question, method): a trial found in several files counts once, from the
    last of them."""
    by_trial = {}
    for path in map(Path, paths):
        for line in path.read_text().splitlines():
            if line.strip():
                t = json.loads(line)
                by_trial[(t["family"], t["history_tokens"], t["seed"], t["question"], t["method"])] = t
    return by_trial


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of k successes in n trials."""
    if n == 0:
        return (0.0, 0.0)
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (round(max(0.0, mid - half), 4), round(min(1.0, mid + half), 4))


def _method_key(method: str) -> tuple:
    name, _, budget = method.partition(":")
    base = name.split("-")[0]
    return (ORDER.index(base) if base in ORDER else len(ORDER), name, -int(budget or 0))


def cells(trials: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for t in trials:
        groups[(t["family"], t["history_tokens"], t["method"])].append(t)
        groups[("all", t["history_tokens"], t["method"])].append(t)
    rows = []
    for (family, length, method), ts in groups.items():
        n, k = len(ts), sum(bool(t["correct"]) for t in ts)
        held = [t["answer_in_view"] for t in ts if t["answer_in_view"] is not None]
        ttft = [t["ttft_s"] for t in ts if t.get("ttft_s") is not None]
        moved = [t.get("bytes_moved") or 0 for t in ts]
        device = [t.get("view_tokens") or t["prompt_tokens"] for t in ts]
        final_at = [p[1] for t in ts for p in t.get("pass_seconds") or () if p[0] == "final"]
        later = [t for t in ts if t["question"] > 0]
        rows.append({
            "task": family, "history_tokens": length, "method": method.split(":")[0],
            "view_tokens": ts[0].get("budget"), "n": n, "correct": k, "accuracy": round(k / n, 4),
            "ci95": list(wilson(k, n)),
            "answer_in_view": round(sum(held) / len(held), 4) if held else None,
            "ttft_s_median": round(statistics.median(ttft), 4) if ttft else None,
            "bytes_moved_median": int(statistics.median(moved)) if moved else 0,
            "device_kv_tokens_median": int(statistics.median(device)),
            "final_pass_at_s_median": round(statistics.median(final_at), 4) if final_at else None,
            "later_questions": {"n": len(later), "correct": sum(bool(t["correct"]) for t in later)},
        })
    rows.sort(key=lambda r: (r["task"] == "all", r["task"], r["history_tokens"],
                             _method_key(f"{r['method']}:{r['view_tokens'] or ''}")))
    return rows


def run_header(metas: list[dict], report_command: str) -> dict:
    """The runs' machines, commits, dates and commands, then the command that made this report."""
    def joined(key: str) -> str:
        return "; ".join(dict.fromkeys(str(m[key]) for m in metas if m.get(key))) or "?"
    vllm = joined("vllm")
    return {"machine": joined("machine") + (f" (vLLM {vllm})" if vllm != "?" else ""), "commit": joined("commit"),
            "date": joined("date"), "commands": [m["command"] for m in metas if m.get("command")] + [report_command]}


def markdown(rows: list[dict], metas: list[dict], model: str, report_command: str) -> list[str]:
    out = [*H.header_from(run_header(metas, report_command), "Fidelity: do views keep an agent's answers right?"),
           f"Model: {model}. Each trial is one question of a multi-question agent session "
           "(`benchmarks/fidelity/sessions.py`); accuracy with a 95% Wilson interval; "
           "\"in view\": the share of trials whose prompt (text methods) or view held the answer's "
           "evidence; TTFT: vLLM's own time to first token, median; moved: bytes restored to the "
           "device per step, median (views); device KV: the tokens whose K/V the step held on the GPU "
           "(the prompt for text methods, the final view for views; no pass of a view holds more than its "
           "budget), median, in thousands of tokens; final at: seconds from the connector's admission of the "
           "request to its final pass (the probe's and any ingest's time), median, from the responses' "
           "`pass_seconds` (runs that recorded them).", ""]
    for length in sorted({r["history_tokens"] for r in rows}):
        out += [f"## {length} history tokens", "",
                "| task | method | budget | n | accuracy | 95% CI | later questions | in view | TTFT s | final at s "
                "| moved MB | device KV |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r["history_tokens"] != length:
                continue
            later = r["later_questions"]
            out.append(
                f"| {r['task']} | {r['method']} | {r['view_tokens'] or '-'} | {r['n']} | "
                f"{r['accuracy']:.2f} | {r['ci95'][0]:.2f}-{r['ci95'][1]:.2f} | "
                f"{later['correct']}/{later['n']} | "
                f"{'-' if r['answer_in_view'] is None else format(r['answer_in_view'], '.2f')} | "
                f"{'-' if r['ttft_s_median'] is None else format(r['ttft_s_median'], '.3f')} | "
                f"{'-' if r['final_pass_at_s_median'] is None else format(r['final_pass_at_s_median'], '.3f')} | "
                f"{r['bytes_moved_median'] / 1e6:.0f} | {r['device_kv_tokens_median'] / 1000:.1f}K |")
        out.append("")
    return out


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in rows if r["method"] in PLOTTED]
    tasks = sorted({r["task"] for r in rows}, key=lambda t: (t == "all", t))
    def label(r: dict) -> str:
        return PLOT_NAMES.get(r["method"], r["method"]) + (f" {r['view_tokens']}" if r["view_tokens"] else "")

    keys = {label(r): _method_key(f"{r['method']}:{r['view_tokens'] or ''}") for r in rows}
    labels = sorted(keys, key=keys.get)
    colors = plt.get_cmap("tab20").colors
    style = {x: (colors[i % len(colors)], "osD^v<>"[i // len(colors) % 7]) for i, x in enumerate(labels)}
    cols = 4
    fig, axes = plt.subplots(-(-len(tasks) // cols), cols, figsize=(4.2 * cols, 3.4 * -(-len(tasks) // cols) + 2.2),
                             squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        series: dict[str, list] = defaultdict(list)
        for r in rows:
            if r["task"] == task:
                series[label(r)].append(r)
        for name, rs in series.items():
            rs.sort(key=lambda r: r["history_tokens"])
            xs = [r["history_tokens"] for r in rs]
            ys = [r["accuracy"] for r in rs]
            err = [[y - r["ci95"][0] for y, r in zip(ys, rs)], [r["ci95"][1] - y for y, r in zip(ys, rs)]]
            color, marker = style[name]
            ax.errorbar(xs, ys, yerr=err, marker=marker, color=color, capsize=3, label=name)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(task)
        ax.set_xlabel("history tokens")
        ax.set_ylabel("accuracy")
        ax.axvline(32768, color="grey", lw=0.6, ls=":")  # the model's native window
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color=style[x][0], marker=style[x][1]) for x in labels]
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 2.0 / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trials", nargs="+")
    p.add_argument("--out-dir", default=str(H.results_dir("fidelity")))
    args = p.parse_args(argv)
    metas = []
    for path in map(Path, args.trials):
        meta_path = path.with_suffix(".meta.json")
        if meta_path.exists():
            metas += json.loads(meta_path.read_text())
    trials = list(read_trials(args.trials).values())
    rows = cells(trials)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = metas[-1].get("model", "?") if metas else "?"
    commit = metas[-1].get("commit", "?") if metas else "?"
    (out / "summary.json").write_text(json.dumps({"model": model, "commit": commit, "rows": rows}, indent=1) + "\n")
    H.write_report(out / "report.md", markdown(rows, metas, model, H.command(__file__, argv)))
    plotted = plot(rows, out / "accuracy.png")
    print(f"{len(trials)} trials, {len(rows)} cells -> {out}/summary.json, report.md"
          + (", accuracy.png" if plotted else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
