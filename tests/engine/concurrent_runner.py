"""Serves several agent sessions from execution views on one real offline vLLM
engine, in its own process: first one request at a time, then all sessions'
requests at once, under another cache salt (another tenant: nothing of the
first pass is reused).

    python concurrent_runner.py SPEC.json OUT.json

SPEC: {"model": dir, "sekv": extra_config, "sessions": [[turn, ...], ...],
       "max_tokens": n, "dtype": str}
Every session has the same number of turns; step k of a session sends its
turns 0..k as token ids, the outputs of its earlier steps between them.
OUT: {"serial": RUN, "together": RUN}, RUN = per step, per session
{"output_token_ids", "view"} (the response's `kv_transfer_params["sekv"]["view"]`).
"""
import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# The engine core in this process: `generate` adds every request before the
# first engine step, so the batches are the same in every run. In its own
# process the core would start on the first request while the others are
# still on their way, and the batches would depend on the machine's load.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.load(open(spec_path))
    llm = LLM(model=spec["model"], max_model_len=8192, enforce_eager=True, gpu_memory_utilization=0.5, seed=0,
              dtype=spec.get("dtype", "auto"), kv_transfer_config={
                  "kv_connector": "sekv", "kv_role": "kv_both", "kv_connector_extra_config": spec["sekv"]})
    tok = llm.get_tokenizer()
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    turns = [[tok.encode(t, add_special_tokens=False) for t in session] for session in spec["sessions"]]

    def generate(prompts: list[list[int]], salt: str) -> list[dict]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p, cache_salt=salt) for p in prompts], params,
                            use_tqdm=False)
        return [{"output_token_ids": list(o.outputs[0].token_ids),
                 "view": ((o.kv_transfer_params or {}).get("sekv") or {}).get("view")} for o in outs]

    def run(salt: str, together: bool) -> list[list[dict]]:
        ids = [[] for _ in turns]
        steps = []
        for k in range(len(turns[0])):
            prompts = [ids[i] + turns[i][k] for i in range(len(turns))]
            outs = generate(prompts, salt) if together else [generate([p], salt)[0] for p in prompts]
            ids = [p + o["output_token_ids"] for p, o in zip(prompts, outs)]
            steps.append(outs)
        return steps

    json.dump({"serial": run("one-at-a-time", together=False), "together": run("all-at-once", together=True)},
              open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
