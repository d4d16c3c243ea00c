"""SeKV evaluation: sekv server configurations at an equal view budget.

    .venv/bin/python benchmarks/eval/sekv_eval.py --tasks passkey,multikey,vartrack --lengths 16384 \\
        --budget 2048 --seeds 0-4 [--configs meank,views,sekv] [--resume]
    .venv/bin/python benchmarks/eval/sekv_eval.py --report-only

Each configuration (`CONFIGS`) is one sekv server (`kv_connector_extra_config` =
`{"view_tokens": --budget, **config}`), started once with the flags of the views
run (`views_run.py`: `--max-model-len 131072`, `VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`,
`SEKV_HOST_BYTES`, `VLLM_CPU_KVCACHE_SPACE`, run_eval's `VLLM_ARGS`), then every
trial (task x length x seed) runs on it exactly as a `sekv-views` trial of the
views run (`views_run.sekv_trial`: earlier replay steps, the measured streamed
step with TTFT and the change of the `vllm:sekv_*` counters, a non-streamed
repeat whose `kv_transfer_params.sekv.view` gives the selected blocks), then the
server stops. A server that does not start, or a trial that fails, is recorded
(`meta.failures`, the Markdown) and the other configurations still run.

Derived per trial (`derive`):
* view GPU memory = (view tokens + coarse summaries) x bytes of one token's KV
  (2 x layers x KV heads x head_dim x dtype bytes, from the model's config.json);
* bytes moved per step = `vllm:sekv_restored_bytes_total` + `vllm:sekv_summary_bytes_total`
  deltas; where the server exports no restored-bytes counter, restored tokens x
  bytes per token (marked in the row and the Markdown).

Writes `<out-prefix>.json` after every trial (`--resume` skips the (config, task,
length, seed) rows already there), then `<out-prefix>.md` (headed by the
machine, commit and commands) and `<out-prefix>.png`. The default prefix is
benchmarks/results/sekv_eval/<lengths>, e.g. `16k` for `--lengths 16384`.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_common as R  # noqa: E402
import tasks as tasklib  # noqa: E402
import views_run as VR  # noqa: E402
from eval_common import H  # noqa: E402

RESULTS = R.SEKV_EVAL_DIR
DEFAULT_ROUTER = R.ROUTER
MIB = 1 << 20
REFERENCES = ("meank", "views")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
C_RESTORED_TOKENS = "vllm:sekv_restored_tokens_total"
C_RESTORED_BYTES = "vllm:sekv_restored_bytes_total"
C_SUMMARY_BYTES = "vllm:sekv_summary_bytes_total"
C_RESTORE_SECONDS = "vllm:sekv_restore_seconds_total"
COUNTERS = (C_RESTORED_TOKENS, C_RESTORED_BYTES, C_SUMMARY_BYTES, C_RESTORE_SECONDS)


def configs(router_path: str) -> dict[str, dict]:
    """The compared server configurations (`kv_connector_extra_config` without `view_tokens`)."""
    sekv = {"surprisal": "on", "coarse": "on", "router_path": router_path}
    return {
        "meank": {"index_summary": "mean_pre", "index_combine": "mean"},  # KVMEM's Mean-K block views
        "views": {},                                                       # default views: sub4_pre / max
        "sekv": sekv,                                                      # full SeKV (anchors by default)
        "sekv-nosum": {"surprisal": "on", "router_path": router_path},
        "sekv-norouter": {"surprisal": "on", "coarse": "on", "index_summary": "sub8a_pre", "index_combine": "max"},
        **{f"sekv-lr{r}": {**sekv, "restore_codec": f"lowrank({r})"} for r in (8, 16, 32)},
        "sekv-lrtier": {**sekv, "restore_codec": "router"},               # ranks from the router's tiers
    }


CONFIG_NAMES = tuple(configs(""))


# ---------------------------------------------------------------- inputs

def parse_seeds(spec: str) -> list[int]:
    """`0-4` -> [0..4]; `0,3,7-9` -> [0, 3, 7, 8, 9]."""
    out: list[int] = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return sorted(set(out))


def parse_list(spec: str, allowed: tuple[str, ...], what: str) -> list[str]:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in allowed]
    if bad:
        raise SystemExit(f"error: unknown {what} {', '.join(bad)}; choose from {', '.join(allowed)}")
    return names


def kv_geometry(model_dir: str, dtype: str) -> dict:
    """Bytes of one token's K and V over all layers, from the model's config.json."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    geo = {"layers": cfg["num_hidden_layers"], "kv_heads": cfg.get("num_key_value_heads", heads),
           "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads, "dtype": dtype,
           "dtype_bytes": DTYPE_BYTES[dtype]}
    geo["bytes_per_token"] = 2 * geo["layers"] * geo["kv_heads"] * geo["head_dim"] * geo["dtype_bytes"]
    return geo


# ---------------------------------------------------------------- derived figures

def derive(row: dict, bytes_per_token: int) -> dict:
    """View GPU memory and bytes moved per step of one trial (absent counters count 0)."""
    d, view = row.get("sekv", {}), row.get("view") or {}
    summaries = int(view.get("summaries") or 0)
    restored_tokens = d.get(C_RESTORED_TOKENS, 0.0)
    if C_RESTORED_BYTES in row.get("counters_exported", []):
        restored_bytes, source = d.get(C_RESTORED_BYTES, 0.0), "counter"
    else:  # the server has no byte counter: what the restored tokens weigh uncompressed
        restored_bytes, source = restored_tokens * bytes_per_token, "restored_tokens x bytes/token"
    summary_bytes = d.get(C_SUMMARY_BYTES, 0.0)
    return {"summaries": summaries, "anchor_tokens": int(view.get("anchor_tokens") or 0),
            "view_gpu_bytes": (row["view_tokens"] + summaries) * bytes_per_token,
            "restored_tokens": restored_tokens, "restored_bytes": restored_bytes,
            "summary_bytes": summary_bytes, "bytes_moved": restored_bytes + summary_bytes,
            "bytes_moved_source": source, "restore_s": d.get(C_RESTORE_SECONDS, 0.0)}


# ---------------------------------------------------------------- results file

def _key(row: dict) -> tuple:
    return row["config"], row["task"], row["target_tokens"], row["seed"]


class Results:
    """`<prefix>.json`: meta + every trial, rewritten after each change."""

    def __init__(self, prefix: Path, resume: bool) -> None:
        self.path = Path(str(prefix) + ".json")
        old = json.loads(self.path.read_text()) if resume and self.path.exists() else {}
        self.meta: dict = old.get("meta", {})
        self.rows: list[dict] = old.get("trials", [])

    def done(self) -> set[tuple]:
        return {_key(r) for r in self.rows}

    def add(self, row: dict) -> None:
        self.rows = [r for r in self.rows if _key(r) != _key(row)] + [row]
        self.save()

    def clear_failures(self, config: str) -> None:
        """A fresh server of `config` supersedes its earlier failures."""
        self.meta["failures"] = [f for f in self.meta.get("failures", []) if f["config"] != config]
        self.save()

    def fail(self, config: str, where: str, err: BaseException, log_tail: str = "") -> str:
        head = headline(err)
        self.meta.setdefault("failures", []).append(
            {"config": config, "where": where, "error": head, "detail": (str(err) + "\n" + log_tail)[-3000:],
             "date": _now()})
        self.save()
        return head

    def save(self, stamp: bool = True) -> None:
        if stamp:  # a report written again from the JSON keeps the run's last date
            self.meta["date"] = _now()
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"meta": self.meta, "trials": self.rows}, indent=1))
        tmp.replace(self.path)


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def headline(err: BaseException) -> str:
    """The line of a failure that says why (a sekv config error if the log has one)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    for marker in ("sekv config", "Error", "error"):
        hits = [ln for ln in lines if marker in ln]
        if hits:
            return f"{type(err).__name__}: {hits[-1][:400]}"
    return f"{type(err).__name__}: {(lines[-1] if lines else '')[:400]}"


# ---------------------------------------------------------------- one configuration

def start_server(name: str, extra: dict, model_dir: str, args):
    """One sekv server with the views run's flags; `kv_connector_extra_config` = budget + `extra`."""
    env = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", "SEKV_HOST_BYTES": args.host_bytes}
    print(f"[{name}] kv_connector_extra_config {json.dumps(extra)}", flush=True)
    server = R.start_server(model_dir, args, {"view_tokens": args.budget, **extra},
                            max_model_len=args.max_model_len, env=env)
    return server, {"cmd": shlex.join(server.cmd[1:]), "env": {
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space_gib), "VLLM_SERVER_DEV_MODE": "1", **env}}


def warm_up(url: str, client, model: str, tok) -> None:
    """A plain request, then the view path (probe + restore + final) on a throwaway session."""
    R.ask(client, model, [{"role": "user", "content": "Say hi."}], 4, {})
    warm = tasklib.generate("passkey", 2048, 999, tok)
    VR.ask_once(url, model, warm.messages, 4, {"session_id": "warmup", "cache_salt": "warmup",
                                               "kv_transfer_params": {"view_tokens": 1024}})


def progress(row: dict, trial_s: float, t_start: float) -> None:
    print(f"[{row['config']}] {row['task']} @ {row['target_tokens']} seed {row['seed']}: "
          f"correct={row['correct']} ttft={row['ttft_s'] * 1000:.0f} ms needle={row.get('needle_selected')} "
          f"view={row['view_tokens']} tok +{row['summaries']} summ, moved {row['bytes_moved'] / MIB:.2f} MiB "
          f"(trial {trial_s:.0f} s, elapsed {time.perf_counter() - t_start:.0f} s)", flush=True)


def run_config(name: str, extra: dict, work: list[tuple], tasks: dict, ctx: dict, res: Results) -> None:
    """Start the server of one configuration, run its trials, stop it. Failures are recorded."""
    from openai import OpenAI

    args, tok, geo = ctx["args"], ctx["tok"], ctx["geometry"]
    try:
        server, info = start_server(name, extra, ctx["model_dir"], args)
    except (RuntimeError, TimeoutError) as e:
        print(f"[{name}] SERVER DID NOT START: {res.fail(name, 'server start', e)}; next configuration",
              flush=True)
        return
    res.clear_failures(name)
    consecutive = 0
    try:
        R.require_views(server.url)
        exported = sorted(k for k in R.metrics(server.url) if k in COUNTERS)
        res.meta.setdefault("servers", {})[name] = {**info, "counters_exported": exported}
        client = OpenAI(base_url=server.url + "/v1", api_key="none", timeout=3600)
        model = client.models.list().data[0].id
        warm_up(server.url, client, model, tok)
        for task_name, length, seed in work:
            t0 = time.perf_counter()
            try:
                row = VR.sekv_trial(server.url, model, tasks[(task_name, length, seed)], args.budget, args,
                                    tok, client)
            except Exception as e:  # noqa: BLE001 - recorded; the next trial or config still runs
                head = res.fail(name, f"{task_name}@{length}/seed {seed}", e, server.log_tail(1500))
                print(f"[{name}] TRIAL FAILED {task_name} @ {length} seed {seed}: {head}", flush=True)
                consecutive += 1
                if server.proc.poll() is not None or consecutive >= 2:
                    print(f"[{name}] stopping this configuration "
                          f"({'server exited' if server.proc.poll() is not None else '2 failures in a row'})",
                          flush=True)
                    break
                continue
            consecutive = 0
            row.update(config=name, extra_config=extra, counters_exported=exported,
                       trial_s=round(time.perf_counter() - t0, 2), finished=_now(),
                       loadavg_1m=round(os.getloadavg()[0], 2))
            row.update(derive(row, geo["bytes_per_token"]))
            res.add(row)
            progress(row, row["trial_s"], ctx["t_start"])
    except Exception as e:  # noqa: BLE001 - setup of this server failed (no views, no model, ...)
        print(f"[{name}] FAILED: {res.fail(name, 'server setup', e, server.log_tail(1500))}", flush=True)
    finally:
        server.stop()


# ---------------------------------------------------------------- report

def _ordered(names) -> list[str]:
    return sorted(set(names), key=lambda n: (CONFIG_NAMES.index(n) if n in CONFIG_NAMES else 99, n))


def cell(rows: list[dict]) -> dict:
    """Accuracy, needle selected, means of TTFT, view memory, bytes moved, summaries."""
    def mean(key):
        return statistics.mean(r[key] for r in rows)
    return {"n": len(rows), "correct": sum(r["correct"] for r in rows),
            "needle": sum(bool(r.get("needle_selected")) for r in rows),
            "ttft_ms": 1000 * mean("ttft_s"), "view_mib": mean("view_gpu_bytes") / MIB,
            "moved_mib": mean("bytes_moved") / MIB, "summaries": mean("summaries"),
            "fallback": sum(r["bytes_moved_source"] != "counter" for r in rows)}


def _table(rows: list[dict]) -> list[str]:
    out = ["| config | accuracy (k/n) | needle selected | mean TTFT (ms) | view GPU memory (MiB) | "
           "bytes moved per step (MiB) | summaries |", "|---|---|---|---|---|---|---|"]
    for name in _ordered(r["config"] for r in rows):
        c = cell([r for r in rows if r["config"] == name])
        mark = "*" if c["fallback"] else ""
        out.append(f"| {name} | {c['correct'] / c['n']:.2f} ({c['correct']}/{c['n']}) | {c['needle']}/{c['n']} | "
                   f"{c['ttft_ms']:.0f} | {c['view_mib']:.1f} | {c['moved_mib']:.2f}{mark} | {c['summaries']:.1f} |")
    return out


def paired(rows: list[dict], name: str, ref: str) -> str | None:
    """Trials won / lost by `name` against `ref` on the same (task, length, seed)."""
    mine = {_key(r)[1:]: r["correct"] for r in rows if r["config"] == name}
    theirs = {_key(r)[1:]: r["correct"] for r in rows if r["config"] == ref}
    both = sorted(set(mine) & set(theirs))
    if not both:
        return None
    won = [k for k in both if mine[k] and not theirs[k]]
    lost = [k for k in both if theirs[k] and not mine[k]]

    def names(ks):
        return ", ".join(f"{t}@{n}/s{s}" for t, n, s in ks) or "none"
    return (f"| {name} | {ref} | {len(both)} | {len(won)} ({names(won)}) | {len(lost)} ({names(lost)}) | "
            f"{len(both) - len(won) - len(lost)} |")


def _exported(server: dict | None) -> str:
    if server is None:
        return "not started"
    return ", ".join(f"`{c.split(':')[1]}`" for c in server["counters_exported"]) or "none of the four"


def write_markdown(path: Path, meta: dict, rows: list[dict]) -> None:
    geo = meta["geometry"]
    seeds = sorted({r["seed"] for r in rows})
    loads = [r["loadavg_1m"] for r in rows if "loadavg_1m" in r]
    L = H.header("SeKV evaluation: server configurations at an equal view budget",
                 [f".venv/bin/{c}" for c in meta["commands"]], meta["machine"], meta.get("commit", "unknown"),
                 f"{meta.get('started')} – {meta.get('date')}")
    L += [f"vLLM {meta.get('vllm', '?')}, "
         f"model {meta['model']}, dtype {geo['dtype']}, greedy, max_tokens={meta['max_tokens']}, answer prefix: "
         f"True, prefix cache reset before each timed request: {meta['reset_cache']}, "
         f"{meta['replay_steps']} earlier replay steps per trial, view budget **{meta['budget']} tokens** "
         f"for every configuration (`view_tokens`).", ""]
    if loads:
        L += [f"1-minute load average at the end of each trial: min {min(loads):.1f}, median "
              f"{statistics.median(loads):.1f}, max {max(loads):.1f} (2 cores shared with other jobs: "
              "compare TTFT only within this run).", ""]
    L += ["Every figure below was measured in this run (no number is taken from another file), over "
          f"seeds {', '.join(map(str, seeds)) or '—'} per (task, length). With so few trials per cell, "
          "differences of one or two trials between configurations are noise.", ""]
    L += ["## Configurations", "",
          "Each one sekv server, started once for all its trials; `kv_connector_extra_config` = "
          f"`{{\"view_tokens\": {meta['budget']}}}` plus:", "",
          "| config | extra config | counters of interest the server exported |", "|---|---|---|"]
    for name in _ordered(meta["configs"]):
        srv = meta.get("servers", {}).get(name)
        L.append(f"| {name} | `{json.dumps(meta['configs'][name])}` | "
                 f"{_exported(srv)} |")
    srv = next(iter(meta.get("servers", {}).values()), None)
    if srv:
        L += ["", "Server command (shown for one config; the others differ only in the extra config and port):",
              "", "    " + " ".join(f"{k}={v}" for k, v in srv["env"].items()) + " python " + srv["cmd"]]
    L += ["", "## Figures", "",
          "* **accuracy**: the measured step's reply contains the gold answer (`tasks.is_correct`).",
          "* **needle selected**: every 32-token block of at least one occurrence of the gold answer is in the "
          "view of the repeated step (`views_eval.needle_checks`, as in the views run).",
          "* **mean TTFT**: the measured (streamed) step, prefix cache reset before it: probe + restore + prefill.",
          f"* **view GPU memory** = (view tokens + coarse summaries) x {geo['bytes_per_token']:,} B per token "
          f"(2 x {geo['layers']} layers x {geo['kv_heads']} KV heads x head_dim {geo['head_dim']} x "
          f"{geo['dtype_bytes']} B, from the model's config.json). View tokens and summaries: the repeated step's "
          "`kv_transfer_params.sekv.view` (`view_tokens`, `summaries`; no `summaries` = 0).",
          "* **bytes moved per step** = change over the measured step of `vllm:sekv_restored_bytes_total` "
          "(host → device for restores) + `vllm:sekv_summary_bytes_total` (coarse summaries to the device); "
          "a counter that did not change, or that the server does not export, counts 0."]
    fb = sorted({r["config"] for r in rows if r["bytes_moved_source"] != "counter"})
    if fb:
        L += [f"* **\\*** Where marked, the server exported no `vllm:sekv_restored_bytes_total` "
              f"(configs: {', '.join(fb)}): restored bytes are `vllm:sekv_restored_tokens_total` x "
              f"{geo['bytes_per_token']:,} B, the uncompressed KV of the restored tokens."]
    for task in tasklib.TASKS:
        for length in sorted({r["target_tokens"] for r in rows}):
            sel = [r for r in rows if r["task"] == task and r["target_tokens"] == length]
            if sel:
                L += ["", f"## {task} @ {length} history tokens", ""] + _table(sel)
    if rows:
        tl = sorted({r["task"] for r in rows}, key=tasklib.TASKS.index)
        L += ["", f"## Pooled over tasks ({', '.join(tl)}) and lengths "
              f"({', '.join(map(str, sorted({r['target_tokens'] for r in rows})))})", ""] + _table(rows)
        names = _ordered(r["config"] for r in rows)
        pairs = [(n, ref) for i, ref in enumerate(REFERENCES) for n in names
                 if n != ref and n not in REFERENCES[:i]]  # each pair once
        lines = [p for n, ref in pairs for p in [paired(rows, n, ref)] if p]
        if lines:
            L += ["", "## Paired comparisons (same task, length and seed)", "",
                  "Won: this config right and the reference wrong; lost: the opposite (trials listed as "
                  "task@length/seed).", "",
                  "| config | vs | paired trials | won | lost | same |", "|---|---|---|---|---|---|"] + lines
    fails = meta.get("failures", [])
    if fails:
        L += ["", "## Failures (recorded, not counted in any figure)", ""]
        L += [f"* **{f['config']}**, {f['where']} ({f['date']}): `{f['error']}`" for f in fails]
    if meta.get("plot_note"):
        L += ["", f"Plot: {meta['plot_note']}"]
    H.write_report(path, L)


def plot(path: Path, rows: list[dict]) -> str | None:
    """Pooled accuracy per config (bars) and bytes moved per step (second panel)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    names = _ordered(r["config"] for r in rows)
    if not names:
        return "no trials: no plot"
    cells = [cell([r for r in rows if r["config"] == n]) for n in names]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(max(6, 1.1 * len(names) + 2), 6.5), sharex=True)
    acc = [c["correct"] / c["n"] for c in cells]
    a1.bar(names, acc, color="tab:blue")
    for i, c in enumerate(cells):
        a1.text(i, acc[i] + 0.02, f"{c['correct']}/{c['n']}", ha="center", fontsize=8)
    a1.set_ylim(0, 1.12)
    a1.set_ylabel("accuracy (pooled)")
    a1.grid(axis="y", alpha=0.3)
    a2.bar(names, [c["moved_mib"] for c in cells], color="tab:orange", linewidth=1.5,
           edgecolor=["k" if c["fallback"] else "none" for c in cells])
    a2.set_ylabel("bytes moved per step (MiB)")
    a2.grid(axis="y", alpha=0.3)
    a2.tick_params(axis="x", rotation=30)
    fig.suptitle("SeKV configurations at an equal view budget\n(black edge: bytes = restored tokens x bytes/token)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def report(prefix: Path) -> None:
    """Rebuild the derived figures, `<prefix>.md` and `<prefix>.png` from `<prefix>.json`."""
    res = Results(prefix, resume=True)
    if not res.path.exists():
        raise SystemExit(f"error: {res.path} does not exist")
    for r in res.rows:
        r.update(derive(r, res.meta["geometry"]["bytes_per_token"]))
    res.meta["plot_note"] = plot(Path(str(prefix) + ".png"), res.rows)
    res.save(stamp=False)
    write_markdown(Path(str(prefix) + ".md"), res.meta, res.rows)
    print(f"wrote {prefix}.md" + (f" ({res.meta['plot_note']})" if res.meta["plot_note"] else f" and {prefix}.png"))


# ---------------------------------------------------------------- main

def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default=",".join(tasklib.TASKS), help="comma-separated (default: all)")
    ap.add_argument("--lengths", default="16384", help="history lengths in tokens, comma-separated")
    ap.add_argument("--budget", type=int, default=2048, help="view budget (view_tokens) of every config")
    ap.add_argument("--seeds", default="0-4", help="e.g. 0-4 or 0,2,5")
    ap.add_argument("--configs", default=",".join(CONFIG_NAMES), help=f"subset of {', '.join(CONFIG_NAMES)}")
    ap.add_argument("--router-path", default=str(DEFAULT_ROUTER), help="router file of the sekv configs")
    ap.add_argument("--out-prefix", help="output path without suffix (default: "
                    "benchmarks/results/sekv_eval/<lengths>, e.g. 16k)")
    ap.add_argument("--resume", action="store_true", help="keep <out-prefix>.json's trials and skip them")
    ap.add_argument("--report-only", action="store_true", help="only rebuild .md and .png from the JSON")
    ap.add_argument("--replay-steps", type=int, default=3, help="earlier steps per trial (views run: 3)")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--no-reset-cache", dest="reset_cache", action="store_false")
    ap.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPE_BYTES))
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--kv-space-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE of each server")
    ap.add_argument("--host-bytes", default="4G", help="SEKV_HOST_BYTES of each server")
    ap.add_argument("--server-args", default="", help="extra `vllm serve` arguments (one string)")
    ap.add_argument("--model-dir", help="model folder (default: the prepared SmolLM2)")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    prefix = Path(args.out_prefix or RESULTS / "_".join(f"{int(n) // 1024}k" for n in args.lengths.split(",")))
    if args.report_only:
        report(prefix)
        return
    from transformers import AutoTokenizer

    from vllm_sekv.models import prepare_model

    task_names = parse_list(args.tasks, tasklib.TASKS, "task")
    all_configs = configs(str(Path(args.router_path).resolve()))
    chosen = parse_list(args.configs, CONFIG_NAMES, "config")
    lengths, seeds = [int(x) for x in args.lengths.split(",")], parse_seeds(args.seeds)
    model_dir = args.model_dir or str(prepare_model(quiet=True))
    tok = AutoTokenizer.from_pretrained(model_dir)
    prefix.parent.mkdir(parents=True, exist_ok=True)

    res = Results(prefix, args.resume)
    if res.meta.get("budget") not in (None, args.budget):
        raise SystemExit(f"error: {res.path} was run with --budget {res.meta['budget']}; configs are compared "
                         "at one budget (use another --out-prefix)")
    res.meta.update({
        "commands": res.meta.get("commands", []) + [H.command(__file__)],
        "machine": VR._machine(), "commit": H.commit(), "model": Path(model_dir).name, "budget": args.budget,
        "max_tokens": args.max_tokens, "reset_cache": args.reset_cache, "replay_steps": args.replay_steps,
        "max_model_len": args.max_model_len, "host_bytes": args.host_bytes, "kv_space_gib": args.kv_space_gib,
        "geometry": kv_geometry(model_dir, args.dtype), "started": res.meta.get("started") or _now(),
        "configs": {**res.meta.get("configs", {}), **{n: all_configs[n] for n in chosen}}})
    try:
        res.meta["vllm"] = __import__("vllm").__version__
    except Exception:  # noqa: BLE001
        pass
    res.save()

    done = res.done()
    plan = {n: [(t, length, s) for length in lengths for t in task_names for s in seeds
                if (n, t, length, s) not in done] for n in chosen}
    print(f"{sum(map(len, plan.values()))} trials to run: " +
          ", ".join(f"{n} {len(w)}" for n, w in plan.items()), flush=True)
    tasks = {w: tasklib.generate(w[0], w[1], w[2], tok) for w in sorted({w for ws in plan.values() for w in ws})}
    ctx = {"args": args, "tok": tok, "model_dir": model_dir, "geometry": res.meta["geometry"],
           "t_start": time.perf_counter()}
    for name in chosen:
        if plan[name]:
            run_config(name, all_configs[name], plan[name], tasks, ctx, res)
    report(prefix)


if __name__ == "__main__":
    main()
