"""Runs the tensor-parallel checks on a real offline vLLM engine (CPU backend),
in its own process.

    python tp_runner.py SPEC.json OUT.json

SPEC: {"model": dir, "tp": n, "sekv": extra_config or null, "phases": [...]}
Phases, in order:
  "session":  three agent steps (each prompt = the last + its output + new
              tokens), vLLM's prefix cache reset before each; outputs, cached
              tokens and kv_transfer_params per step.
  "lost_rank": other requests push the history out of the host tier and
              the last session prompt is sent again (it comes back from the
              NVMe tier); then every record of rank 1 is deleted, the history
              pushed out again and the prompt sent once more: each block is
              then missing on one rank only.
  "view":     a 1760-token prompt with its own view budget of 512 tokens
              (served as probe + view); the view's selected blocks and output.
Token ids only; float32; greedy.
"""
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")


def prompts() -> dict:
    return {"turns": [list(range(100, 700)), list(range(900, 1000)), list(range(1200, 1280))],
            "filler": [list(range(5000 + 500 * i, 5500 + 500 * i)) for i in range(6)],
            "view": list(range(2000, 3760))}


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.load(open(spec_path))
    kwargs = {}
    if spec["sekv"] is not None:
        kwargs["kv_transfer_config"] = {"kv_connector": "sekv", "kv_role": "kv_both",
                                        "kv_connector_extra_config": spec["sekv"]}
    llm = LLM(model=spec["model"], tensor_parallel_size=spec["tp"], max_model_len=2048, enforce_eager=True,
              dtype="float32", gpu_memory_utilization=0.5, seed=0, **kwargs)
    data = prompts()

    def run(ids, salt="tenant", extra=None):
        llm.reset_prefix_cache()
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, extra_args=extra)
        out = llm.generate([TokensPrompt(prompt_token_ids=ids, cache_salt=salt)], params, use_tqdm=False)[0]
        return {"prompt_token_ids": list(out.prompt_token_ids), "output_token_ids": list(out.outputs[0].token_ids),
                "num_cached_tokens": out.num_cached_tokens, "kv_transfer_params": out.kv_transfer_params}

    result: dict = {}
    ids: list[int] = []
    for phase in spec["phases"]:
        if phase == "session":
            steps = []
            for turn in data["turns"]:
                ids = ids + turn
                steps.append(run(ids))
                ids = ids + steps[-1]["output_token_ids"]
            result["session"] = steps
        elif phase == "lost_rank":
            last = result["session"][-1]["prompt_token_ids"]
            for i, filler in enumerate(data["filler"]):  # the history leaves the host tier
                run(filler, salt=f"filler-{i}")
            control = run(last)  # read back from the NVMe tier, every rank's records intact
            gone = [p for p in Path(spec["sekv"]["nvme_dir"]).rglob("*.r1.blk")] if spec["sekv"] else []
            for p in gone:
                p.unlink()
            for i, filler in enumerate(data["filler"]):
                run(filler, salt=f"filler-{i}")
            result["lost_rank"] = {"deleted": len(gone), "control": control, "step": run(last)}
        elif phase == "view":
            result["view"] = run(data["view"], extra={"kv_transfer_params": {"view_tokens": 512}})
    json.dump(result, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
