"""A long agent session served from execution views inside real vLLM on the
GPU machine: Llama-3.1-8B geometry, dummy weights, bf16.

    python benchmarks/gpu/views_e2e.py --sizes 65536 131072 262144 524288 --view-tokens 65536 \
        --host-bytes 72G [--out benchmarks/results/gpu_views/report]

The session's history (random token ids) grows step by step to each size in
`--sizes`; the growing step ingests the new history into the sekv workspace
(KV in pinned host memory) through views. At each size, `--steps` agent steps
are timed: the whole history plus 64 fresh tokens, served from a view of
`--view-tokens` (probe pass: the new tokens' queries score every history block
on the GPU index; final pass: sink + best blocks + recent restored with
re-RoPE, then the new tokens). Per step: time to first token, and at the
largest size also decode speed (per-token time of `--decode-tokens` greedy
tokens). GPU memory (`torch.cuda.memory_allocated`, the engine runs in this
process) is read after every size.

Baseline, same invocation, own process: plain vLLM (no connector) with the
same GPU memory setting and a plain context of `--view-tokens` tokens: cold
(prefill) and warm (prefix cached) time to first token of a 64-token step, and
decode speed at that context. Every figure is measured here; the engine runs
in eager mode in both cases (`enforce_eager`), or with `--cuda-graphs` with
vLLM's CUDA graphs, its default on GPUs (plain vLLM then replays whole
decode steps; sekv's prefills run piecewise graphs, attention and the
KV-cache update eagerly, where its hook is, and its decode batches replay
full graphs too, their tokens captured around the graph; the report names
the mode vLLM resolved for each engine). Both schedule the way vLLM
does by default (asynchronously on GPUs); engines `plain-sync` and
`sekv-sync` turn vLLM's asynchronous scheduling off, which separates its
gain from the connector's own cost.

Writes OUT.json and OUT.md (default benchmarks/results/gpu_views/report), the
Markdown headed by the machine, commit and command
(`benchmarks/report_header.py`), and `summary.json` beside them (one flat row
per sekv engine and size: `summary_rows`); `--sekv '{"workspace_codec":
"fp8"}'` serves the session from the fp8 workspace; engine `sekv-resident`
keeps `--resident-bytes` of restored blocks on the device (diff restores:
each step moves only the blocks the last ones did not bring; `--follow-ups
N` adds N steps that send the last step's prompt again; the report gives
every step's blocks placed / restored); `--merge A.json B.json` writes one
report from runs made apart, each run's rows against its own plain vLLM
(`plain_of`) and named by their commit and codec where those differ.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import report_header as H  # noqa: E402
from restore_e2e import merged_meta, model_folder  # noqa: E402

NEW_TOKENS = 64
GIB = 1 << 30


class Session:
    """One engine driven step by step (`LLMEngine.step`), so that the first
    token and every later token are timed where they appear. With `timers`
    (the `host_timers` module, installed) a decode's result also holds the
    host time per token between its first and its last token; with `audit`
    (the `sync_audit` module, installed) every result holds the step's
    synchronizations by place, and a decode's those per token."""

    def __init__(self, llm, timers=None, audit=None) -> None:
        self.engine = llm.llm_engine
        self.count = 0
        self.timers = timers
        self.audit = audit

    def run(self, ids: list[int], max_tokens: int, extra: dict | None = None) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.count += 1
        rid = f"r{self.count}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra or None)
        t0 = time.perf_counter()
        syncs_before = self.audit.snapshot() if self.audit else None
        self.engine.add_request(rid, TokensPrompt(prompt_token_ids=ids), params)
        first = last = None
        tokens = 0
        out = None
        at_first = at_last = None
        while True:
            for o in self.engine.step():  # one request in flight: every output is its own
                now = time.perf_counter()
                n = len(o.outputs[0].token_ids)
                if n and first is None:
                    first = now
                    at_first = self.timers.snapshot() if self.timers else None
                    syncs_first = self.audit.snapshot() if self.audit else None
                if n > tokens:
                    tokens, last = n, now
                    at_last = self.timers.snapshot() if self.timers and n > 1 else None
                    syncs_last = self.audit.snapshot() if self.audit else None
                if o.finished:
                    out = o
            if out is not None:
                break
        decode = (last - first) / (tokens - 1) if tokens > 1 else None
        result = {"ttft_s": first - t0, "total_s": time.perf_counter() - t0, "tokens": tokens,
                  "decode_s_per_token": decode, "num_cached_tokens": out.num_cached_tokens,
                  "kv_transfer_params": out.kv_transfer_params}
        if at_first is not None and at_last is not None:
            result["decode_timers"] = self.timers.diff(at_first, at_last, per=tokens - 1)
        if self.audit:
            result["syncs"] = self.audit.diff(syncs_before, self.audit.snapshot())
            if tokens > 1:
                result["decode_syncs"] = self.audit.diff(syncs_first, syncs_last, per=tokens - 1)
        return result


def profiled(step) -> str:
    """The host-side profile of one step (cProfile, the engine runs in this
    process): the 30 functions with the most cumulative time, then the 30
    with the most time of their own."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.runcall(step)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    print(out.getvalue(), flush=True)
    return out.getvalue()


def gpu_memory() -> dict:
    import torch

    if not torch.cuda.is_available():  # a CPU smoke run of this script
        return {"allocated_gib": 0.0, "reserved_gib": 0.0, "device_used_gib": 0.0}
    free, total = torch.cuda.mem_get_info()
    return {"allocated_gib": torch.cuda.memory_allocated() / GIB, "reserved_gib": torch.cuda.memory_reserved() / GIB,
            "device_used_gib": (total - free) / GIB}


def make_llm(spec: dict):
    from vllm import LLM

    kwargs = {}
    if spec["engine"].endswith("-sync"):
        kwargs["async_scheduling"] = False
    if spec["engine"].startswith("sekv"):
        kwargs["kv_transfer_config"] = {"kv_connector": "sekv", "kv_role": "kv_both",
                                        "kv_connector_extra_config": spec["sekv"]}
    return LLM(model=spec["model_dir"], load_format=spec["load_format"], skip_tokenizer_init=True,
               enforce_eager=not spec.get("cuda_graphs"), max_model_len=spec["max_model_len"],
               gpu_memory_utilization=spec["gpu_memory_utilization"], enable_prefix_caching=True, seed=0,
               **kwargs)


def timed(run) -> tuple[dict, dict]:
    """`run()`'s result, and the host time it spent in the methods
    `host_timers` watches."""
    import host_timers

    before = host_timers.snapshot()
    result = run()
    return result, host_timers.diff(before, host_timers.snapshot())


def engine_main(spec: dict) -> None:
    timers = None
    if spec.get("timers"):
        import host_timers as timers

        print(f"host timers on: {timers.install()}", flush=True)
    rng = random.Random("views-e2e")
    vocab = spec["vocab"]
    history = [rng.randrange(1000, vocab) for _ in range(max(spec["sizes"]))]

    def question() -> list[int]:
        return [rng.randrange(1000, vocab) for _ in range(NEW_TOKENS)]

    t0 = time.perf_counter()
    llm = make_llm(spec)
    print(f"[{spec['engine']}] engine up in {time.perf_counter() - t0:.0f} s", flush=True)
    audit = None
    if spec.get("sync_audit"):
        import sync_audit as audit

        audit.install()  # after start-up: its synchronizations are not a step's
    session = Session(llm, timers, audit)
    rows: list[dict] = []
    engine = spec["engine"]
    if engine.startswith("sekv"):
        extra = {"session_id": "agent", "view_tokens": spec["view_tokens"]}
        for size in spec["sizes"]:
            grow = session.run(history[:size] + question(), 1, extra)
            print(f"[{engine}] session grown to {size}: {grow['total_s']:.1f} s, {grow['kv_transfer_params']}", flush=True)
            prompts = [history[:size] + question() for _ in range(spec["steps"])]
            steps = [session.run(prompt, 1, extra) for prompt in prompts]
            # Follow-ups: the last step's prompt again, as an agent asking on
            # about the same material (random tokens have no topic to share).
            follow_ups = [session.run(prompts[-1], 1, extra) for _ in range(spec.get("follow_ups", 0))]
            row = {"engine": engine, "codec": spec["sekv"].get("workspace_codec", "exact"), "session_tokens": size,
                   "grow_s": grow["total_s"], "steps": steps,
                   "ttft_s": statistics.median(s["ttft_s"] for s in steps), "memory": gpu_memory()}
            if follow_ups:
                row["follow_ups"] = follow_ups
                row["follow_up_ttft_s"] = statistics.median(s["ttft_s"] for s in follow_ups)
            if size == max(spec["sizes"]):
                row["decode"] = session.run(history[:size] + question(), spec["decode_tokens"] + 1, extra)
                if spec.get("timers"):
                    _, row["step_timers"] = timed(lambda: session.run(history[:size] + question(), 1, extra))
                    row["decode_timers"] = row["decode"]["decode_timers"]
                if spec["profile"]:
                    row["profile"] = profiled(lambda: session.run(history[:size] + question(), 1, extra))
                    row["decode_profile"] = profiled(
                        lambda: session.run(history[:size] + question(), spec["decode_tokens"] + 1, extra))
            rows.append(row)
            print(f"[{engine}] {size}: TTFT {row['ttft_s']:.3f} s (all {[round(s['ttft_s'], 3) for s in steps]}), "
                  f"memory {row['memory']}, view {steps[-1]['kv_transfer_params']}, placed from the resident pool "
                  f"per step {[placed_share(s) for s in steps]}", flush=True)
            if follow_ups:
                print(f"[{engine}] {size} follow-ups: TTFT {[round(s['ttft_s'], 3) for s in follow_ups]}, placed "
                      f"{[placed_share(s) for s in follow_ups]}", flush=True)
    else:
        context = history[: spec["view_tokens"]]
        cold = session.run(context + question(), 1)
        warm = [session.run(context + question(), 1) for _ in range(spec["steps"])]
        decode = session.run(context + question(), spec["decode_tokens"] + 1)
        rows.append({"engine": spec["engine"], "context_tokens": len(context), "cold_ttft_s": cold["ttft_s"],
                     "warm_ttft_s": statistics.median(s["ttft_s"] for s in warm), "warm": warm,
                     "decode": decode, "memory": gpu_memory()})
        if spec.get("timers"):
            _, rows[-1]["step_timers"] = timed(lambda: session.run(context + question(), 1))
            rows[-1]["decode_timers"] = decode["decode_timers"]
        print(f"[{spec['engine']}] cold {cold['ttft_s']:.3f} s, warm {rows[-1]['warm_ttft_s']:.3f} s, "
              f"decode {decode['decode_s_per_token'] * 1e3:.2f} ms/token, {rows[-1]['memory']}", flush=True)
    graphs = llm.llm_engine.vllm_config.compilation_config.cudagraph_mode
    for row in rows:
        row["cudagraph_mode"] = getattr(graphs, "name", None)  # as vLLM resolved it
    Path(spec["out"]).write_text(json.dumps(rows))


def view_blocks(step: dict) -> tuple[int, int]:
    """(moved, placed): a view step's restored blocks moved from host memory
    and placed from the device's resident pool."""
    params = (step.get("kv_transfer_params") or {}).get("sekv", {})
    restored = params.get("restored_tokens", 0)
    restored = sum(restored.values()) if isinstance(restored, dict) else restored
    placed = params.get("resident_blocks", 0)
    return restored // (params.get("view", {}).get("block_tokens") or 32) - placed, placed


def placed_share(step: dict) -> str:
    moved, placed = view_blocks(step)
    return f"{placed}/{moved + placed}"


def run_engine(spec: dict, workdir: Path) -> list[dict]:
    path = workdir / f"{spec['engine']}.json"
    spec = {**spec, "out": str(path.with_suffix(".rows.json"))}
    path.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    proc = subprocess.run([sys.executable, __file__, "--engine-spec", str(path)], timeout=spec["timeout_s"], env=env)
    if proc.returncode != 0:
        print(f"engine {spec['engine']} failed with {proc.returncode}", flush=True)
        return []
    return json.loads(Path(spec["out"]).read_text())


def _card(machine: str | None) -> str:
    """A row's GPU, from its machine line ("1 x NVIDIA H100 80GB HBM3; host ..."), versions left out."""
    return re.sub(r"\s*\(.*?\)", "", (machine or "").split(";")[0]).strip()


def plain_of(rows: list[dict], row: dict) -> dict | None:
    """The plain vLLM row `row` compares against: its own run's (same
    commit and machine, in a merged report), else the first run's on the
    same GPU; None if no run on that GPU measured plain vLLM."""
    plain = [r for r in rows if r["engine"] == "plain"]
    same = [r for r in plain if (r.get("commit"), r.get("machine")) == (row.get("commit"), row.get("machine"))]
    card = [r for r in plain if _card(r.get("machine")) == _card(row.get("machine"))]
    return (same or card or [None])[0]


def report(rows: list[dict], args: argparse.Namespace, out: Path, meta: dict | None = None) -> None:
    plain_sync = next((r for r in rows if r["engine"] == "plain-sync"), None)
    sekv = [r for r in rows if r["engine"] in ("sekv", "sekv-resident")]
    sekv_sync = next((r for r in rows if r["engine"] == "sekv-sync" and "decode" in r), None)
    meta = meta or H.meta(H.command(__file__))
    by_run = len({(r.get("commit"), r.get("machine")) for r in sekv}) > 1  # merged runs: each row names its commit
    by_codec = len({r.get("codec", "exact") for r in sekv}) > 1
    modes = ", ".join(f"{r['engine']} {r['cudagraph_mode']}" for r in {r["engine"]: r for r in rows}.values()
                      if r.get("cudagraph_mode"))
    graphs = f"CUDA graphs (vLLM default; {modes})" if modes else "CUDA graphs (vLLM default)"
    lines = [
        *H.header_from(meta, "End to end inside vLLM: a long session served from execution views"),
        (f"{Path(args.model_dir).name} (`--model-dir`), " if args.model_dir else
         "Llama-3.1-8B geometry (32 layers, 8 KV heads, head_dim 128, bf16), dummy weights, ")
        + f"{graphs if args.cuda_graphs else 'eager'}; "
        f"views of {args.view_tokens} tokens, {NEW_TOKENS} new tokens per step, history KV in sekv's pinned "
        f"host tier ({args.host_bytes}). Time to first token = probe (new tokens + block scoring on the GPU "
        "index) + final pass (restore of the view with re-RoPE + new tokens), median of the steps. "
        "GPU memory: `torch.cuda.memory_allocated` of the engine process after the size's steps.",
        "",
        "| engine | session tokens | grow step (ingest) | TTFT per step | steps (blocks placed / restored) | "
        "restored blocks (last step) | of them placed from the resident pool | GPU memory allocated | "
        "vs plain warm TTFT |" + (" codec |" if by_codec else "") + (" run |" if by_run else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if by_codec else "") + ("---|" if by_run else ""),
    ]
    for r in sekv:
        for kind, steps, ttft in (("", r["steps"], r["ttft_s"]),
                                  (" (follow-ups)", r.get("follow_ups"), r.get("follow_up_ttft_s"))):
            if not steps:
                continue
            moved, placed = view_blocks(steps[-1])
            plain = plain_of(rows, r)
            vs = f"{ttft / plain['warm_ttft_s']:.1f}x" if plain else "—"
            each = ", ".join(f"{s['ttft_s']:.3f} ({placed_share(s)})" for s in steps)
            lines.append(f"| {r['engine']}{kind} | {r['session_tokens'] // 1024}K | {r['grow_s']:.1f} s | {ttft:.3f} s | "
                         f"{each} | {moved + placed} | {placed} | {r['memory']['allocated_gib']:.2f} GiB | {vs} |"
                         + (f" {r.get('codec', 'exact')} |" if by_codec else "")
                         + (f" {r.get('commit') or '?'} |" if by_run else ""))
    for plain in (r for r in rows if r["engine"] == "plain"):
        run = f", run {plain.get('commit') or '?'}" if by_run else ""
        lines += ["", f"Plain vLLM{run}, {plain['context_tokens'] // 1024}K context: cold TTFT "
                  f"{plain['cold_ttft_s']:.3f} s, warm TTFT {plain['warm_ttft_s']:.3f} s, GPU memory allocated "
                  f"{plain['memory']['allocated_gib']:.2f} GiB."]
    for r in sekv:
        params = (r["steps"][-1].get("kv_transfer_params") or {}).get("sekv", {})
        if params.get("unkept_tokens"):
            lines += ["", f"{r['engine']} at {r['session_tokens'] // 1024}K: the host tier was full, so each step "
                      f"prefilled {params.get('prefilled_tokens')} tokens, against {2 * NEW_TOKENS} for a view whose "
                      f"blocks are all kept ({params['unkept_tokens']} of the step's own tokens found no slot, "
                      "`unkept_tokens`); a larger `--host-bytes` keeps them."]
    for r in (r for r in sekv if "decode" in r):
        plain = plain_of(rows, r)
        if plain is None or "decode" not in plain:
            continue
        decode, run = r["decode"], f", run {r.get('commit') or '?'}" if by_run else ""
        ratio = decode["decode_s_per_token"] / plain["decode"]["decode_s_per_token"]
        other = f" (run {plain.get('commit') or '?'})" if plain.get("commit") != r.get("commit") else ""
        lines += ["", f"Decode ({args.decode_tokens} tokens{run}): {r['engine']} at {r['session_tokens'] // 1024}K "
                  f"session {decode['decode_s_per_token'] * 1e3:.2f} ms/token vs plain "
                  f"{plain['context_tokens'] // 1024}K{other} {plain['decode']['decode_s_per_token'] * 1e3:.2f} "
                  f"ms/token: {ratio:.3f}x."]
    if plain_sync:
        line = (f"Plain vLLM with asynchronous scheduling off (`plain-sync`), same context: decode "
                f"{plain_sync['decode']['decode_s_per_token'] * 1e3:.2f} ms/token")
        if decode:
            line += f"; sekv / plain-sync {decode['decode_s_per_token'] / plain_sync['decode']['decode_s_per_token']:.3f}x"
        lines += ["", line + "."]
    if sekv_sync:
        line = (f"sekv with asynchronous scheduling off (`sekv-sync`): decode "
                f"{sekv_sync['decode']['decode_s_per_token'] * 1e3:.2f} ms/token")
        if plain_sync:
            ratio = sekv_sync["decode"]["decode_s_per_token"] / plain_sync["decode"]["decode_s_per_token"]
            line += f"; sekv-sync / plain-sync {ratio:.3f}x"
        lines += ["", line + "."]
    lines += timer_tables(rows)
    lines += sync_tables(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    H.write_report(out.with_suffix(".md"), lines)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows,
                                                    "command": " && ".join(meta["commands"])}, indent=1))
    (out.parent / "summary.json").write_text(json.dumps(
        {"machine": meta["machine"], "commit": meta["commit"], "rows": summary_rows(rows, args)}, indent=1) + "\n")
    print("\n".join(lines), flush=True)


def summary_rows(rows: list[dict], args: argparse.Namespace) -> list[dict]:
    """One flat row per sekv engine and session size, and one more for its
    follow-up steps where they ran: the median step's time to first token,
    decode speed against plain vLLM's (measured at the largest size only,
    else None), GPU memory allocated, and the last step's view blocks: placed
    from the device's resident pool (`resident_blocks`, with `resident_bytes`)
    and moved from host memory (`moved_blocks`)."""
    out = []
    for r in rows:
        if not r["engine"].startswith("sekv"):
            continue
        plain_decode = (plain_of(rows, r) or {}).get("decode", {}).get("decode_s_per_token")
        decode = r.get("decode", {}).get("decode_s_per_token")
        for steps, ttft in ((r["steps"], r["ttft_s"]), (r.get("follow_ups"), r.get("follow_up_ttft_s"))):
            if not steps:
                continue
            moved, placed = view_blocks(steps[-1])
            out.append({"engine": r["engine"], "codec": r.get("codec", "exact"),
                        "session_tokens": r["session_tokens"], "view_tokens": args.view_tokens,
                        "ttft_s": round(ttft, 4),
                        "decode_ms_per_token": None if decode is None else round(decode * 1e3, 3),
                        "plain_decode_ms_per_token": None if plain_decode is None else round(plain_decode * 1e3, 3),
                        "gpu_gib": round(r["memory"]["allocated_gib"], 2),
                        "moved_blocks": moved, "resident_blocks": placed,
                        **({"machine": r["machine"]} if r.get("machine") else {})})
    return out


def timer_tables(rows: list[dict]) -> list[str]:
    """Host ms per decode token and per step in each watched method, engines side by side."""
    lines = []
    for key, what in (("decode_timers", "per decode token"), ("step_timers", "per step (64 new tokens, 1 sampled)")):
        timed_rows = [r for r in rows if key in r]
        if not timed_rows:
            continue
        names = [f"{r['engine']} {r.get('session_tokens', r.get('context_tokens', 0)) // 1024}K" for r in timed_rows]
        labels = sorted({label for r in timed_rows for label in r[key]},
                        key=lambda label: -max(r[key].get(label, {"ms": 0.0})["ms"] for r in timed_rows))
        lines += ["", f"Host time {what} (`--timers`; ms, calls in brackets; nested methods count in their callers too):",
                  "", "| method | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for label in labels:
            cells = []
            for r in timed_rows:
                t = r[key].get(label)
                cells.append(f"{t['ms']:.3f} ({t['calls']:.1f})" if t else "—")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def sync_tables(rows: list[dict]) -> list[str]:
    """Synchronizations per decode token and in the last timed step, per engine (`--sync-audit`)."""
    import sync_audit

    lines = []
    for r in rows:
        name = f"{r['engine']} {r.get('session_tokens', r.get('context_tokens', 0)) // 1024}K"
        decode = r.get("decode", {})
        if "decode_syncs" in decode:
            lines += ["", *sync_audit.table(decode["decode_syncs"], f"Synchronizations per decode token, {name} "
                                            "(`--sync-audit`; by the innermost sekv frame, else vLLM frame):")]
        step = (r.get("steps") or r.get("warm") or [{}])[-1]
        if "syncs" in step:
            lines += ["", *sync_audit.table(step["syncs"], f"Synchronizations in one step (64 new tokens, 1 "
                                            f"sampled), {name} (`--sync-audit`):")]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine-spec", help=argparse.SUPPRESS)
    ap.add_argument("--engines", nargs="+", default=["sekv", "plain"],
                    choices=["sekv", "sekv-resident", "sekv-sync", "plain", "plain-sync"])
    ap.add_argument("--sizes", type=int, nargs="+", default=[65536, 131072, 262144, 524288])
    ap.add_argument("--view-tokens", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--follow-ups", type=int, default=0,
                    help="steps after --steps that send the last step's prompt again (an agent's follow-up)")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--host-bytes", default="72G")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.72)
    ap.add_argument("--model-dir", help="a real model instead of the dummy Llama-3.1-8B geometry")
    ap.add_argument("--sekv", default="{}", help="more kv_connector_extra_config, as JSON")
    ap.add_argument("--resident-bytes", default="16G", help="engine sekv-resident's resident_bytes (diff restores)")
    ap.add_argument("--timeout-s", type=int, default=540)
    ap.add_argument("--profile", action="store_true",
                    help="profile one more step, and one more decode, at the largest size (host side)")
    ap.add_argument("--timers", action="store_true",
                    help="host time per step and per decode token inside vLLM's and sekv's methods (host_timers.py; "
                         "eager only)")
    ap.add_argument("--sync-audit", action="store_true",
                    help="count the synchronizing CUDA operations per step and decode token, by place (sync_audit.py)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="vLLM's CUDA graphs (its default on GPUs) instead of eager mode, for every engine")
    ap.add_argument("--out", default=str(H.results_dir("gpu_views") / "report"), help="writes OUT.json and OUT.md")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="only write the report from these runs' JSON")
    args = ap.parse_args()
    if args.timers and args.cuda_graphs:  # the compiled forward would trace into the timers' wrappers
        ap.error("--timers times eager steps: leave out --cuda-graphs")
    if args.merge:
        runs = [json.loads(Path(p).read_text()) for p in args.merge]
        for run in runs:  # a run written before the header existed: its command only
            run.setdefault("meta", {"commands": run["command"].split(" && ")})
            for row in run["rows"]:  # where each row was measured (a merged report's own rows keep theirs)
                row.setdefault("commit", run["meta"].get("commit"))
                row.setdefault("machine", run["meta"].get("machine"))
        report([r for run in runs for r in run["rows"]], args, Path(args.out), merged_meta(runs, H.command(__file__)))
        return
    if args.engine_spec:
        engine_main(json.loads(Path(args.engine_spec).read_text()))
        return
    workdir = Path(tempfile.mkdtemp(prefix="views_e2e_"))
    model_dir, load_format, vocab = model_folder(args.model_dir, workdir)
    base = {"model_dir": str(model_dir), "load_format": load_format, "vocab": vocab, "sizes": args.sizes,
            "view_tokens": args.view_tokens, "steps": args.steps, "follow_ups": args.follow_ups,
            "decode_tokens": args.decode_tokens,
            "gpu_memory_utilization": args.gpu_memory_utilization, "timeout_s": args.timeout_s,
            "profile": args.profile, "timers": args.timers, "cuda_graphs": args.cuda_graphs,
            "sync_audit": args.sync_audit}
    rows: list[dict] = []
    for engine in args.engines:
        if engine.startswith("sekv"):
            sekv = {"host_bytes": args.host_bytes, "view_tokens": args.view_tokens, **json.loads(args.sekv)}
            if engine == "sekv-resident":
                sekv["resident_bytes"] = args.resident_bytes
            max_len = max(args.sizes) + NEW_TOKENS + args.decode_tokens + 64
            rows += run_engine({**base, "engine": engine, "sekv": sekv, "max_model_len": max_len}, workdir)
        else:
            max_len = args.view_tokens + NEW_TOKENS + args.decode_tokens + 64
            rows += run_engine({**base, "engine": engine, "max_model_len": max_len}, workdir)
    report(rows, args, Path(args.out))


if __name__ == "__main__":
    main()
