"""One offline vLLM engine, in its own process, for tests/engine/test_surprisal.py.

    python surprisal_runner.py SPEC.json OUT.json

SPEC: {"model": dir, "mode": "sekv" | "restore" | "plain", "prompt_token_ids": [...],
       "max_tokens": n, "max_num_batched_tokens": n, "nvme_dir": dir (optional)}
* sekv: sekv with `surprisal` on serves the prompt (chunked prefill, then
  greedy decode); OUT gets the output token ids and, for every token of the
  workspace's committed blocks of prompt + output, the surprisal sekv recorded
  (read from the engine core's connector: in-process engine). With an
  `nvme_dir`, it waits until every committed block has its record there.
* restore: a fresh sekv engine on that `nvme_dir` serves the prompt again: its
  blocks come back from disk; OUT gets the surprisal their records carried.
* plain: plain vLLM computes the prompt's logprobs (`prompt_logprobs=0`); OUT
  gets -logprob of each prompt token (token 0: NaN).
"""
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.load(open(spec_path))
    ids = spec["prompt_token_ids"]
    kwargs = {}
    if spec["mode"] in ("sekv", "restore"):
        extra = {"host_bytes": "256M", "surprisal": "on", "index_summary": "anchor_pre"}
        if spec.get("nvme_dir"):
            extra["nvme_dir"] = spec["nvme_dir"]
        kwargs["kv_transfer_config"] = {"kv_connector": "sekv", "kv_role": "kv_both",
                                        "kv_connector_extra_config": extra}
    llm = LLM(model=spec["model"], max_model_len=4096, enforce_eager=True, seed=0, dtype=spec.get("dtype", "bfloat16"),
              max_num_batched_tokens=spec["max_num_batched_tokens"], enable_chunked_prefill=True, **kwargs)
    if spec["mode"] == "plain":
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        values = [math.nan] + [-out.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0]
        json.dump({"surprisal": values}, open(out_path, "w"))
        return
    from vllm_sekv.workspace.hashing import extend_block_hashes

    max_tokens = spec["max_tokens"] if spec["mode"] == "sekv" else 1
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
    output = list(out.outputs[0].token_ids) if spec["mode"] == "sekv" else []
    side = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
    hashes: list = []
    extend_block_hashes(hashes, ids + output, side.planner.block_tokens, side.tenants.of(""))
    for _ in range(40):  # small steps carry commits, write-behind and completions
        llm.generate([TokensPrompt(prompt_token_ids=[7] * 40)], SamplingParams(max_tokens=1), use_tqdm=False)
        if spec["mode"] != "sekv" or not spec.get("nvme_dir"):
            break
        if len(list(Path(spec["nvme_dir"]).glob("*/blocks/*/*.blk"))) >= len(hashes):
            break
        time.sleep(0.25)
    blocks = side.catalog.match_prefix(hashes)
    values = [float(v) for rec in blocks for v in side.planner.surprisal[rec.host_slot]]
    json.dump({"output_token_ids": output, "surprisal": values,
               "kv_transfer_params": out.kv_transfer_params}, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
