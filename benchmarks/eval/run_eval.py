"""Long-context agent evaluation: accuracy and time to first token per task x length x method.

    python benchmarks/eval/run_eval.py --method full sliding --budget 4096 2048 \\
        --lengths 4096 5120 6144 7168 16384 32768 --trials 10

Methods (every one talks to an OpenAI-compatible vLLM server over HTTP, greedy):

* `full`        plain vLLM given the whole history; only where the history
                (plus `--max-tokens`) fits `--max-model-len`, other cells are skipped.
* `sliding`     plain vLLM given the most recent history that fits `--budget`
                prompt tokens (system prompt, instruction and question always kept;
                see `tasks.sliding_window`). One cell per budget.
* `sekv-views`  the whole history, named by a `session_id`, to a server with sekv
                execution views (`--budget` = its `view_tokens`). Needs a server
                that exports the counter `vllm:sekv_views_total`; without it the run
                stops with an error instead of reporting numbers (README.md here
                states the exact interface).

Without `--url` the script starts its own server(s) on 127.0.0.1 (plain vLLM for
`full`/`sliding`; for `sekv-views` one sekv server per budget with
`kv_connector_extra_config={"view_tokens": budget}`) and stops them at the end.
Before each request it resets vLLM's prefix cache when the server allows it
(`VLLM_SERVER_DEV_MODE=1`, set for its own servers), so every time to first
token is a cold prefill of what the method sends.

Writes `<out>.json` (every trial and the per-cell summary), `<out>.md` (headed
by the machine, commit and command) and `<out>.png` (accuracy vs history length
per method and task; needs matplotlib); `<out>` is
benchmarks/results/eval_baselines/report unless `--out` says otherwise
(`--method sekv-views`: benchmarks/results/views_eval/report).
With `--merge`, trials already in `<out>.json` are kept unless re-run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tasks as tasklib  # noqa: E402
import views_eval  # noqa: E402
from eval_common import (  # noqa: E402,F401 (re-exported: the names this module has always had)
    BASELINES_OUT, RESULTS, VIEWS_COUNTER, VIEWS_OUT, VLLM_ARGS, SekvViewsUnsupported, ask, metrics,
    reset_prefix_cache, require_views, start_server)
from eval_common import H  # noqa: E402


# ---------------------------------------------------------------- one trial

def run_trial(client, model, url, task, method, budget, args, tok) -> dict:
    extra: dict = {}
    if method == "full":
        messages = task.messages
    elif method == "sliding":
        messages = tasklib.sliding_window(task.messages, tok, budget)
    else:  # sekv-views: the whole history, as an agent sends it, named by its session
        messages = task.messages
        extra["session_id"] = f"eval-{task.id}-{budget}"
    if method == "sekv-views" and args.replay_steps:
        # Earlier steps of the same session, as an agent would have sent them: the history cut
        # after evenly spaced tool turns, 1 token each, untimed. The measured step is the last.
        tool_idx = [i for i, m in enumerate(messages) if m["role"] == "tool"]
        picks = sorted({tool_idx[(k * len(tool_idx)) // (args.replay_steps + 1)]
                        for k in range(1, args.replay_steps + 1)})
        for i in picks:
            ask(client, model, messages[:i + 1], 1, extra)
    sent = [m["content"] for m in messages]
    needles_in = all(any(n in c for c in sent) for n in task.required_lines)
    if args.reset_cache:
        reset_prefix_cache(url)
    before = metrics(url) if method == "sekv-views" else {}
    try:
        out = ask(client, model, messages, args.max_tokens, extra)
    except Exception as e:  # the server refused the request: say why, never fake a number
        if method == "sekv-views":
            raise SekvViewsUnsupported(
                f"the server refused a {task.prompt_tokens}-token history for sekv-views: {e}") from e
        raise
    row = {"task": task.task, "target_tokens": task.target_tokens, "seed": task.seed,
           "method": method, "budget": budget, "history_tokens": task.prompt_tokens,
           "needles_in_prompt": needles_in, "answer": task.answer,
           "correct": tasklib.is_correct(task.answer, out["response"]), **out}
    if method == "sekv-views":
        after, deadline = metrics(url), time.monotonic() + 5.0
        while after.get(VIEWS_COUNTER, 0) <= before.get(VIEWS_COUNTER, 0) and time.monotonic() < deadline:
            time.sleep(0.2)  # metrics are published a moment after the response
            after = metrics(url)
        if after.get(VIEWS_COUNTER, 0) <= before.get(VIEWS_COUNTER, 0):
            raise SekvViewsUnsupported(
                f"the server answered {task.id} but {VIEWS_COUNTER} did not increase: "
                "the request was not served as an execution view")
        row["sekv"] = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    return row


# ---------------------------------------------------------------- reporting

def _key(row: dict) -> tuple:
    return row["task"], row["target_tokens"], row["seed"], row["method"], row["budget"]


def label(method: str, budget: int | None) -> str:
    return method if budget is None else f"{method}-{budget}"


def summarize(rows: list[dict]) -> list[dict]:
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["task"], r["target_tokens"], label(r["method"], r["budget"])), []).append(r)
    out = []
    for (task, length, meth), rs in sorted(cells.items()):
        ttft = [r["ttft_s"] * 1000 for r in rs]
        out.append({
            "task": task, "target_tokens": length, "method": meth, "n": len(rs),
            "correct": sum(r["correct"] for r in rs),
            "accuracy": round(sum(r["correct"] for r in rs) / len(rs), 3),
            "needles_in_prompt": round(sum(r["needles_in_prompt"] for r in rs) / len(rs), 3),
            "ttft_ms_mean": round(statistics.mean(ttft), 1),
            "ttft_ms_median": round(statistics.median(ttft), 1),
            "prompt_tokens_mean": round(statistics.mean(r["prompt_tokens"] or 0 for r in rs), 1),
            "history_tokens_mean": round(statistics.mean(r["history_tokens"] for r in rs), 1),
        })
        figures = sorted({k for r in rs for k in r.get("sekv", {})})
        if figures:  # per-request means of every sekv counter the server exported
            out[-1]["sekv_means"] = {k: round(statistics.mean(r.get("sekv", {}).get(k, 0.0) for r in rs), 4)
                                     for k in figures}
    return out


def write_markdown(path: Path, meta: dict, cells: list[dict]) -> None:
    methods = sorted({c["method"] for c in cells}, key=lambda m: (m.split("-")[0], -int(m.split("-")[-1]) if m[-1].isdigit() else 0))
    lengths = sorted({c["target_tokens"] for c in cells})
    by = {(c["task"], c["target_tokens"], c["method"]): c for c in cells}
    lines = [*H.header(f"Long-context agent tasks: baselines on {meta['model']}",
                       meta.get("commands") or [meta["command"]], meta["machine"], meta.get("commit", "unknown"),
                       meta["date"]),
             f"Greedy, max_tokens={meta['max_tokens']}, answer prefix: {meta['answer_prefix']}, "
             f"prefix cache reset before each request: {meta['reset_cache']}.", "",
             "Accuracy = share of trials whose reply contains the gold answer (exact substring). "
             "`needle in prompt` = share of trials in which every fact the question needs was "
             "inside what the method sent (the ceiling for a sliding window).", "",
             "## Accuracy (correct / n)", "",
             "| task | history tokens | " + " | ".join(methods) + " |",
             "|---|---|" + "---|" * len(methods)]
    for task in tasklib.TASKS:
        for length in lengths:
            row = [by.get((task, length, m)) for m in methods]
            if not any(row):
                continue
            lines.append(f"| {task} | {length} | " + " | ".join(
                f"{c['accuracy']:.2f} ({c['correct']}/{c['n']})" if c else "—" for c in row) + " |")
    lines += ["", "## Per cell", "",
              "| task | history tokens | method | n | accuracy | needle in prompt | prompt tokens sent | TTFT mean (ms) | TTFT median (ms) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(cells, key=lambda c: (tasklib.TASKS.index(c["task"]), c["target_tokens"], methods.index(c["method"]))):
        lines.append(f"| {c['task']} | {c['target_tokens']} | {c['method']} | {c['n']} | {c['accuracy']:.2f} | "
                     f"{c['needles_in_prompt']:.2f} | {c['prompt_tokens_mean']:.0f} | {c['ttft_ms_mean']:.0f} | "
                     f"{c['ttft_ms_median']:.0f} |")
    sekv_cells = [c for c in cells if c.get("sekv_means")]
    if sekv_cells:
        lines += ["", "## sekv figures (per-request means of the server's `vllm:sekv_*` counters)", ""]
        lines += [f"* {c['task']} @ {c['target_tokens']}, {c['method']}: " +
                  ", ".join(f"`{k}` {v}" for k, v in c["sekv_means"].items()) for c in sekv_cells]
    if meta.get("notes"):
        lines += ["", "## Notes", ""] + [f"* {n}" for n in meta["notes"]]
    H.write_report(path, lines)


def plot(path: Path, cells: list[dict]) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    task_names = [t for t in tasklib.TASKS if any(c["task"] == t for c in cells)]
    fig, axes = plt.subplots(1, len(task_names), figsize=(5 * len(task_names), 4), sharey=True, squeeze=False)
    for ax, task in zip(axes[0], task_names):
        for meth in sorted({c["method"] for c in cells}):
            pts = sorted((c["target_tokens"], c["accuracy"]) for c in cells if c["task"] == task and c["method"] == meth)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=meth)
        views_eval.style_accuracy_axis(ax, task)
    axes[0][0].set_ylabel("accuracy")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle("Accuracy vs history length (dotted: native window 8192)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


# ---------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", nargs="+", default=["full", "sliding"], choices=["full", "sliding", "sekv-views"])
    ap.add_argument("--budget", type=int, nargs="+", default=[4096, 2048],
                    help="prompt-token budgets of `sliding` / view budgets of `sekv-views`")
    ap.add_argument("--tasks", nargs="+", default=list(tasklib.TASKS), choices=tasklib.TASKS)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 5120, 6144, 7168, 16384, 32768])
    ap.add_argument("--trials", type=int, default=10, help="seeds per cell (0..trials-1 + --seed-offset)")
    ap.add_argument("--seed-offset", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--no-answer-prefix", action="store_true",
                    help="end the history with the question only (no assistant answer prefix)")
    ap.add_argument("--url", help="use this server (http://127.0.0.1:PORT) instead of starting one")
    ap.add_argument("--model-dir", help="model folder (default: the prepared SmolLM2)")
    ap.add_argument("--kv-space-gib", type=int, default=2)
    ap.add_argument("--server-args", default="",
                    help="extra `vllm serve` arguments for servers this script starts (one string)")
    ap.add_argument("--replay-steps", type=int, default=0,
                    help="sekv-views: send this many earlier steps of each session (untimed) first")
    ap.add_argument("--no-reset-cache", dest="reset_cache", action="store_false")
    ap.add_argument("--dtype", help="`vllm serve --dtype` of the servers this script starts "
                    "(default: vLLM's auto, bfloat16 for SmolLM2)")
    views = ap.add_argument_group("sekv-views (views_run.py; writes benchmarks/results/views_eval/report by default)")
    views.add_argument("--views-max-model-len", type=int, default=131072,
                       help="--max-model-len of the sekv server (with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)")
    views.add_argument("--views-kv-space-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE of the sekv server")
    views.add_argument("--host-bytes", default="4G", help="SEKV_HOST_BYTES of the sekv server")
    views.add_argument("--cell", action="append", default=[], metavar="TASKS:LENGTHS:BUDGETS",
                       help="sekv-views cells, e.g. passkey,multikey:16384,32768:4096 "
                            "(default: --tasks x --lengths x --budget)")
    views.add_argument("--plain-ttft", default="", metavar="TASKS:LENGTHS:TRIALS:BUDGET",
                       help="also measure a plain vLLM server (--max-model-len 8192) re-prefilling the "
                            "sliding window of BUDGET tokens, interleaved with the sekv trials, "
                            "e.g. passkey:7168,16384,32768:3:4096")
    views.add_argument("--coverage", default="", metavar="TASKS:LENGTHS:TRIALS:BUDGET",
                       help="after the servers stop, true attention mass covered by the views of these "
                            "trials (transformers, float32, CPU), e.g. passkey,multikey:4096,7168:3:2048")
    views.add_argument("--coverage-threads", type=int, default=2)
    views.add_argument("--resume", action="store_true",
                       help="keep the trials already in <out>.json and skip them (implies --merge)")
    views.add_argument("--baselines", default=str(BASELINES_OUT) + ".json",
                       help="reference rows (full, sliding-4096) for the views report")
    ap.add_argument("--out", default=str(BASELINES_OUT),
                    help="output path without suffix (default: benchmarks/results/eval_baselines/report; "
                         "with --method sekv-views: benchmarks/results/views_eval/report)")
    ap.add_argument("--merge", action="store_true", help="keep trials already in <out>.json")
    ap.add_argument("--note", action="append", default=[], help="a line for the report's notes")
    ap.add_argument("--merge-from", nargs="+", default=[], metavar="JSON",
                    help="with --report-only: add the trials of these result files (theirs win)")
    ap.add_argument("--report-only", action="store_true",
                    help="only rebuild <out>.md/.png from <out>.json (with --note: replace the notes)")
    args = ap.parse_args()
    out = Path(args.out)
    if args.report_only and args.method == ["sekv-views"]:
        import views_run
        views_run.report(args)
        return
    if args.report_only:
        data = json.loads(Path(str(out) + ".json").read_text())
        for other in args.merge_from:  # runs made on other servers, into their own files
            extra = json.loads(Path(other).read_text())
            keys = {_key(r) for r in extra["trials"]}
            data["trials"] = [r for r in data["trials"] if _key(r) not in keys] + extra["trials"]
            data["meta"]["commands"] = data["meta"].get("commands", []) + extra["meta"].get("commands", [])
            data["meta"]["command"] = " ; ".join(data["meta"]["commands"])
        data["cells"] = summarize(data["trials"])
        if args.note:
            data["meta"]["notes"] = args.note
        Path(str(out) + ".json").write_text(json.dumps(data, indent=1))
        write_markdown(Path(str(out) + ".md"), data["meta"], data["cells"])
        print(plot(Path(str(out) + ".png"), data["cells"]) or f"wrote {out}.md and {out}.png")
        return

    if "sekv-views" in args.method:
        if args.method != ["sekv-views"]:
            sys.exit("error: run --method sekv-views on its own (its report is benchmarks/results/views_eval/)")
        import views_run
        views_run.main(args)
        return

    from openai import OpenAI
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from vllm_sekv.models import prepare_model

    model_dir = args.model_dir or str(prepare_model(quiet=True))
    tok = AutoTokenizer.from_pretrained(model_dir)
    out.parent.mkdir(parents=True, exist_ok=True)

    # Work list: (method, budget) x task x length x seed; cells that cannot run are skipped.
    cache: dict[tuple, tasklib.Task] = {}

    def get_task(name, length, seed):
        if (name, length, seed) not in cache:
            cache[(name, length, seed)] = tasklib.generate(
                name, length, seed, tok, answer_prefix=not args.no_answer_prefix)
        return cache[(name, length, seed)]

    plans: list[tuple[str, int | None]] = []
    for m in args.method:
        plans += [(m, None)] if m == "full" else [(m, b) for b in args.budget]
    seeds = range(args.seed_offset, args.seed_offset + args.trials)
    work = []
    for method, budget in plans:
        for name in args.tasks:
            for length in args.lengths:
                if method == "full" and length + args.max_tokens > args.max_model_len:
                    print(f"skip full @ {length}: beyond --max-model-len {args.max_model_len}")
                    continue
                if method == "sliding" and budget >= length:
                    print(f"skip sliding-{budget} @ {length}: the budget holds the whole history (= full)")
                    continue
                work += [(method, budget, name, length, s) for s in seeds]

    rows: list[dict] = []
    servers = []
    try:
        groups = {}  # (server kind, budget) -> url
        for method, budget, *_ in work:
            key = ("sekv", budget) if method == "sekv-views" else ("plain", None)
            groups.setdefault(key, None)
        with tqdm(total=len(work), desc="eval", unit="req", dynamic_ncols=True) as bar:
            for key in groups:
                if args.url:
                    url = args.url.rstrip("/")
                else:
                    sekv = {"view_tokens": key[1]} if key[0] == "sekv" else None
                    try:
                        servers.append(start_server(model_dir, args, sekv))
                    except (RuntimeError, TimeoutError) as e:
                        if sekv is None:
                            raise
                        raise SekvViewsUnsupported(
                            f"a sekv server with view_tokens={key[1]} did not start (this build may "
                            f"have no execution views):\n{e}") from e
                    url = servers[-1].url
                client = OpenAI(base_url=url + "/v1", api_key="none", timeout=1800)
                model = client.models.list().data[0].id
                mine = [w for w in work if (("sekv", w[1]) if w[0] == "sekv-views" else ("plain", None)) == key]
                if key[0] == "sekv":
                    require_views(url)
                ask(client, model, [{"role": "user", "content": "Say hi."}], 4, {})  # warm-up
                for method, budget, name, length, seed in mine:
                    task = get_task(name, length, seed)
                    row = run_trial(client, model, url, task, method, budget, args, tok)
                    rows.append(row)
                    bar.set_postfix_str(f"{label(method, budget)} {name}@{length} "
                                        f"ok={row['correct']} ttft={row['ttft_s']*1000:.0f}ms")
                    bar.update()
                if servers:
                    servers[-1].stop()
    except SekvViewsUnsupported as e:
        sys.exit(f"error: {e}")
    finally:
        for s in servers:
            s.stop()

    old = json.loads(Path(str(out) + ".json").read_text())["trials"] if args.merge and Path(str(out) + ".json").exists() else []
    done = {_key(r) for r in rows}
    rows = [r for r in old if _key(r) not in done] + rows
    cells = summarize(rows)
    prev_meta = json.loads(Path(str(out) + ".json").read_text())["meta"] if old else {}
    command = H.command(__file__)
    meta = {"command": command, "commands": prev_meta.get("commands", []) + [command],
            "machine": H.machine(), "commit": H.commit(),
            "model": Path(model_dir).name, "max_tokens": args.max_tokens,
            "max_model_len": args.max_model_len, "answer_prefix": not args.no_answer_prefix,
            "reset_cache": args.reset_cache, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "notes": prev_meta.get("notes", []) + [n for n in args.note if n not in prev_meta.get("notes", [])]}
    if len(meta["commands"]) > 1:
        meta["command"] = " ; ".join(meta["commands"])
    Path(str(out) + ".json").write_text(json.dumps({"meta": meta, "cells": cells, "trials": rows}, indent=1))
    write_markdown(Path(str(out) + ".md"), meta, cells)
    skipped = plot(Path(str(out) + ".png"), cells)
    print(Path(str(out) + ".md").read_text())
    if skipped:
        print(skipped)


if __name__ == "__main__":
    main()
