"""The `sekv-views` run of run_eval.py (called from there: `--method sekv-views`).

One sekv server serves every budget: `--max-model-len --views-max-model-len`
(VLLM_ALLOW_LONG_MAX_MODEL_LEN=1), `view_tokens` = the largest budget; each
request asks for its own budget (`kv_transfer_params={"view_tokens": B}`),
with `cache_salt="budget-B"` (budgets never share workspace blocks) and
`session_id="eval-<task>-<length>-<seed>-<B>"`.

Per trial:

1. `--replay-steps K` earlier steps of the session, untimed, `max_tokens=1`:
   the history cut after K evenly spaced tool turns, the last of them the
   final tool turn, so the measured step adds only the question.
2. The measured step: the prefix cache is reset, the whole history streamed
   (TTFT = first content chunk); the change of every `vllm:sekv_*` counter
   over it is stored (`sekv`: probes, views, restored tokens, restore seconds).
   `vllm:sekv_views_total` must grow when the prompt exceeds the budget.
3. The same step once more, not streamed (same `max_tokens`): its
   `kv_transfer_params.sekv` (`repeat_sekv`) gives the view's
   `selected_blocks`, `view_tokens`, `passes`, `prefilled_tokens`,
   `restore_ms`; whether the answer's tokens (and every line the question
   needs) were in the view; whether both answers agree.

`--plain-ttft` interleaves a plain vLLM server (`--max-model-len 8192`)
re-prefilling the sliding window (`tasks.sliding_window`) after the matching
sekv trials (method `plain-sliding`); `--coverage` computes, after the servers
stop, the true attention mass the views of some trials held (views_eval.py).
The JSON is rewritten after every trial (`--resume` continues a run).
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time
import urllib.request
from pathlib import Path

import eval_common as R
import tasks as tasklib
import views_eval as V

DEFAULT_OUT = R.VIEWS_OUT


def _parse_spec(spec: str, n: int) -> list:
    parts = spec.split(":")
    if len(parts) != n:
        raise SystemExit(f"error: bad spec {spec!r}")
    return parts


def post_chat(url: str, body: dict, timeout: float = 3600) -> dict:
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise R.SekvViewsUnsupported(f"HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}") from e


def ask_once(url: str, model: str, messages: list[dict], max_tokens: int, extra: dict) -> dict:
    """One greedy chat completion, not streamed; text, usage, kv_transfer_params, seconds."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    if messages[-1]["role"] == "assistant":
        body.update(continue_final_message=True, add_generation_prompt=False)
    t0 = time.perf_counter()
    out = post_chat(url, body)
    return {"response": out["choices"][0]["message"]["content"] or "",
            "prompt_tokens": out["usage"]["prompt_tokens"],
            "kv": out.get("kv_transfer_params") or {}, "seconds": time.perf_counter() - t0}


def metric_deltas(url: str, before: dict, must_grow: bool, what: str) -> dict:
    after, deadline = R.metrics(url), time.monotonic() + 5.0
    while must_grow and after.get(R.VIEWS_COUNTER, 0) <= before.get(R.VIEWS_COUNTER, 0) \
            and time.monotonic() < deadline:
        time.sleep(0.2)  # metrics are published a moment after the response
        after = R.metrics(url)
    if must_grow and after.get(R.VIEWS_COUNTER, 0) <= before.get(R.VIEWS_COUNTER, 0):
        raise R.SekvViewsUnsupported(f"the server answered {what} but {R.VIEWS_COUNTER} did not increase: "
                                     "the request was not served as an execution view")
    return {k: round(after[k] - before.get(k, 0.0), 6) for k in after if after[k] != before.get(k, 0.0)}


def replay_picks(messages: list[dict], steps: int) -> list[int]:
    """Indices of the tool turns after which the earlier steps end: evenly
    spaced, the last one the final tool turn."""
    tool_idx = [i for i, m in enumerate(messages) if m["role"] == "tool"]
    n = len(tool_idx)
    return sorted({tool_idx[max(0, -(-k * n // steps) - 1)] for k in range(1, steps + 1)})


def sekv_trial(url, model, task, budget, args, tok, client) -> dict:
    messages = task.messages
    extra = {"session_id": f"eval-{task.id}-{budget}", "cache_salt": f"budget-{budget}",
             "kv_transfer_params": {"view_tokens": budget}}
    replays = []
    t0 = time.perf_counter()
    for i in replay_picks(messages, args.replay_steps) if args.replay_steps else []:
        r = ask_once(url, model, messages[:i + 1], 1, extra)
        sk = r["kv"].get("sekv", {})
        replays.append({"messages": i + 1, "prompt_tokens": r["prompt_tokens"], "seconds": round(r["seconds"], 2),
                        "passes": sk.get("view", {}).get("passes"), "prefilled_tokens": sk.get("prefilled_tokens")})
    replay_s = time.perf_counter() - t0
    if args.reset_cache:
        R.reset_prefix_cache(url)
    before = R.metrics(url)
    try:
        out = R.ask(client, model, messages, args.max_tokens, extra)
    except Exception as e:  # the server refused the request: say why, never fake a number
        raise R.SekvViewsUnsupported(f"the server refused {task.id} (budget {budget}): {e}") from e
    is_view = task.prompt_tokens > budget
    deltas = metric_deltas(url, before, is_view, f"{task.id} (budget {budget})")
    if args.reset_cache:
        R.reset_prefix_cache(url)
    rep = ask_once(url, model, messages, args.max_tokens, extra)
    sk = rep["kv"].get("sekv")
    if sk is None:
        raise R.SekvViewsUnsupported(f"{task.id}: the response carries no kv_transfer_params.sekv")
    view = sk.get("view")
    if is_view and not view:
        raise R.SekvViewsUnsupported(f"{task.id} (budget {budget}): prompt of {task.prompt_tokens} tokens "
                                     f"over the budget, but the response reports no view: {sk}")
    spans = V.needle_spans(tok, task)
    if rep["prompt_tokens"] != spans["prompt_tokens"]:
        raise RuntimeError(f"{task.id}: the server's prompt has {rep['prompt_tokens']} tokens, "
                           f"render_ids {spans['prompt_tokens']}: needle blocks would be wrong")
    held, tail0 = V.held_blocks(view, rep["prompt_tokens"])
    sent = [m["content"] for m in messages]
    row = {"task": task.task, "target_tokens": task.target_tokens, "seed": task.seed,
           "method": "sekv-views", "budget": budget, "history_tokens": task.prompt_tokens,
           "needles_in_prompt": all(any(n in c for c in sent) for n in task.required_lines),
           "answer": task.answer, "correct": tasklib.is_correct(task.answer, out["response"]), **out,
           "sekv": deltas, "replays": replays, "replay_s": round(replay_s, 2),
           "repeat_response": rep["response"], "repeat_s": round(rep["seconds"], 3),
           "repeat_correct": tasklib.is_correct(task.answer, rep["response"]),
           "repeat_agrees": rep["response"].strip() == out["response"].strip(),
           "repeat_sekv": {k: v for k, v in sk.items() if k != "view"}, "view": view,
           "view_tokens": view.get("view_tokens") if view else rep["prompt_tokens"],
           "view_tail_start": tail0 * V.BLOCK if view else None,
           "answer_blocks": spans["answer_blocks"], "line_blocks": spans["line_blocks"],
           **V.needle_checks(spans, held)}
    return row


def plain_trial(client, model, url, task, budget, args, tok) -> dict:
    messages = tasklib.sliding_window(task.messages, tok, budget)
    sent = [m["content"] for m in messages]
    if args.reset_cache:
        R.reset_prefix_cache(url)
    out = R.ask(client, model, messages, args.max_tokens, {})
    return {"task": task.task, "target_tokens": task.target_tokens, "seed": task.seed,
            "method": "plain-sliding", "budget": budget, "history_tokens": task.prompt_tokens,
            "needles_in_prompt": all(any(n in c for c in sent) for n in task.required_lines),
            "answer": task.answer, "correct": tasklib.is_correct(task.answer, out["response"]), **out}


def _key(row: dict) -> tuple:
    return row["task"], row["target_tokens"], row["seed"], row["method"], row["budget"]


def _machine() -> str:
    try:
        model = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")][0]
    except (OSError, IndexError):
        model = platform.processor()
    return f"{platform.machine()} ({model}), {os.cpu_count()} cores, CPU only"


def save(out: Path, meta: dict, rows: list[dict]) -> None:
    tmp = Path(str(out) + ".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "cells": V.summarize_views(rows), "trials": rows}, indent=1))
    tmp.replace(Path(str(out) + ".json"))


def main(args) -> None:
    from openai import OpenAI
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from vllm_sekv.models import prepare_model

    out = Path(args.out)
    if out == R.BASELINES_OUT:  # run_eval.py's default: the baselines' report
        out = DEFAULT_OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir or str(prepare_model(quiet=True))
    tok = AutoTokenizer.from_pretrained(model_dir)
    seeds = list(range(args.seed_offset, args.seed_offset + args.trials))

    cells = []  # (task, length, budget)
    for spec in args.cell or [f"{','.join(args.tasks)}:{','.join(map(str, args.lengths))}:"
                              f"{','.join(map(str, args.budget))}"]:
        ts, ls, bs = _parse_spec(spec, 3)
        cells += [(t, int(n), int(b)) for t in ts.split(",") for n in ls.split(",") for b in bs.split(",")]
    plain = set()
    if args.plain_ttft:
        ts, ls, n, b = _parse_spec(args.plain_ttft, 4)
        plain = {(t, int(length), s, int(b)) for t in ts.split(",") for length in ls.split(",")
                 for s in range(args.seed_offset, args.seed_offset + int(n))}
    # Work, ordered by length, then task and seed; every budget of a trial back to back.
    work = []
    for length in sorted({c[1] for c in cells}):
        for t in tasklib.TASKS:
            budgets = sorted({b for (tt, n, b) in cells if tt == t and n == length})
            for s in seeds:
                for b in budgets:
                    work.append(("sekv-views", t, length, s, b))
                    if (t, length, s, b) in plain:
                        work.append(("plain-sliding", t, length, s, b))
    missing_plain = {p for p in plain if ("plain-sliding", p[0], p[1], p[2], p[3]) not in work}
    for t, length, s, b in sorted(missing_plain):  # plain cells without a matching sekv trial
        work.append(("plain-sliding", t, length, s, b))

    path = Path(str(out) + ".json")
    old = json.loads(path.read_text()) if (args.merge or args.resume) and path.exists() else None
    rows = old["trials"] if old else []
    done = {_key(r) for r in rows}
    if args.resume:
        work = [w for w in work if (w[1], w[2], w[3], w[0], w[4]) not in done]
    command = R.H.command(Path(__file__).with_name("run_eval.py"))
    meta = old["meta"] if old else {}
    meta.update({
        "commands": meta.get("commands", []) + [command], "machine": _machine(), "commit": R.H.commit(),
        "model": Path(model_dir).name, "max_tokens": args.max_tokens, "dtype": args.dtype or "auto",
        "answer_prefix": not args.no_answer_prefix, "reset_cache": args.reset_cache,
        "replay_steps": args.replay_steps, "budgets": sorted({c[2] for c in cells}),
        "server_view_tokens": max(c[2] for c in cells),
        "views_max_model_len": args.views_max_model_len, "views_kv_space_gib": args.views_kv_space_gib,
        "host_bytes": args.host_bytes,
        "started": meta.get("started") or time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "notes": meta.get("notes", []) + [n for n in args.note if n not in meta.get("notes", [])]})
    try:
        meta["vllm"] = __import__("vllm").__version__
    except Exception:  # noqa: BLE001
        pass

    servers = []
    need_plain = any(w[0] == "plain-sliding" for w in work)
    try:
        if work:
            sekv = R.start_server(model_dir, args, {"view_tokens": meta["server_view_tokens"]},
                                  max_model_len=args.views_max_model_len,
                                  env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
                                       "VLLM_CPU_KVCACHE_SPACE": str(args.views_kv_space_gib),
                                       "SEKV_HOST_BYTES": args.host_bytes})
            servers.append(sekv)
            meta["sekv_server"] = {"cmd": " ".join(sekv.cmd[1:]), "env": {
                "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", "VLLM_CPU_KVCACHE_SPACE": str(args.views_kv_space_gib),
                "SEKV_HOST_BYTES": args.host_bytes, "VLLM_SERVER_DEV_MODE": "1"}}
            R.require_views(sekv.url)
            client = OpenAI(base_url=sekv.url + "/v1", api_key="none", timeout=3600)
            model = client.models.list().data[0].id
            R.ask(client, model, [{"role": "user", "content": "Say hi."}], 4, {})  # warm-up
            # warm-up of the view path (probe + restore + final) on a throwaway session
            warm = tasklib.generate("passkey", 2048, 999, tok)
            ask_once(sekv.url, model, warm.messages, 4, {"session_id": "warmup", "cache_salt": "warmup",
                                                          "kv_transfer_params": {"view_tokens": 1024}})
            if need_plain:
                p = R.start_server(model_dir, args, None, max_model_len=8192)
                servers.append(p)
                meta["plain_server"] = {"cmd": " ".join(p.cmd[1:]), "env": {
                    "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space_gib), "VLLM_SERVER_DEV_MODE": "1"}}
                pclient = OpenAI(base_url=p.url + "/v1", api_key="none", timeout=3600)
                pmodel = pclient.models.list().data[0].id
                R.ask(pclient, pmodel, [{"role": "user", "content": "Say hi."}], 4, {})
        cache: dict = {}
        with tqdm(total=len(work), desc="views", unit="trial", dynamic_ncols=True) as bar:
            for method, t, length, s, b in work:
                if (t, length, s) not in cache:
                    cache.clear()
                    cache[(t, length, s)] = tasklib.generate(t, length, s, tok, answer_prefix=not args.no_answer_prefix)
                task = cache[(t, length, s)]
                if method == "sekv-views":
                    row = sekv_trial(sekv.url, model, task, b, args, tok, client)
                else:
                    row = plain_trial(pclient, pmodel, servers[1].url, task, b, args, tok)
                row["finished"] = time.strftime("%H:%M:%S", time.gmtime())
                row["loadavg_1m"] = round(os.getloadavg()[0], 2)
                rows = [r for r in rows if _key(r) != _key(row)] + [row]
                meta["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
                save(out, meta, rows)
                bar.set_postfix_str(f"{method}-{b} {t}@{length}/{s} ok={row['correct']} "
                                    f"sel={row.get('needle_selected', '-')} ttft={row['ttft_s']*1000:.0f}ms")
                bar.update()
    except R.SekvViewsUnsupported as e:
        sys.exit(f"error: {e}")
    finally:
        for srv in servers:
            srv.stop()
    if args.coverage:
        run_coverage(args, out, meta, rows, model_dir, tok)
    report(args, out)


def run_coverage(args, out: Path, meta: dict, rows: list[dict], model_dir: str, tok) -> None:
    ts, ls, n, b = _parse_spec(args.coverage, 4)
    want = {(t, int(length), s, int(b)) for t in ts.split(",") for length in ls.split(",")
            for s in range(args.seed_offset, args.seed_offset + int(n))}
    todo = [r for r in rows if r["method"] == "sekv-views" and
            (r["task"], r["target_tokens"], r["seed"], r["budget"]) in want and not r.get("coverage")]
    if not todo:
        return
    from tqdm import tqdm
    print(f"attention-mass coverage of {len(todo)} views (transformers, float32, CPU) ...", flush=True)
    am = V.AttentionMass(model_dir, threads=args.coverage_threads)
    meta["coverage"] = {"spec": args.coverage, "dtype": "float32", "queries": 64, "block_tokens": V.BLOCK}
    for r in tqdm(todo, desc="coverage", unit="view"):
        task = tasklib.generate(r["task"], r["target_tokens"], r["seed"], tok, answer_prefix=not args.no_answer_prefix)
        ids = tasklib.render_ids(tok, task.messages)
        t0 = time.perf_counter()
        mass = am.block_mass(ids, n_q=64)
        held, tail0 = V.held_blocks(r.get("view"), len(ids))
        r["coverage"] = {**V.coverage(mass, held, tail0), "seconds": round(time.perf_counter() - t0, 1)}
        save(out, meta, rows)


def report(args, out: Path | None = None) -> None:
    import views_report
    out = out or (DEFAULT_OUT if Path(args.out) == R.BASELINES_OUT else Path(args.out))
    data = json.loads(Path(str(out) + ".json").read_text())
    data["cells"] = V.summarize_views(data["trials"])
    if args.report_only and args.note:
        data["meta"]["notes"] = args.note
    Path(str(out) + ".json").write_text(json.dumps(data, indent=1))
    base = json.loads(Path(args.baselines).read_text())
    views_report.write(out, data, base, args.baselines)
