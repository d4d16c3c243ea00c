"""Helpers of the `sekv-views` evaluation (run_eval.py --method sekv-views).

* `needle_spans`: where the facts a question needs sit in the rendered prompt
  (token indices, 32-token blocks), from the tokenizer's offsets.
* `held_blocks`: which blocks of the full prompt a step's view held, from the
  response's `kv_transfer_params.sekv.view` (history blocks + the tail).
* `AttentionMass`: true attention of a prompt's last queries over the prompt
  (Hugging Face transformers, float32, CPU), as mass per 32-token block, per
  layer, query head and query; `coverage` = share of it on a set of blocks.
* `write_views_report` / `plot_views`: the Markdown and plot of the views run,
  with reference rows taken from `benchmarks/results/eval_baselines/report.json`.

No server, no network.
"""
from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

import tasks as tasklib


def style_accuracy_axis(ax, task: str) -> None:
    """One task's accuracy-vs-length panel: log2 x, the native window dotted."""
    ax.axvline(8192, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_title(task)
    ax.set_xlabel("history tokens (SmolLM2)")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)

BLOCK = 32


# ---------------------------------------------------------------- needles

def _render_text(tok, messages: list[dict]) -> str:
    cont = messages[-1]["role"] == "assistant"
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=not cont,
                                   continue_final_message=cont)


def needle_spans(tok, task: tasklib.Task, block_tokens: int = BLOCK) -> dict:
    """Token indices (in `tasks.render_ids`) of every occurrence of the gold
    answer inside the history, and of every line the question needs."""
    text = _render_text(tok, task.messages)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = tasklib.render_ids(tok, task.messages)
    if list(enc["input_ids"]) != ids:
        raise RuntimeError(f"{task.id}: offsets tokenization differs from render_ids")
    offsets = enc["offset_mapping"]

    def tokens_of(start: int, end: int) -> list[int]:
        return [i for i, (a, b) in enumerate(offsets) if a < end and b > start]

    # the question and answer prefix never contain the gold answer; search the history only
    q_at = text.rfind(task.question)
    hist_text = text[:q_at] if q_at >= 0 else text
    pat = re.escape(task.answer)
    if task.answer[:1].isdigit():
        pat = r"(?<!\d)" + pat + r"(?!\d)"
    answers = [tokens_of(m.start(), m.end()) for m in re.finditer(pat, hist_text)]
    lines = []
    for line in task.required_lines:
        at = hist_text.find(line)
        if at < 0:
            raise RuntimeError(f"{task.id}: required line not found in the rendered prompt")
        lines.append(tokens_of(at, at + len(line)))
    if not answers:
        raise RuntimeError(f"{task.id}: the gold answer does not occur in the history")
    return {"prompt_tokens": len(ids),
            "answer_tokens": answers,
            "answer_blocks": [sorted({i // block_tokens for i in occ}) for occ in answers],
            "line_blocks": [sorted({i // block_tokens for i in ln}) for ln in lines]}


def held_blocks(view: dict | None, prompt_tokens: int, block_tokens: int = BLOCK) -> tuple[set[int], int]:
    """(blocks of the full prompt the step saw, first tail block). No view (the
    prompt fit the budget and was served whole): every block."""
    n_blocks = -(-prompt_tokens // block_tokens)
    if not view or not view.get("selected_blocks"):
        return set(range(n_blocks)), 0
    sel = [int(b) for b in view["selected_blocks"]]
    tail0 = max(sel) + 1  # the recent blocks end right before the tail (views.first_pass)
    return set(sel) | set(range(tail0, n_blocks)), tail0


def needle_checks(spans: dict, held: set[int]) -> dict:
    answer_held = [all(b in held for b in occ) for occ in spans["answer_blocks"]]
    lines_held = [all(b in held for b in ln) for ln in spans["line_blocks"]]
    return {"needle_selected": any(answer_held),     # at least one whole occurrence of the answer
            "needle_all_occurrences": all(answer_held),
            "required_lines_held": all(lines_held)}  # every line the question needs, whole


# ---------------------------------------------------------------- attention mass

class AttentionMass:
    """SmolLM2 in float32 on CPU; the true attention of a prompt's last `n_q`
    tokens, per layer, query head and query, summed per `block_tokens` block.
    Queries/keys are captured pre-RoPE from q_proj/k_proj (as in
    benchmarks/index_study/study.py) and rotated at their absolute positions."""

    def __init__(self, model_dir: str, threads: int | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        cfg = self.model.config
        self.hq, self.h, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        rot = self.model.model.rotary_emb
        self.inv_freq = rot.inv_freq.float()
        self.scaling = float(getattr(rot, "attention_scaling", 1.0))
        self.q, self.k, self.keep_q = {}, {}, 0
        for i, layer in enumerate(self.model.model.layers):
            a = layer.self_attn
            a.q_proj.register_forward_hook(self._hook(i, True))
            a.k_proj.register_forward_hook(self._hook(i, False))

    def _hook(self, i, is_q):
        def fn(mod, inp, out):
            x = out[0]
            if is_q:
                self.q[i] = x[x.shape[0] - self.keep_q:].reshape(-1, self.hq, self.d).detach().clone()
            else:
                self.k[i] = x.reshape(-1, self.h, self.d).detach().clone()
        return fn

    def _rope(self, x, pos):
        torch = self.torch
        f = pos.float()[:, None] * self.inv_freq[None]
        emb = torch.cat([f, f], -1)
        cos, sin = (emb.cos() * self.scaling)[:, None], (emb.sin() * self.scaling)[:, None]
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def block_mass(self, ids: list[int], n_q: int = 64, block_tokens: int = BLOCK):
        """[layers, query heads, n_q, blocks] attention mass per block (rows sum to 1)."""
        torch = self.torch
        T = len(ids)
        self.keep_q = n_q
        with torch.no_grad():
            self.model.model(input_ids=torch.tensor([ids]), use_cache=False)
            n_blocks = -(-T // block_tokens)
            pad = n_blocks * block_tokens - T
            q_pos = torch.arange(T - n_q, T)
            mask = torch.arange(T)[None, :] > q_pos[:, None]  # [n_q, T] causal
            rep = self.hq // self.h
            out = []
            for layer in range(len(self.k)):
                q = self._rope(self.q[layer], q_pos)                      # [n_q, Hq, D]
                k = self._rope(self.k[layer], torch.arange(T)).repeat_interleave(rep, dim=1)
                logits = torch.einsum("nhd,thd->hnt", q, k) / math.sqrt(self.d)
                a = torch.softmax(logits.masked_fill(mask[None], float("-inf")), -1)
                a = torch.nn.functional.pad(a, (0, pad))
                out.append(a.reshape(self.hq, n_q, n_blocks, block_tokens).sum(-1))
        self.q, self.k = {}, {}
        return torch.stack(out)


def coverage(mass, held: set[int], tail0: int, n_sink: int = 2) -> dict:
    """Shares of true attention mass (mean over layers, heads and queries):
    `view`: on the blocks the view held (selected + sink + recent + tail) of all mass;
    `history`: on the held history blocks, of the mass on the history (blocks < tail0);
    plus, for the same number of history blocks, a sliding window (sink + most
    recent) and the oracle set (the blocks with the most mass, summed over
    layers, heads and queries)."""
    n_blocks = mass.shape[-1]
    tail0 = tail0 or n_blocks
    hist = mass[..., :tail0]
    hist_total = hist.sum(-1)
    in_view = sorted(b for b in held if b < tail0)
    k = len(in_view)

    def share_hist(blocks):
        return float((hist[..., blocks].sum(-1) / hist_total.clamp_min(1e-12)).mean()) if blocks else 0.0

    view_all = float(mass[..., sorted(held)].sum(-1).mean())
    sink = list(range(min(n_sink, tail0)))
    sliding = sorted(set(sink) | set(range(max(len(sink), tail0 - (k - len(sink))), tail0)))
    oracle = sorted(hist.sum((0, 1, 2)).argsort(descending=True)[:k].tolist())
    return {"view": round(view_all, 4), "history": round(share_hist(in_view), 4),
            "history_sliding_same_size": round(share_hist(sliding), 4),
            "history_oracle_same_size": round(share_hist(oracle), 4),
            "history_share_of_all": round(float(hist_total.mean()), 4),
            "history_blocks_held": k, "history_blocks": tail0}


# ---------------------------------------------------------------- report

def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else None


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize_views(rows: list[dict]) -> list[dict]:
    """Per (task, length, method label) cell: accuracy, needle held, TTFT, sizes."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        lab = r["method"] if r["budget"] is None else f"{r['method']}-{r['budget']}"
        cells.setdefault((r["task"], r["target_tokens"], lab), []).append(r)
    out = []
    for (task, length, lab), rs in sorted(cells.items()):
        ttft = [r["ttft_s"] * 1000 for r in rs]
        c = {"task": task, "target_tokens": length, "method": lab, "n": len(rs),
             "correct": sum(r["correct"] for r in rs),
             "accuracy": round(sum(r["correct"] for r in rs) / len(rs), 3),
             "ttft_ms_mean": round(statistics.mean(ttft), 1),
             "ttft_ms_median": round(statistics.median(ttft), 1),
             "prompt_tokens_mean": round(_mean([r.get("prompt_tokens") for r in rs]) or 0, 1),
             "needles_in_prompt": round(sum(r["needles_in_prompt"] for r in rs) / len(rs), 3)}
        if rs[0]["method"] == "sekv-views":
            c["needle_selected"] = round(_mean([float(r["needle_selected"]) for r in rs]), 3)
            c["required_lines_held"] = round(_mean([float(r["required_lines_held"]) for r in rs]), 3)
            vt = [r.get("view_tokens") for r in rs]
            c["view_tokens_mean"] = round(_mean(vt), 1) if _mean(vt) is not None else None
            c["served_as_view"] = sum(bool(r.get("view")) for r in rs)
            c["repeat_agrees"] = sum(r["repeat_agrees"] for r in rs)
            c["repeat_correct"] = sum(r["repeat_correct"] for r in rs)
            for key in ("restore_ms", "prefilled_tokens"):
                m = _mean([r.get("repeat_sekv", {}).get(key) for r in rs])
                c[f"repeat_{key}_mean"] = round(m, 1) if m is not None else None
            for key in ("vllm:sekv_restore_seconds_total", "vllm:sekv_restored_tokens_total",
                        "vllm:sekv_probes_total", "vllm:sekv_views_total"):
                m = _mean([r.get("sekv", {}).get(key, 0.0) for r in rs])
                c["measured_" + key.split(":")[1]] = round(m, 4)
            covs = [r["coverage"] for r in rs if r.get("coverage")]
            if covs:
                c["coverage"] = {k: round(statistics.mean(cv[k] for cv in covs), 4)
                                 for k in ("view", "history", "history_sliding_same_size",
                                           "history_oracle_same_size", "history_share_of_all")}
                c["coverage_n"] = len(covs)
        out.append(c)
    return out


def baseline_cells(baselines: dict, tasks: list[str]) -> list[dict]:
    return [c for c in baselines["cells"] if c["task"] in tasks and c["method"] in ("full", "sliding-4096")]


def plot_views(path: Path, cells: list[dict], base: list[dict]) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    mine = [c for c in cells if c["method"].startswith("sekv-views")]
    task_names = [t for t in tasklib.TASKS if any(c["task"] == t for c in mine)]
    fig, axes = plt.subplots(1, len(task_names), figsize=(5 * len(task_names), 4.2), sharey=True, squeeze=False)
    styles = {"full": ("k", "o", "-"), "sliding-4096": ("grey", "s", "--"),
              "sekv-views-1024": ("tab:orange", "v", "-"), "sekv-views-2048": ("tab:green", "^", "-"),
              "sekv-views-4096": ("tab:blue", "D", "-")}
    shift = dict(zip(styles, (0.96, 0.98, 1.0, 1.02, 1.04)))  # x offsets so equal points stay visible
    for ax, task in zip(axes[0], task_names):
        for meth, (col, mk, ls) in styles.items():
            src = base if meth in ("full", "sliding-4096") else mine
            pts = sorted((c["target_tokens"], c["accuracy"]) for c in src if c["task"] == task and c["method"] == meth)
            if pts:
                lab = meth + (" (baselines)" if src is base else "")
                ax.plot([p[0] * shift[meth] for p in pts], [p[1] for p in pts], color=col, marker=mk,
                        linestyle=ls, label=lab, alpha=0.85)
        style_accuracy_axis(ax, task)
    axes[0][0].set_ylabel("accuracy (5 seeds)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("Accuracy vs history length (dotted: native window 8192; markers offset slightly in x)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None
