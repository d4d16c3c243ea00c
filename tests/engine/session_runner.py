"""Runs a multi-step agent session on a real offline vLLM engine, in its own process.

    python session_runner.py SPEC.json OUT.json

SPEC: {"model": dir, "sekv": extra_config or null, "turns": [text, ...],
       "max_tokens": n, "salt": str, "other_salt": str, "dtype": str,
       "reset": bool (default true)}
Each step's prompt is the previous prompt + the previous output + the next turn,
as token ids (no re-tokenization at the seams). vLLM's prefix cache is reset
before every step unless "reset" is false (then vLLM's own cache serves the
history: the case sekv replaces). After the session, the last prompt is sent again once with
`other_salt` and once with `salt` (cache reset before each) to probe tenant
isolation. OUT gets per-step token ids, num_cached_tokens and kv_transfer_params.
"""
import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.load(open(spec_path))
    kwargs = {}
    if spec["sekv"] is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "sekv", "kv_role": "kv_both", "kv_connector_extra_config": spec["sekv"],
        }
    llm = LLM(model=spec["model"], max_model_len=8192, enforce_eager=True,
              gpu_memory_utilization=0.5, seed=0, dtype=spec.get("dtype", "auto"), **kwargs)
    tok = llm.get_tokenizer()
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)

    def run(ids, salt):
        if spec.get("reset", True):
            llm.reset_prefix_cache()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids, cache_salt=salt)], params, use_tqdm=False)[0]
        return {
            "prompt_token_ids": list(out.prompt_token_ids),
            "output_token_ids": list(out.outputs[0].token_ids),
            "num_cached_tokens": out.num_cached_tokens,
            "kv_transfer_params": out.kv_transfer_params,
        }

    steps, ids = [], []
    for turn in spec["turns"]:
        ids = ids + tok.encode(turn, add_special_tokens=False)
        steps.append(run(ids, spec["salt"]))
        ids = ids + steps[-1]["output_token_ids"]
    probe = {"other_salt": run(steps[-1]["prompt_token_ids"], spec["other_salt"]),
             "same_salt": run(steps[-1]["prompt_token_ids"], spec["salt"])}
    json.dump({"steps": steps, "probe": probe}, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
