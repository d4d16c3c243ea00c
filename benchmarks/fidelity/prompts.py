"""What each method sends for one step of a session (`sessions.Session`).

Methods that prefill text fit the step into a token budget; the history
(system prompt, instruction, tool calls and results) is what they choose
from, and the step's tail (earlier questions with their answers, the
question, its answer prefix) is always kept whole:

* `full`     the whole step (only where it fits the model's window).
* `sliding`  head (system + instruction) + the latest tool turns that fit;
             the oldest one kept may lose its first lines.
* `rag`      head + the tool results' passages (at most `PASSAGE_TOKENS`
             whole lines each) that BM25 (`bm25s`) ranks highest against the
             question, in their original order, as many as fit.
* `oracle`   head + every tool turn holding the question's evidence + the
             latest other turns that fit.

Views (`views`, `meank`, `sekv...`) send the whole step to a sekv server,
which chooses the history on its own; nothing is built here for them.

Each returns a `Prompt`: the messages, and for `rag` the time its retrieval
took, which is part of that method's time to first token.
`evidence_in(session, q, messages)` says whether a prompt holds every
evidence line the question needs: the ceiling of what a text method can
answer. Pure functions of the session and the tokenizer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from sessions import Session, render_ids

PASSAGE_TOKENS = 256
HEAD_MESSAGES = 2  # system prompt + instruction


@dataclass
class Prompt:
    messages: list[dict]
    retrieval_s: float = 0.0  # time spent choosing what to send (rag: chunking, indexing, ranking)


def _split(session: Session, q: int) -> tuple[list[dict], list[tuple[dict, dict]], list[dict]]:
    """(head, tool turns as (call, result) pairs, the step's tail)."""
    msgs = session.step_messages(q)
    history = len(session.history)
    pairs = [(msgs[i], msgs[i + 1]) for i in range(HEAD_MESSAGES, history, 2)]
    return msgs[:HEAD_MESSAGES], pairs, msgs[history:]


def count(tokenizer, messages: list[dict]) -> int:
    return len(render_ids(tokenizer, messages))


def full(session: Session, q: int, tokenizer, budget: int | None = None) -> Prompt:
    return Prompt(session.step_messages(q))


def _largest_fit(build, lo: int, hi: int, tokenizer, budget: int) -> int:
    """Largest n in [lo, hi] with count(build(n)) <= budget (build grows with n), or lo - 1."""
    if count(tokenizer, build(lo)) > budget:
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(tokenizer, build(mid)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _with_partial(head, kept: list[tuple[dict, dict]], partial: tuple[dict, dict] | None, lines: int,
                  tail) -> list[dict]:
    body = []
    if partial is not None and lines:
        call, result = partial
        text = result["content"].split("\n")
        body += [call, {**result, "content": "\n".join(text[len(text) - lines:])}]
    for call, result in kept:
        body += [call, result]
    return head + body + tail


def sliding(session: Session, q: int, tokenizer, budget: int) -> Prompt:
    head, pairs, tail = _split(session, q)
    if count(tokenizer, head + tail) > budget:
        raise ValueError(f"budget {budget} is smaller than the head and the question")
    whole = _largest_fit(lambda n: _with_partial(head, pairs[len(pairs) - n:], None, 0, tail),
                         0, len(pairs), tokenizer, budget)
    if whole == len(pairs):
        return Prompt(_with_partial(head, pairs, None, 0, tail))
    older = pairs[len(pairs) - whole - 1]
    num_lines = len(older[1]["content"].split("\n"))
    lines = _largest_fit(lambda n: _with_partial(head, pairs[len(pairs) - whole:], older, n, tail),
                         0, num_lines, tokenizer, budget)
    return Prompt(_with_partial(head, pairs[len(pairs) - whole:], older, max(lines, 0), tail))


def oracle(session: Session, q: int, tokenizer, budget: int) -> Prompt:
    head, pairs, tail = _split(session, q)
    evidence = session.questions[q].evidence
    gold = [i for i, (_, result) in enumerate(pairs) if any(e in result["content"] for e in evidence)]
    others = [i for i in range(len(pairs)) if i not in gold]

    def build(n: int) -> list[dict]:
        keep = sorted(gold + others[len(others) - n:] if n else gold)
        return _with_partial(head, [pairs[i] for i in keep], None, 0, tail)

    n = _largest_fit(build, 0, len(others), tokenizer, budget)
    if n < 0:
        raise ValueError(f"budget {budget} cannot hold the evidence turns of {session.id} question {q}")
    return Prompt(build(n))


def _passages(tokenizer, pairs: list[tuple[dict, dict]]) -> list[tuple[int, int, str]]:
    """(turn, first line, text) of every passage: runs of whole lines of at
    most PASSAGE_TOKENS tokens within one tool result."""
    out = []
    for t, (_, result) in enumerate(pairs):
        lines = result["content"].split("\n")
        counts = [len(i) + 1 for i in tokenizer(lines, add_special_tokens=False)["input_ids"]]
        start, got = 0, 0
        for j, n in enumerate(counts):
            if j > start and got + n > PASSAGE_TOKENS:
                out.append((t, start, "\n".join(lines[start:j])))
                start, got = j, 0
            got += n
        out.append((t, start, "\n".join(lines[start:])))
    return out


def rag(session: Session, q: int, tokenizer, budget: int) -> Prompt:
    import bm25s

    head, pairs, tail = _split(session, q)
    t0 = time.perf_counter()
    passages = _passages(tokenizer, pairs)
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize([p[2] for p in passages], stopwords="en", show_progress=False),
                    show_progress=False)
    query = bm25s.tokenize([session.questions[q].text], stopwords="en", show_progress=False)
    order, _ = retriever.retrieve(query, k=len(passages), show_progress=False)
    ranked = [int(i) for i in order[0]]
    retrieval_s = time.perf_counter() - t0

    def build(n: int) -> list[dict]:
        chosen = sorted(ranked[:n])  # original order
        body, turns = [], {}
        for i in chosen:
            turns.setdefault(passages[i][0], []).append(passages[i][2])
        for t in sorted(turns):
            call, result = pairs[t]
            body += [call, {**result, "content": "\n".join(turns[t])}]
        return head + body + tail

    n = _largest_fit(build, 0, len(ranked), tokenizer, budget)
    return Prompt(build(max(n, 0)), retrieval_s)


TEXT_METHODS = {"full": full, "sliding": sliding, "rag": rag, "oracle": oracle}


def evidence_in(session: Session, q: int, messages: list[dict]) -> bool:
    """Whether `messages` hold every evidence line of question `q` in a tool turn."""
    tools = [m["content"] for m in messages if m["role"] == "tool"]
    return all(any(e in t for t in tools) for e in session.questions[q].evidence)
