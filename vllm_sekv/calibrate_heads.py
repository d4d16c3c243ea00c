"""`vllm-sekv calibrate-heads MODEL`: find the model's retrieval heads offline.

The file it writes is what config `rerank_heads_path` loads
(`index.retrieval_heads`): the query heads whose attention the token-level
re-rank combines. The measurement mirrors what the re-rank asks of a head.

Each text is a seeded window of ``tokens`` tokens of the essay corpus
(`calibration_corpus`) with ``facts`` look-alike lines planted at random
depths, all in one template and differing only in a name and a number (``The
deploy key for service QXKZV is 4718305.``; each text takes the next of three
templates), followed by a question about one of them in the model's chat
template (a plain ``Question: ...`` line without one). One forward pass of the
frozen model (float32, CPU, `torch.no_grad`) with hooks on every layer's
pre-RoPE query and key projections (`calibrate._Capture`) gives, per layer and
query head, each question token's attention over the history (a softmax over
the history alone, as the re-rank's runs over its candidates alone), summed
over the question's tokens; a head's share is the part of it on the asked
line's tokens, out of the history past the first ``sink_tokens`` (a view
keeps those whatever it selects, and the re-rank never scores them). Shares are averaged over the texts, and the ``heads``
heads with the largest mean share are written, best first, with every head's
share and the calibration's arguments.

Supports the models `calibrate` supports (Llama-like ``*ForCausalLM``).
Blocking, single process; writes only ``out`` (atomically). Raises
`ValueError` naming the argument on a bad one.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass

import torch

TEMPLATES = ("The deploy key for service {name} is {value}.",
             "Remember: the access code of {name} is {value}.",
             "VAR {name} = {value}")


@dataclass
class HeadsArgs:
    model: str
    out: str
    texts: int = 12
    tokens: int = 2048
    facts: int = 4
    heads: int = 16
    sink_tokens: int = 64
    seed: int = 0
    threads: int = 2

    def check(self) -> None:
        for key in ("texts", "tokens", "facts", "heads", "threads"):
            if getattr(self, key) < 1:
                raise ValueError(f"calibrate-heads '{key}': must be >= 1, got {getattr(self, key)}")
        if self.sink_tokens < 0:
            raise ValueError(f"calibrate-heads 'sink_tokens': must be >= 0, got {self.sink_tokens}")
        if self.tokens < self.sink_tokens + 64 * self.facts:
            raise ValueError(f"calibrate-heads 'tokens': {self.tokens} leaves no room for {self.facts} facts "
                             f"after the {self.sink_tokens} sink tokens")


def _name(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def _question(tok, template: str, name: str) -> list[int]:
    asked = template.split("{value}")[0].format(name=name).strip()
    text = f"Complete from the text above: {asked} ..."
    if getattr(tok, "chat_template", None):
        rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
        return tok.encode("\n\n" + rendered, add_special_tokens=False)
    return tok.encode(f"\n\nQuestion: {text}\nAnswer:", add_special_tokens=False)


def make_text(tok, stream: list[int], args: HeadsArgs, index: int) -> tuple[list[int], int, tuple[int, int]]:
    """Text `index`: (its tokens, where the question starts, the asked line's [start, end) tokens)."""
    rng = random.Random(f"{args.seed}-{index}")
    template = TEMPLATES[index % len(TEMPLATES)]
    offset = rng.randrange(len(stream) - args.tokens + 1)
    history = stream[offset:offset + args.tokens]
    facts = [(_name(rng), str(rng.randrange(10 ** 6, 10 ** 7))) for _ in range(args.facts)]
    cuts = sorted(rng.sample(range(args.sink_tokens, args.tokens - 16), args.facts))
    ids: list[int] = []
    spans = []
    last = 0
    for (name, value), cut in zip(facts, cuts):
        ids += history[last:cut]
        line = tok.encode("\n" + template.format(name=name, value=value) + "\n", add_special_tokens=False)
        spans.append((len(ids), len(ids) + len(line)))
        ids += line
        last = cut
    ids += history[last:]
    asked = rng.randrange(args.facts)
    return ids + _question(tok, template, facts[asked][0]), len(ids), spans[asked]


@torch.no_grad()
def head_shares(model, cap, geometry, ids: list[int], hist: int, span: tuple[int, int], sink: int) -> torch.Tensor:
    """[layers, query heads]: the share of the question tokens' attention on
    the history past `sink` that falls on the tokens `span`."""
    from vllm_sekv.calibrate import _rotate

    g = geometry
    cap.keep_q = len(ids) - hist
    model.model(input_ids=torch.tensor([ids]), use_cache=False)
    pos = torch.arange(len(ids))
    k0 = cap.k[0]
    cos, sin = model.model.rotary_emb(k0[None], pos[None])
    cos, sin = cos[0].float(), sin[0].float()
    rep = g.num_q_heads // g.num_kv_heads
    out = torch.zeros(g.num_layers, g.num_q_heads)
    a, b = span[0] - sink, span[1] - sink
    for layer in range(g.num_layers):
        scale = getattr(model.model.layers[layer].self_attn, "scaling", g.head_dim ** -0.5)
        q = _rotate(cap.q[layer], cos[hist:], sin[hist:])
        k = _rotate(cap.k[layer][:hist], cos[:hist], sin[:hist]).repeat_interleave(rep, dim=1)
        logits = torch.einsum("nhd,thd->hnt", q, k) * scale
        causal = pos[None, :hist] > pos[hist:, None]                                 # [N, hist]
        att = torch.softmax(logits.masked_fill(causal, -math.inf), -1)[..., sink:].sum(1)  # [Hq, hist - sink]
        out[layer] = att[:, a:b].sum(-1) / att.sum(-1)
    cap.q.clear()
    cap.k.clear()
    return out


def run(args: HeadsArgs) -> dict:
    """Measure, write `args.out`, and return a summary (the heads, their
    shares, the mean share of all heads, the uniform share of the asked lines)."""
    from tqdm import tqdm

    from vllm_sekv.calibrate import _Capture, load_model
    from vllm_sekv.calibration_corpus import essay_paths
    from vllm_sekv.index.retrieval_heads import RetrievalHeads

    args.check()
    torch.set_num_threads(args.threads)
    model, tok, geometry = load_model(args.model)
    stream: list[int] = []
    for path in essay_paths():
        stream += tok.encode(path.read_text(encoding="utf-8", errors="replace").strip() + "\n\n",
                             add_special_tokens=False)
        if len(stream) > 8 * args.tokens:
            break
    if len(stream) < args.tokens:
        raise ValueError(f"calibrate-heads 'tokens': {args.tokens} exceeds the essays ({len(stream)} tokens)")
    if args.heads > geometry.num_layers * geometry.num_q_heads:
        raise ValueError(f"calibrate-heads 'heads': {args.heads} exceeds the model's "
                         f"{geometry.num_layers * geometry.num_q_heads} query heads")
    cap = _Capture(model, geometry)
    total = torch.zeros(geometry.num_layers, geometry.num_q_heads)
    uniform = 0.0
    started = time.monotonic()
    for i in tqdm(range(args.texts), desc="measuring heads", unit="text"):
        ids, hist, span = make_text(tok, stream, args, i)
        total += head_shares(model, cap, geometry, ids, hist, span, args.sink_tokens)
        uniform += (span[1] - span[0]) / (hist - args.sink_tokens)
    share = total / args.texts
    best = share.flatten().topk(args.heads).indices.tolist()
    heads = tuple(divmod(i, geometry.num_q_heads) for i in best)
    calibration = {**asdict(args), "seconds": round(time.monotonic() - started, 1)}
    del calibration["out"], calibration["threads"]
    RetrievalHeads(geometry, heads, tuple(tuple(round(x, 6) for x in row) for row in share.tolist()),
                   calibration).write(args.out)
    return {"model": geometry.name, "heads": [list(h) for h in heads],
            "shares": [round(float(share[h]), 4) for h in heads], "mean_share": round(float(share.mean()), 4),
            "uniform_share": round(uniform / args.texts, 4), "seconds": calibration["seconds"]}


def format_report(res: dict) -> str:
    lines = [f"retrieval heads of {res['model']} (layer, query head: mean share of the question's attention "
             f"on the asked line; every head's mean {res['mean_share']:.3f}, the line's share of the history "
             f"{res['uniform_share']:.3f})"]
    lines += [f"  ({layer:2d}, {head:2d})  {s:.3f}" for (layer, head), s in zip(res["heads"], res["shares"])]
    return "\n".join(lines)
