"""Multi-question agent sessions, generated offline: the fidelity evaluation's tasks.

A session is the history an agent has built (system prompt, the user's
instruction, then tool calls and their results) followed by several
questions, asked one step after another:

    system      the agent's role
    user        the task ("Work through the files ... then answer my questions.")
    assistant   read_file("<path>")             \\
    tool        <a file's content>               |  until the history reaches
    ...                                          /   `history_tokens`
    user        question 1                       step 1 ends here (+ answer prefix)
    assistant   gold answer 1
    user        question 2                       step 2 ends here
    ...

Every question is one trial. Earlier questions stay in the history with their
*gold* answers (teacher forcing), so every method sees the same step prompts
whatever it answered before. Questions about facts written in one template
(`multikey`'s numbers, `vartrack`'s chains, `code`'s parameter defaults)
make each later step hold look-alikes of what it asks, in the history and in
the earlier turns.

Families (RULER's niah, vt and qa tasks in agent form, and a coding session):

* `passkey`   essays; one pass key; one question.
* `multikey`  essays; eight "special magic number for <key>" lines; three
              questions about three of them.
* `vartrack`  essays; four chains "VAR X = <number>" ... "VAR Y = VAR X"; three
              questions, each about the end of one chain.
* `squad`     SQuAD paragraphs (one per question, the gold one) among
              distractor paragraphs, as documents read one batch per call;
              three questions (RULER qa_1).
* `hotpotqa`  HotpotQA: each question's supporting paragraphs among
              distractors; three questions (RULER qa_2).
* `code`      real Python standard-library files, one per call; three
              questions about the default value of a parameter of a function
              in one earlier file (the answer is a literal of that file).

Contract: pure functions of (family, history_tokens, seed, tokenizer,
corpora); the same arguments give the same session on every machine
(`random.Random` over a string). `history_tokens` counts the rendered history
(chat template included) up to the first question and lands within 1% below
the target. No engine, no network.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Callable, Iterator

from corpora import Corpora, chunk_lines

FAMILIES = ("passkey", "multikey", "vartrack", "squad", "hotpotqa", "code")
QUESTIONS = {"passkey": 1, "multikey": 3, "vartrack": 3, "squad": 3, "hotpotqa": 3, "code": 3}
SYSTEM_PROMPT = ("You are a careful software agent. You work through a project with the read_file tool; "
                 "each tool result is shown to you as a message. When the user asks a question, answer it "
                 "from what the tool results contained.")
INSTRUCTIONS = {
    "essays": "Read the documents in notes/ one by one, then answer my questions.",
    "docs": "Read the documents in wiki/ one batch at a time, then answer my questions.",
    "code": "Read the source files I point you to, one by one, then answer my questions about them.",
}
GOLDEN = 0.6180339887498949  # spreads fact depths evenly over seeds
ESSAY_TURN_TOKENS = (350, 700)
DOCS_PER_TURN = (3, 6)
CODE_TURN_TOKENS = 3000  # a longer file is read in parts


@dataclass
class Question:
    text: str
    answers: list[str]  # accepted answers (`is_correct`)
    prefix: str | None  # assistant answer prefix the model continues, if any
    evidence: list[str]  # exact strings of the history the answer needs
    depth: float  # where the (first) evidence sits, 0 = oldest history
    kind: str = "number"  # how `is_correct` matches: number, text, literal

    def gold_reply(self) -> str:
        """The answer turn kept in the history of later steps."""
        answer = self.answers[0]
        return f"{self.prefix} {answer}." if self.prefix else answer


@dataclass
class Session:
    family: str
    history_tokens: int
    seed: int
    history: list[dict]  # system, instruction, tool calls and results
    questions: list[Question]
    meta: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.family}-{self.history_tokens}-{self.seed}"

    def step_messages(self, q: int) -> list[dict]:
        """The messages of step `q` (0-based): the history, earlier questions
        with their gold answers, question `q` and its answer prefix."""
        msgs = list(self.history)
        for earlier in self.questions[:q]:
            msgs.append({"role": "user", "content": earlier.text})
            msgs.append({"role": "assistant", "content": earlier.gold_reply()})
        question = self.questions[q]
        msgs.append({"role": "user", "content": question.text})
        if question.prefix:
            msgs.append({"role": "assistant", "content": question.prefix})
        return msgs


# ---------------------------------------------------------------- checking

def _normalize(text: str) -> str:
    text = text.lower()
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    text = re.sub(r"[^\w\s.'\"-]", " ", text)
    return " ".join(text.split())


def is_correct(question: Question, response: str) -> bool:
    """number: a gold number, not inside a longer one; text: a gold answer
    (normalized, RULER's part match) inside the reply; literal: the gold
    literal, with or without its quotes."""
    for answer in question.answers:
        if question.kind == "number":
            if re.search(r"(?<!\d)" + re.escape(answer) + r"(?!\d)", response):
                return True
        elif question.kind == "text":
            if _normalize(answer) and _normalize(answer) in _normalize(response):
                return True
        else:
            bare = answer.strip("'\"")
            pattern = r"(?<![\w.])" + re.escape(bare) + r"(?![\w])" if bare else re.escape(answer)
            if re.search(pattern, response):
                return True
    return False


# ---------------------------------------------------------------- rendering

def render_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the prompt a vLLM server builds from `messages`; a final
    assistant message is an answer prefix the model continues."""
    cont = messages[-1]["role"] == "assistant"
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=not cont,
                                        continue_final_message=cont)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def token_at(tokenizer, ids: list[int], char: int) -> int:
    """The index of the token of `ids` whose decoded text covers character
    `char` of `tokenizer.decode(ids)` (prefixes decoded, binary search)."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid + 1])) > char:
            hi = mid
        else:
            lo = mid + 1
    return lo


def history_token_count(tokenizer, history: list[dict]) -> int:
    """Tokens of the rendered history alone (no generation prompt)."""
    ids = tokenizer.apply_chat_template(history, tokenize=True, add_generation_prompt=False)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


def render_text(tokenizer, messages: list[dict]) -> str:
    cont = messages[-1]["role"] == "assistant"
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=not cont,
                                         continue_final_message=cont)


class TokenCounter:
    """Token counts of messages without rendering a whole history each time:
    a message costs its content's tokens plus a fixed overhead (role markers
    are special tokens, so merges never cross them)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        base = len(render_ids(tokenizer, [{"role": "system", "content": "x"}, {"role": "user", "content": "x"}]))
        one = len(render_ids(tokenizer, [{"role": "system", "content": "x"}, {"role": "user", "content": "x"},
                                         {"role": "tool", "content": "x"}]))
        self.overhead = one - base - 1

    def content(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def message(self, text: str) -> int:
        return self.content(text) + self.overhead


# ---------------------------------------------------------------- facts

def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def _depth(seed: int, q: int, per_session: int) -> float:
    return (0.5 + (seed * per_session + q) * GOLDEN) % 1.0


ADJECTIVES = ("amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen",
              "lucky", "mellow", "noble", "olive", "proud", "quiet", "rapid", "silver", "tidy", "upper", "vivid",
              "wild", "young", "zesty")
NOUNS = ("anchor", "badger", "canyon", "dagger", "engine", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "river", "saddle", "tunnel",
         "valley", "walnut", "yonder", "zephyr", "beacon")


def _needle_facts(family: str, rng: random.Random, seed: int) -> tuple[list[tuple[float, str]], list[Question]]:
    """(fact lines with their depths, questions) of the essay families."""
    n_q = QUESTIONS[family]
    if family == "passkey":
        key = _number(rng, 5)
        line = f"The pass key is {key}. Remember it. {key} is the pass key."
        depth = _depth(seed, 0, 1)
        return [(depth, line)], [Question("What is the pass key mentioned in the documents? Answer with the "
                                          "number only.", [key], "The pass key is", [line], depth)]
    if family == "multikey":
        keys: list[str] = []
        while len(keys) < 8:
            k = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
            if k not in keys:
                keys.append(k)
        values = [_number(rng, 7) for _ in keys]
        depths = [_depth(seed, q, n_q) for q in range(n_q)] + [rng.random() for _ in keys[n_q:]]
        lines = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)]
        questions = [Question(f"What is the special magic number for {keys[q]} mentioned in the documents? "
                              "Answer with the number only.", [values[q]],
                              f"The special magic number for {keys[q]} is", [lines[q]], depths[q])
                     for q in range(n_q)]
        return list(zip(depths, lines)), questions
    if family == "vartrack":
        names: set[str] = set()

        def fresh() -> str:
            while True:
                name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
                if name not in names:
                    names.add(name)
                    return name

        facts, questions = [], []
        for c in range(4):  # chains of two hops; the first three are asked
            first, second, value = fresh(), fresh(), _number(rng, 5)
            start = _depth(seed, c, n_q) * 0.7 if c < n_q else rng.random() * 0.7
            later = start + (1 - start) * rng.random()
            lines = [f"VAR {first} = {value}", f"VAR {second} = VAR {first}"]
            facts += [(start, lines[0]), (later, lines[1])]
            if c < n_q:
                questions.append(Question(
                    f"Follow the variable assignments in the documents: what number does VAR {second} hold? "
                    "Answer with the number only.", [value], f"VAR {second} holds the number", lines, start))
        return facts, questions
    raise ValueError(family)


# ---------------------------------------------------------------- history builders

def _assemble(instruction: str, turns: list[tuple[str, str]]) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": instruction}]
    for call, result in turns:
        msgs.append({"role": "assistant", "content": call})
        msgs.append({"role": "tool", "content": result})
    return msgs


def _essay_session(family: str, target: int, seed: int, counter: TokenCounter, corpora: Corpora,
                   rng: random.Random) -> tuple[list[dict], list[Question]]:
    facts, questions = _needle_facts(family, rng, seed)
    lines, counts = corpora.essay_lines(counter)
    budget = target - counter.message(SYSTEM_PROMPT) - counter.message(INSTRUCTIONS["essays"])
    budget -= sum(counter.content(text) + 1 for _, text in facts)
    pos = rng.randrange(len(lines))
    turns: list[list[str]] = []
    total = 0
    while True:  # whole lines until the budget: turns of 350-700 tokens
        size = rng.randint(*ESSAY_TURN_TOKENS)
        turn, got = [], 0
        call = counter.message(f'read_file("notes/part_{len(turns) + 1:03d}.txt")') + counter.overhead
        while got < size and total + call + got + counts[pos] + 1 <= budget:
            turn.append(lines[pos])
            got += counts[pos] + 1
            pos = (pos + 1) % len(lines)
        if not turn:
            break
        turns.append(turn)
        total += call + got
    # Facts between two lines, at their depths (share of all lines), from the back.
    flat = [(t, j) for t, turn in enumerate(turns) for j in range(len(turn) + 1)]
    for depth, text in sorted(facts, key=lambda f: -f[0]):
        t, j = flat[min(int(depth * len(flat)), len(flat) - 1)]
        turns[t].insert(j, text)
    calls = [f'read_file("notes/part_{i + 1:03d}.txt")' for i in range(len(turns))]
    return _assemble(INSTRUCTIONS["essays"], list(zip(calls, ["\n".join(t) for t in turns]))), questions


def _qa_session(family: str, target: int, seed: int, counter: TokenCounter, corpora: Corpora,
                rng: random.Random) -> tuple[list[dict], list[Question]]:
    items = corpora.qa_items(family)
    n_q = QUESTIONS[family]
    picks = rng.sample(range(len(items)), n_q)
    gold_docs: list[tuple[float, int]] = []  # (depth, doc index)
    questions = []
    for q, i in enumerate(picks):
        item, depth = items[i], _depth(seed, q, n_q)
        for k, doc in enumerate(item.docs):
            gold_docs.append((min(depth + 0.02 * k, 0.999), doc))
        questions.append(Question(f"Answer the question based on the documents: {item.question} "
                                  "Answer with a short phrase only.", item.answers, None,
                                  [corpora.docs(family)[d] for d in item.docs], depth, kind="text"))
    docs = corpora.docs(family)
    taken = {d for _, d in gold_docs}
    related = list(dict.fromkeys(d for i in picks for d in items[i].related if d not in taken))
    budget = target - counter.message(SYSTEM_PROMPT) - counter.message(INSTRUCTIONS["docs"])
    total = sum(corpora.doc_tokens(family, d, counter) + 10 for _, d in gold_docs)
    candidates = related + [d for d in rng.sample(range(len(docs)), len(docs)) if d not in taken]
    stream: list[int] = []
    for d in dict.fromkeys(candidates):  # distractors until the budget, same-article ones first
        cost = corpora.doc_tokens(family, d, counter) + 10
        if total + cost > budget:
            if len(stream) > len(related):
                break
            continue
        stream.append(d)
        total += cost
    rng.shuffle(stream)
    for depth, d in sorted(gold_docs, key=lambda g: -g[0]):
        stream.insert(int(depth * len(stream)), d)
    turns, i, n = [], 0, 0
    while i < len(stream):
        k = rng.randint(*DOCS_PER_TURN)
        batch = stream[i : i + k]
        body = "\n\n".join(f"Document {n + j + 1}:\n{docs[d]}" for j, d in enumerate(batch))
        turns.append((f'read_file("wiki/batch_{len(turns) + 1:03d}.txt")', body))
        i += k
        n += len(batch)
    return _assemble(INSTRUCTIONS["docs"], turns), questions


def _code_session(family: str, target: int, seed: int, counter: TokenCounter, corpora: Corpora,
                  rng: random.Random) -> tuple[list[dict], list[Question]]:
    """Files read whole or in parts; each question asks for a literal of one
    file (`Corpora.rare_facts`), read at the question's depth, whose name is
    defined once in the session. The literal is replaced by a fresh one of the
    same form (`_fresh_literal`), so that no model can answer from memory of
    the library."""
    files = corpora.code_files()
    n_q = QUESTIONS[family]
    budget = target - counter.message(SYSTEM_PROMPT) - counter.message(INSTRUCTIONS["code"])
    pool = corpora.rare_facts()  # (file, fact) pairs

    def reads(path: str, chunks: list[str]) -> list[tuple[str, str]]:
        return [(f'read_file("{path}")' if part == 0 else f'read_file("{path}", part={part + 1})', chunk)
                for part, chunk in enumerate(chunks)]

    def cost(turns: list[tuple[str, str]]) -> int:
        return sum(counter.message(call) + counter.message(body) for call, body in turns)

    for _ in range(50):  # draw facts until their names are defined once in the session
        picks = []  # (file, fact, its reads with the fresh literal, the fresh literal, its line)
        for f, (name, param, literal, line) in rng.sample(pool, len(pool)):
            path, text = files[f]
            if any(p[0] == f for p in picks) or text.count(line) != 1:
                continue
            fresh = _fresh_literal(literal, rng)
            new_line = line.replace(literal, fresh, 1)
            turns = reads(path, chunk_lines(text.replace(line, new_line, 1), counter, CODE_TURN_TOKENS))
            if cost(turns) < budget // (2 * n_q):
                picks.append((f, (name, param), turns, fresh, new_line))
            if len(picks) == n_q:
                break
        total = sum(cost(p[2]) for p in picks)
        history: list[tuple[str, str]] = []
        for f in rng.sample(range(len(files)), len(files)):
            if budget - total < 200:
                break
            path = files[f][0]
            more = reads(path, corpora.code_chunks(f, counter, CODE_TURN_TOKENS))
            if any(p[0] == f for p in picks) or total + cost(more) > budget:
                continue
            history += more
            total += cost(more)
        for q in sorted(range(n_q), key=lambda q: -_depth(seed, q, n_q)):
            at = int(_depth(seed, q, n_q) * len(history))
            while 0 < at < len(history) and "part=" in history[at][0]:
                at -= 1  # never between the parts of one file
            history[at:at] = picks[q][2]
        if not all(_defined_once(name, bool(param), history) for _, (name, param), *_ in picks):
            continue
        questions = []
        for q, (f, (name, param), _, fresh, new_line) in enumerate(picks):
            path = files[f][0]
            ask = (f"In {path}, what is the default value of the parameter `{param}` of `{name}`?" if param
                   else f"In {path}, what value is the module constant `{name}` set to?")
            questions.append(Question(ask + " Answer with the value only, as written in the source.", [fresh],
                                      None, [new_line], _depth(seed, q, n_q), kind="literal"))
        return _assemble(INSTRUCTIONS["code"], history), questions
    raise RuntimeError(f"code session {target}/{seed}: no facts defined once in the session")


def _fresh_literal(literal: str, rng: random.Random) -> str:
    """A new literal of the same form as `literal`: a number of the same base
    and about the same size, or a string of two words in the same quotes."""
    if literal[:1] in "'\"":
        q = literal[0]
        return f"{q}{rng.choice(ADJECTIVES)}_{rng.choice(NOUNS)}{q}"
    low = literal.lower()
    for prefix, digits in (("0x", "0123456789abcdef"), ("0o", "01234567"), ("0b", "01")):
        if low.startswith(prefix):
            body = literal[2:]
            return literal[:2] + rng.choice(digits[1:]) + "".join(rng.choice(digits) for _ in body[1:])
    if "." in literal or "e" in low:
        return f"{rng.randint(10, 999)}.{rng.randint(1, 9)}"
    return str(rng.randint(10 ** max(len(literal.lstrip('-')) - 1, 1), 10 ** max(len(literal.lstrip('-')), 2) - 1))


def _defined_once(name: str, function: bool, turns: list[tuple[str, str]]) -> bool:
    """`name` is defined once in the session's files: as a function, or
    assigned at the start of a line (a module constant)."""
    pattern = re.compile(r"def " + re.escape(name) + r"\(" if function else r"(?m)^" + re.escape(name) + r"\s*=")
    return sum(len(pattern.findall(body)) for _, body in turns) == 1


BUILDERS: dict[str, Callable] = {"passkey": _essay_session, "multikey": _essay_session,
                                 "vartrack": _essay_session, "squad": _qa_session, "hotpotqa": _qa_session,
                                 "code": _code_session}


def generate(family: str, history_tokens: int, seed: int, tokenizer, corpora: Corpora) -> Session:
    """One session whose history renders to `history_tokens` tokens (within 1% below)."""
    if family not in BUILDERS:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    if history_tokens < 1024:
        raise ValueError(f"history_tokens={history_tokens} is too small (at least 1024)")
    counter = TokenCounter(tokenizer)

    def build(target: int):
        rng = random.Random(f"sekv-fidelity/{family}/{history_tokens}/{seed}")
        return BUILDERS[family](family, target, seed, counter, corpora, rng)

    # Contents are counted apart, which over-counts a little: build once, then
    # again for a target scaled by what the first render held.
    history, questions = build(history_tokens)
    got = history_token_count(tokenizer, history)
    if got < history_tokens * 0.995:
        history, questions = build(int(history_tokens * history_tokens / got))
    # The estimate counts contents apart; trim whole tool turns from the end if the render is over.
    evidence = [e for q in questions for e in q.evidence]
    while history_token_count(tokenizer, history) > history_tokens:
        last = max(i for i, m in enumerate(history) if m["role"] == "tool" and
                   not any(e in m["content"] for e in evidence))
        del history[last - 1 : last + 1]
    for e in evidence:
        if not any(e in m["content"] for m in history):
            raise RuntimeError(f"{family} {history_tokens}/{seed}: evidence {e[:40]!r} is not in the history")
    tokens = history_token_count(tokenizer, history)
    return Session(family, history_tokens, seed, history, questions,
                   meta={"rendered_history_tokens": tokens, "tool_turns": sum(m["role"] == "tool" for m in history)})


def iter_sessions(family: str, history_tokens: int, seeds: list[int], tokenizer,
                  corpora: Corpora) -> Iterator[Session]:
    for seed in seeds:
        yield generate(family, history_tokens, seed, tokenizer, corpora)


