"""fp8 workspace codec study, on answers: does a history whose K/V went
through the fp8 codec still give a model's answers? CPU, Hugging Face
transformers, float32.

A multi-key history (`--facts` lines "The deploy key for service-NNNN is
NNNNNNN.", each followed by a line of filler) is prefilled once in a chat
prompt; its K/V (keys post-RoPE, as the host tier stores them) go through a
variant of the codec, 32-token block by block, and each of `--questions`
questions ("What is the deploy key for service-NNNN?") is then fed after
it and answered greedily. Variants:

* `bf16`: K/V rounded to bfloat16 (what the exact workspace stores);
* `fp8`: the workspace's fp8 codec (`vllm_sekv.store.fp8`: e4m3 with one
  scale per block, K or V, layer and KV head, around a per-channel centre
  in the channels whose block mean is a bias);
* `fp8-centre-all`: the same with every channel centred on its block mean;
* `fp8-uncentred`: the same without centres (the values as they are);
* `k-bf16-v-fp8`: keys as `bf16`, values as `fp8`.

Reported per variant: answers right out of n with a 95% Wilson interval,
and the mean relative Frobenius error of K and V per (layer, block). Writes
OUT.json and OUT.md::

    python benchmarks/codecs/fp8_answers.py --model ~/.cache/vllm-sekv/models/Qwen2.5-Coder-1.5B-Instruct
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "fidelity"))

import report_header as H  # noqa: E402
from report import wilson  # noqa: E402  (the fidelity report's 95% interval)
from vllm_sekv.store.fp8 import FP8_DTYPE, FP8_MAX, dequantize, quantize  # noqa: E402

BLOCK_TOKENS = 32


def fp8(blocks: torch.Tensor) -> torch.Tensor:
    """blocks [n, bt, H, D] float32 through the codec -> float32."""
    q, params, finite = quantize(blocks, token_dim=1)
    assert bool(finite.all())
    return dequantize(q, params, token_dim=1, dtype=torch.float32)


def fp8_centre_all(blocks: torch.Tensor) -> torch.Tensor:
    """e4m3 with one scale per (block, head) around every channel's block mean."""
    centre = blocks.mean(dim=1, keepdim=True)
    return fp8_uncentred(blocks - centre) + centre


def fp8_uncentred(blocks: torch.Tensor) -> torch.Tensor:
    """e4m3 with one scale per (block, head) and no centre."""
    scale = (blocks.abs().amax(dim=-1).amax(dim=1) / FP8_MAX).clamp_min(1e-30)[:, None, :, None]
    return (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(torch.float32) * scale


def bf16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.to(torch.bfloat16).float()


VARIANTS = {  # name -> (keys, values)
    "bf16": (bf16, bf16),
    "fp8": (fp8, fp8),
    "fp8-centre-all": (fp8_centre_all, fp8_centre_all),
    "fp8-uncentred": (fp8_uncentred, fp8_uncentred),
    "k-bf16-v-fp8": (bf16, fp8),
}


def through_codec(cache, history: int, keys_fn, values_fn) -> tuple:
    """A copy of `cache` whose first `history` tokens' K/V (whole blocks)
    went through the codec; (copy, mean rel error K, mean rel error V)."""
    out = copy.deepcopy(cache)
    errors = {"keys": [], "values": []}
    for layer in out.layers:
        for kind, fn in (("keys", keys_fn), ("values", values_fn)):
            x = getattr(layer, kind)  # [1, H, T, D]
            heads, dim = x.shape[1], x.shape[3]
            blocks = x[0, :, :history].reshape(heads, history // BLOCK_TOKENS, BLOCK_TOKENS, dim)
            blocks = blocks.permute(1, 2, 0, 3).float()  # [n, bt, H, D]
            got = fn(blocks)
            errors[kind] += ((got - blocks).flatten(1).norm(dim=1) / blocks.flatten(1).norm(dim=1)).tolist()
            x[0, :, :history] = got.permute(2, 0, 1, 3).reshape(heads, history, dim).to(x.dtype)
    mean = {kind: sum(v) / len(v) for kind, v in errors.items()}
    return out, mean["keys"], mean["values"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hugging Face model folder")
    ap.add_argument("--facts", type=int, default=40)
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--answer-tokens", type=int, default=10)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--out", default=str(H.results_dir("fp8_codec") / "answers"))
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    rng = random.Random(0)
    facts = [(f"service-{rng.randrange(1000, 9999)}", str(rng.randrange(1000000, 9999999))) for _ in range(args.facts)]
    lines = []
    for name, key in facts:
        lines += [f"The deploy key for {name} is {key}.", "Build finished, tests passed, cache warm."]
    asked = rng.sample(range(len(facts)), args.questions)

    def prompt(i: int) -> list[int]:
        content = "\n".join(lines) + f"\n\nWhat is the deploy key for {facts[i][0]}? Answer with the number only."
        text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                       tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]

    prompts = [prompt(i) for i in asked]
    common = min(next((j for j, (a, b) in enumerate(zip(p, prompts[0])) if a != b), len(p)) for p in prompts[1:])
    history = common // BLOCK_TOKENS * BLOCK_TOKENS
    t0 = time.time()
    with torch.no_grad():
        cache = model(torch.tensor([prompts[0][:history]]), use_cache=True).past_key_values
        print(f"history {history} tokens prefilled in {time.time() - t0:.0f} s", flush=True)

        def answer(cache, ids: list[int]) -> str:
            out = model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
            tokens = []
            for _ in range(args.answer_tokens):
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                tokens.append(int(nxt))
                out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
            return tok.decode(tokens, skip_special_tokens=True)

        rows = []
        for name in args.variants:
            keys_fn, values_fn = VARIANTS[name]
            right, answers = 0, []
            for i, ids in zip(asked, prompts):
                coded, k_err, v_err = through_codec(cache, history, keys_fn, values_fn)
                text = answer(coded, ids[history:])
                answers.append(text)
                right += facts[i][1] in text
            lo, hi = wilson(right, len(asked))
            rows.append({"variant": name, "n": len(asked), "correct": right, "ci95": [round(lo, 3), round(hi, 3)],
                         "k_rel_err": round(k_err, 4), "v_rel_err": round(v_err, 4), "answers": answers})
            print(f"{name}: {right}/{len(asked)}, K err {k_err:.4f}, V err {v_err:.4f}, {answers[:3]}", flush=True)
    meta = H.meta(H.command(__file__))
    lines_md = [*H.header_from(meta, "fp8 workspace codec on answers"),
                f"{os.path.basename(os.path.normpath(args.model))}, float32 on the CPU; a history of {history} "
                f"tokens holding {args.facts} deploy keys of look-alike services, {len(asked)} questions, each "
                f"answered greedily after the history's K/V went through the variant ({BLOCK_TOKENS}-token "
                "blocks). Relative errors: Frobenius, per (layer, block), mean.", "",
                "| variant | correct | 95% CI | K rel. error | V rel. error |", "|---|---|---|---|---|"]
    for r in rows:
        lines_md.append(f"| {r['variant']} | {r['correct']}/{r['n']} | {r['ci95'][0]:.2f}-{r['ci95'][1]:.2f} | "
                        f"{r['k_rel_err']:.4f} | {r['v_rel_err']:.4f} |")
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    H.write_report(out + ".md", lines_md)
    with open(out + ".json", "w") as f:
        json.dump({"meta": meta, "history_tokens": history, "facts": facts, "asked": asked, "rows": rows}, f, indent=1)
    print("\n".join(lines_md))


if __name__ == "__main__":
    main()
