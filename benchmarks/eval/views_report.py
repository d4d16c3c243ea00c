"""Markdown report (and plot) of the sekv-views run: `<out>.md`, `<out>.png`.

Every figure is computed from `<out>.json` (this run) and the baselines JSON
(`full`, `sliding-4096` rows, measured earlier with the same tasks and seeds).
"""
from __future__ import annotations

import statistics
from pathlib import Path

import tasks as tasklib
import views_eval as V
from eval_common import H

WINDOW = 8192
VIEW_METHODS = ("sekv-views-1024", "sekv-views-2048", "sekv-views-4096")


def _acc(c) -> str:
    return f"{c['accuracy']:.2f} ({c['correct']}/{c['n']})" if c else "—"


def _pool(cells) -> tuple[int, int]:
    return sum(c["correct"] for c in cells), sum(c["n"] for c in cells)


def _pct(k: int, n: int) -> str:
    return f"{100 * k / n:.0f}% ({k}/{n})" if n else "—"


def _f(x, fmt="{:.0f}") -> str:
    return "—" if x is None else fmt.format(x)


def _shown(path: str) -> str:
    """A path as the repository names it (absolute elsewhere)."""
    try:
        return str(Path(path).resolve().relative_to(H.REPO))
    except ValueError:
        return str(path)


def write(out: Path, data: dict, base: dict, base_path: str) -> None:
    meta, cells, trials = data["meta"], data["cells"], data["trials"]
    tasks_run = [t for t in tasklib.TASKS if any(c["task"] == t for c in cells)]
    bcells = V.baseline_cells(base, tasks_run)
    by = {(c["task"], c["target_tokens"], c["method"]): c for c in cells}
    bby = {(c["task"], c["target_tokens"], c["method"]): c for c in bcells}
    lengths = sorted({c["target_tokens"] for c in cells})
    in_window = [n for n in lengths if n < WINDOW]
    beyond = [n for n in lengths if n >= WINDOW]
    views = [r for r in trials if r["method"] == "sekv-views"]
    loads = [r["loadavg_1m"] for r in trials if "loadavg_1m" in r]
    L = H.header("sekv execution views on long-context agent tasks (SmolLM2-135M-Instruct)",
                 [f".venv/bin/{c}" for c in meta["commands"]], meta["machine"], meta.get("commit", "unknown"),
                 f"{meta.get('started')} – {meta.get('date')}")
    L += [f"vLLM {meta.get('vllm', '?')}, dtype **{meta['dtype']}** (the baselines' servers ran with vLLM's "
          "`auto`, which is bfloat16 for this model: their logs say `dtype=torch.bfloat16`), greedy, "
          f"max_tokens={meta['max_tokens']}, answer prefix: {meta['answer_prefix']}, prefix cache reset "
          f"before each timed request: {meta['reset_cache']}.", ""]
    if loads:
        L += [f"1-minute load average at the end of each trial: min {min(loads):.1f}, median "
              f"{statistics.median(loads):.1f}, max {max(loads):.1f} (2 cores shared with other jobs: "
              "compare TTFT only within this run).", ""]
    if meta.get("sekv_server"):
        s = meta["sekv_server"]
        L += ["sekv server (one for every budget; each request asks for its own budget):", "",
              "    " + " ".join(f"{k}={v}" for k, v in s["env"].items()) + " python " + s["cmd"], ""]
    if meta.get("plain_server"):
        s = meta["plain_server"]
        L += ["plain server (TTFT reference, same run):", "",
              "    " + " ".join(f"{k}={v}" for k, v in s["env"].items()) + " python " + s["cmd"], ""]
    L += ["## What was measured here and what comes from the baselines", "",
          "* **Measured in this run**: every `sekv-views-B` cell (one sekv server, per request "
          "`kv_transfer_params={\"view_tokens\": B}`, `cache_salt=\"budget-B\"`, `session_id` per trial) "
          "and the `plain-sliding-4096` cells (a plain vLLM server, `--max-model-len 8192`, re-prefilling "
          "the 4096-token sliding window, prefix cache reset before each request, its requests interleaved "
          "with the sekv trials of the same history).",
          f"* **Taken from `{_shown(base_path)}`** (measured {base['meta']['date']}, same tasks, same "
          "seeds 0-4, same generator, checker, max_tokens and answer prefix): the `full` and `sliding-4096` "
          "accuracy (and their TTFT, which ran in another machine state and is not compared here).",
          f"* Each sekv trial: {meta['replay_steps']} earlier steps of the session (the history cut after "
          "evenly spaced tool turns, the last one the final tool turn, `max_tokens=1`, not timed), then the "
          "measured step (the whole history + question, streamed; TTFT = first content chunk; the change of "
          "the server's `vllm:sekv_*` counters over it gives its probes, restored tokens and restore time), "
          "then the same step once more, not streamed, whose `kv_transfer_params.sekv.view` gives the "
          "`selected_blocks` (sink + selected + recent history blocks; the tail after them is in the view too) "
          "from which `needle selected` is computed: the 32-token block(s) of at least one occurrence of the "
          "gold answer's tokens in the rendered prompt (`tasks.render_ids`, block = token index // 32) are all "
          "in the view. `lines held`: every line the question needs (vartrack: both lines) is whole in the view.",
          "* Where the prompt fits the budget (`sekv-views-4096` at 4096) the step is no view: the whole "
          "prompt runs (history restored from the workspace); `needle selected` is then 1 and view tokens = "
          "prompt tokens.", ""]

    # ---------------------------------------------------------------- accuracy
    cols = ["full", "sliding-4096"] + [m for m in VIEW_METHODS if any(c["method"] == m for c in cells)]
    L += ["## Accuracy (correct / n, seeds 0-4)", "",
          "`full`, `sliding-4096`: from the baselines; `sekv-views-*`: this run.", "",
          "| task | history tokens | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for t in tasks_run:
        for n in lengths:
            row = [bby.get((t, n, m)) if m in ("full", "sliding-4096") else by.get((t, n, m)) for m in cols]
            if not any(by.get((t, n, m)) for m in VIEW_METHODS):
                continue
            L.append(f"| {t} | {n} | " + " | ".join(_acc(c) for c in row) + " |")

    # ---------------------------------------------------------------- targets
    L += ["", "## Targets", ""]
    btr = base["trials"]

    def blabel(r):
        return r["method"] if r["budget"] is None else f"{r['method']}-{r['budget']}"

    def bpool(task, n, meth, seeds=None):
        rs = [r for r in btr if r["task"] == task and r["target_tokens"] == n and blabel(r) == meth
              and (seeds is None or r["seed"] in seeds)]
        return sum(r["correct"] for r in rs), len(rs)

    def mine(task, n, meth):
        return [r for r in trials if r["task"] == task and r["target_tokens"] == n
                and (r["method"] if r["budget"] is None else f"{r['method']}-{r['budget']}") == meth]

    L += ["### Within the window: views of 1K/2K/4K vs full context (target: within 2 points at 2K)", "",
          "Paired: the same (task, length, seed) histories; `full` from the baselines' trials. "
          "`ok` = the views are not more than 2 points below full context.", "",
          "| budget | tasks | lengths | sekv-views | full | difference (points) | ok |",
          "|---|---|---|---|---|---|---|"]
    for m in VIEW_METHODS:
        groups = [tasks_run] + ([[t] for t in tasks_run] if m == "sekv-views-2048" and len(tasks_run) > 1 else [])
        for g in groups:
            ka = na = kb = nb = 0
            lens = set()
            for t in g:
                for n in in_window:
                    rs = mine(t, n, m)
                    k, nn = bpool(t, n, "full", {r["seed"] for r in rs})
                    if not rs or not nn:
                        continue
                    rs = [r for r in rs if any(b["seed"] == r["seed"] for b in btr if b["task"] == t
                                                and b["target_tokens"] == n and b["method"] == "full")]
                    ka += sum(r["correct"] for r in rs)
                    na += len(rs)
                    kb, nb, lens = kb + k, nb + nn, lens | {n}
            if not na:
                continue
            d = 100 * ka / na - 100 * kb / nb
            L.append(f"| {m.split('-')[-1]} | {', '.join(g)} | {', '.join(map(str, sorted(lens)))} | {_pct(ka, na)} | "
                     f"{_pct(kb, nb)} | {d:+.1f} | {'yes' if d >= -2 else 'no'} |")
    n_pool = sum(1 for t in tasks_run for n in in_window for _ in mine(t, n, "sekv-views-2048"))
    if n_pool:
        L += ["", f"With {n_pool} paired trials at 2K, one trial is {100 / n_pool:.1f} points: the 2-point "
              "target can only be read as 'no trial lost' (or more gained than lost)."]
    if beyond:
        fw = [r for r in btr if r["method"] == "full"]
        L += ["", "### Beyond the window: views of 4K vs sliding-4096, and vs in-window full context "
              "(target: at 32K at least 80% of the in-window full-context accuracy)", "",
              "In-window full-context accuracy = the baselines' `full` trials of the same task(s), pooled over "
              f"their in-window lengths ({', '.join(str(x) for x in sorted({r['target_tokens'] for r in fw}))}) "
              "and seeds 0-4. `sliding-4096`: the baselines' trials of the same seeds at that length.", "",
              "| task(s) | history tokens | sekv-views-4096 | sliding-4096 (baselines) | in-window full (baselines) "
              "| views / full | ≥ 80% |", "|---|---|---|---|---|---|---|"]
        for n in beyond:
            here = [t for t in tasks_run if mine(t, n, "sekv-views-4096")]
            groups = [[t] for t in here] + ([here] if len(here) > 1 else [])
            for g in groups:
                rs = [r for t in g for r in mine(t, n, "sekv-views-4096")]
                if not rs or any(not mine(t, n, "sekv-views-4096") for t in g):
                    continue
                ka, na = sum(r["correct"] for r in rs), len(rs)
                ks = ns = 0
                for t in g:
                    k, nn = bpool(t, n, "sliding-4096", {r["seed"] for r in rs if r["task"] == t})
                    ks, ns = ks + k, ns + nn
                kf = sum(r["correct"] for r in fw if r["task"] in g)
                nf = sum(1 for r in fw if r["task"] in g)
                ratio = (ka / na) / (kf / nf) if nf and kf else None
                L.append(f"| {' + '.join(g)} | {n} | {_pct(ka, na)} | {_pct(ks, ns)} | {_pct(kf, nf)} | "
                         f"{_f(ratio, '{:.2f}')} | {'—' if ratio is None else ('yes' if ratio >= 0.8 else 'no')} |")

    # ---------------------------------------------------------------- per cell
    L += ["", "## Per cell (this run)", "",
          "TTFT: the measured (streamed) step. `restore ms`, `restored`, `probes`: change of the server's "
          "`vllm:sekv_restore_seconds_total`, `_restored_tokens_total`, `_probes_total` over the measured "
          "step. `prefilled`: `kv_transfer_params.sekv.prefilled_tokens` of the repeated step (prompt tokens "
          "computed over its passes). `repeat`: trials whose repeated (non-streamed) answer equals the measured one.", "",
          "| task | history tokens | method | n | accuracy | needle in prompt | needle selected | lines held | "
          "TTFT mean (ms) | TTFT median (ms) | prompt tokens | view tokens | restore ms | restored | probes | "
          "prefilled | repeat |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = {m: i for i, m in enumerate(VIEW_METHODS + ("plain-sliding-4096",))}
    for c in sorted(cells, key=lambda c: (tasklib.TASKS.index(c["task"]), c["target_tokens"], order.get(c["method"], 9))):
        v = c["method"].startswith("sekv-views")
        L.append(
            f"| {c['task']} | {c['target_tokens']} | {c['method']} | {c['n']} | {c['accuracy']:.2f} | "
            f"{c['needles_in_prompt']:.2f} | {_f(c.get('needle_selected'), '{:.2f}')} | "
            f"{_f(c.get('required_lines_held'), '{:.2f}')} | {c['ttft_ms_mean']:.0f} | {c['ttft_ms_median']:.0f} | "
            f"{c['prompt_tokens_mean']:.0f} | {_f(c.get('view_tokens_mean'))} | "
            f"{_f(1000 * c['measured_sekv_restore_seconds_total'] if v else None, '{:.0f}')} | "
            f"{_f(c.get('measured_sekv_restored_tokens_total'))} | {_f(c.get('measured_sekv_probes_total'), '{:.1f}')} | "
            f"{_f(c.get('repeat_prefilled_tokens_mean'))} | "
            f"{str(c['repeat_agrees']) + '/' + str(c['n']) if v else '—'} |")

    # ---------------------------------------------------------------- needle selection vs accuracy
    if views:
        sel = [r for r in views if r.get("view")]
        L += ["", "## Needle selection and answers (trials served as views)", ""]
        if sel:
            def cnt(f):
                return sum(1 for r in sel if f(r))
            L += [f"* {len(sel)} view trials: needle selected in {cnt(lambda r: r['needle_selected'])}; "
                  f"correct in {cnt(lambda r: r['correct'])}; correct with the needle selected "
                  f"{cnt(lambda r: r['correct'] and r['needle_selected'])}, correct without it "
                  f"{cnt(lambda r: r['correct'] and not r['needle_selected'])}, wrong with it "
                  f"{cnt(lambda r: not r['correct'] and r['needle_selected'])}."]
        mk = [r for r in views if r["task"] == "multikey" and not r["correct"]]
        if mk:
            from transformers import AutoTokenizer
            from vllm_sekv.models import prepare_model
            tok = AutoTokenizer.from_pretrained(str(prepare_model(quiet=True)))
            n_dis = 0
            for r in mk:
                t = tasklib.generate("multikey", r["target_tokens"], r["seed"], tok)
                n_dis += any(tasklib.is_correct(v, r["response"]) for v in t.meta["distractors"].values())
            L += [f"* multikey, wrong answers of the measured steps (all budgets): {n_dis} of {len(mk)} are the "
                  "number of one of the three distractor keys (the baselines' note: 13 of 13 with full context)."]
        dis = [r for r in views if not r["repeat_agrees"]]
        L += [f"* Measured vs repeated answer: {len(views) - len(dis)} of {len(views)} identical."]
        for r in dis:
            L += [f"  * {r['task']} @ {r['target_tokens']}, seed {r['seed']}, budget {r['budget']}: measured "
                  f"{r['response']!r} ({'correct' if r['correct'] else 'wrong'}), repeated {r['repeat_response']!r} "
                  f"({'correct' if r['repeat_correct'] else 'wrong'})"]

    # ---------------------------------------------------------------- TTFT
    pl = [c for c in cells if c["method"] == "plain-sliding-4096"]
    if pl:
        L += ["", "## Time to first token: sekv view step vs plain vLLM re-prefilling the window (same run)", "",
              "sekv: the measured step of `sekv-views-4096` (probe over the new tokens + restore of the view's "
              "history from host memory with re-RoPE + prefill of the new tokens). Plain: the same history's "
              "4096-token sliding window prefilled from scratch (prefix cache reset) on a plain vLLM server, "
              "right after the sekv trial of the same history.", "",
              "| task | history tokens | n (sekv / plain) | sekv-views-4096 TTFT mean / median (ms) | "
              "plain-sliding-4096 TTFT mean / median (ms) | plain / sekv (median) | accuracy sekv / plain |",
              "|---|---|---|---|---|---|---|"]
        for c in sorted(pl, key=lambda c: (c["task"], c["target_tokens"])):
            seeds = {r["seed"] for r in trials if r["method"] == "plain-sliding" and r["task"] == c["task"]
                     and r["target_tokens"] == c["target_tokens"]}
            rs = [r for r in views if r["task"] == c["task"] and r["target_tokens"] == c["target_tokens"]
                  and r["budget"] == 4096 and r["seed"] in seeds]
            if not rs:
                continue
            tt = [r["ttft_s"] * 1000 for r in rs]
            med = statistics.median(tt)
            L.append(f"| {c['task']} | {c['target_tokens']} | {len(rs)} / {c['n']} | {statistics.mean(tt):.0f} / "
                     f"{med:.0f} | {c['ttft_ms_mean']:.0f} / {c['ttft_ms_median']:.0f} | "
                     f"{c['ttft_ms_median'] / med:.1f}x | {sum(r['correct'] for r in rs)}/{len(rs)} / "
                     f"{c['correct']}/{c['n']} |")
        rs = [r for r in views if r["budget"] == 4096 and r.get("replays")]
        if rs:
            L += ["", "Not in the TTFT: the earlier steps that put the history into the workspace (ingest "
                  "passes behind sink + recent blocks, then probe + final per step; mean seconds of all earlier "
                  "steps of a trial, budget 4096: " + ", ".join(
                      f"{n}: {statistics.mean(r['replay_s'] for r in rs if r['target_tokens'] == n):.0f} s"
                      for n in sorted({r['target_tokens'] for r in rs})) + ")."]

    # ---------------------------------------------------------------- coverage
    cov = [c for c in cells if c.get("coverage")]
    if cov:
        cm = meta.get("coverage", {})
        L += ["", "## Attention-mass coverage of the views (within the window)", "",
              f"Spec `{cm.get('spec')}`: Hugging Face transformers, SmolLM2 in {cm.get('dtype')} on CPU, the whole "
              "prompt at its true positions; for the prompt's last 64 tokens (the question and answer prefix), "
              "per layer (30), query head (9) and query, the softmax attention summed per 32-token block "
              "(queries/keys captured pre-RoPE from q_proj/k_proj as in `benchmarks/index_study/study.py`, "
              "rotated at their positions; checked against transformers' eager attention weights). "
              "Views: the repeated step's `selected_blocks`.", "",
              "* `view`: share of all attention mass on the blocks the view held (sink + selected + recent + tail).",
              "* `history`: share of the mass on the history (blocks before the tail) that falls in the held "
              "history blocks; `sliding` / `oracle`: the same for a set of as many history blocks made of the "
              "sink + the most recent blocks / of the blocks with the most mass (summed over layers, heads, queries).",
              "* `history share`: how much of all mass goes to the history at all (the rest stays in the tail).", "",
              "Mean over layers, heads and queries, then over trials.", "",
              "| task | history tokens | method | n | view | history | sliding (same size) | oracle (same size) | history share |",
              "|---|---|---|---|---|---|---|---|---|"]
        for c in cov:
            v = c["coverage"]
            L.append(f"| {c['task']} | {c['target_tokens']} | {c['method']} | {c['coverage_n']} | {v['view']:.3f} | "
                     f"{v['history']:.3f} | {v['history_sliding_same_size']:.3f} | {v['history_oracle_same_size']:.3f} | "
                     f"{v['history_share_of_all']:.3f} |")
        L += ["", "Coverage is not reported beyond the window: there the reference would be the model attending "
              "over 16K-64K positions it was never trained on (max_position_embeddings 8192). Its attention at "
              "those positions is not what the model would attend to if it could read the whole history; it is "
              "out-of-distribution (RoPE angles never seen in training, softmax spread over far more keys than "
              "in training), so a share of that mass measures agreement with a broken reference, not whether the "
              "view kept what matters. Beyond the window the needle-selected share and the accuracy are the measures."]

    if meta.get("notes"):
        L += ["", "## Notes", ""] + [f"* {n}" for n in meta["notes"]]
    L += ["", "## Plot", "", f"![accuracy vs history length]({out.name}.png)", "",
          "Accuracy vs history length per method: `full` and `sliding-4096` from the baselines, "
          "`sekv-views-1024/2048/4096` from this run; dotted line: the model's window (8192)."]
    H.write_report(Path(str(out) + ".md"), L)
    msg = V.plot_views(Path(str(out) + ".png"), cells, bcells)
    print(msg or f"wrote {out}.md and {out}.png")
