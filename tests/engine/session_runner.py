"""Runs a multi-step agent session on a real offline vLLM engine, in its own process.

    python session_runner.py SPEC.json OUT.json

SPEC: {"model": dir, "sekv": extra_config or null, "turns": [text, ...] or "prompt_ids": [id, ...],
       "max_tokens": n, "salt": str, "other_salt": str, "dtype": str,
       "reset": bool (default true), "async_scheduling": bool (default false),
       "hook_never_fires": bool (default false), "cudagraph_mode": str (default: eager)}
Each step's prompt is the previous prompt + the previous output + the next turn,
as token ids (no re-tokenization at the seams); with "feed_outputs" false, the
previous prompt + the next turn (two runs whose outputs differ then still
send the same prompts). vLLM's prefix cache is reset
before every step unless "reset" is false (then vLLM's own cache serves the
history: the case sekv replaces). "prompt_ids" instead of "turns": one step
on exactly these token ids. "extra_args": every request's
`SamplingParams.extra_args` (a client's `vllm_xargs`). "kv_cache_dtype": vLLM's
`--kv-cache-dtype` (e.g. "fp8"). "metrics": true keeps vLLM's stats on and
adds the engine's `vllm:sekv_*` counters to OUT ("metrics": name -> value).
After the session, the last prompt is sent again once with
`other_salt` and once with `salt` (cache reset before each) to probe tenant
isolation. OUT gets per-step token ids, num_cached_tokens and kv_transfer_params,
and the scheduler the engine ran ("scheduler": class path, "async_scheduling").

"async_scheduling": vLLM's asynchronous scheduler (a step is scheduled while
the last one runs, as vLLM does by default on GPUs). vLLM's CPU build turns it
off in its platform hook although its engine and model runner support it;
here that one override is lifted (`lift_cpu_async_override`), in this process
(the engine core runs in-process), so CI exercises the scheduling mode the
GPU machine uses.

"cudagraph_mode": run with vLLM's CUDA graphs in this mode (e.g.
"FULL_AND_PIECEWISE", vLLM's GPU default) instead of eager mode; the mode vLLM
resolved it to (a connector may ask for less) is in the output.

"full_graph_decode": steps of one token per request run as vLLM runs them
under full CUDA graphs on GPUs: the attention hook never fires and the loads
start without attention metadata (vLLM 0.26's runner). A fake, in this
process: CPUs capture no graphs.

"hook_never_fires": sekv's worker is never handed the layers' K/V, what a
CUDA graph replaying vLLM's KV-cache update would do (a fake, in this
process, to reach that failure path on a CPU).
"""
import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def lift_cpu_async_override() -> None:
    """Keep the scheduling mode asked for through vLLM's CPU platform hook,
    which otherwise sets `async_scheduling = False`."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        asked = vllm_config.scheduler_config.async_scheduling
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = asked

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def fake_full_graph_decode() -> None:
    """Decode batches as full-CUDA-graph replays reach sekv's worker (see
    "full_graph_decode" above)."""
    from types import SimpleNamespace

    from vllm_sekv.worker_side.worker_connector import SekvWorkerSide

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    start_load_kv, capture_kv = SekvWorkerSide.start_load_kv, SekvWorkerSide.capture_kv

    def decode_batch(worker) -> bool:  # these sessions run one request at a time
        return worker._plan is not None and worker._plan.batch_tokens == 1

    def start_without_metadata(self, forward_context):
        if decode_batch(self):
            forward_context = SimpleNamespace(attn_metadata=None, no_compile_layers=forward_context.no_compile_layers)
        start_load_kv(self, forward_context)

    def capture_unless_decode(self, layer, key, value, slot_mapping):
        if not decode_batch(self):
            capture_kv(self, layer, key, value, slot_mapping)

    SekvWorkerSide.start_load_kv = start_without_metadata
    SekvWorkerSide.capture_kv = capture_unless_decode


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.load(open(spec_path))
    kwargs = {}
    if spec.get("hook_never_fires"):
        from vllm_sekv.worker_side.worker_connector import SekvWorkerSide

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        SekvWorkerSide.capture_kv = lambda self, layer, key, value, slot_mapping: None
    if spec.get("full_graph_decode"):
        fake_full_graph_decode()
    if spec.get("async_scheduling"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        lift_cpu_async_override()
        kwargs["async_scheduling"] = True
    if spec["sekv"] is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "sekv", "kv_role": "kv_both", "kv_connector_extra_config": spec["sekv"],
        }
    if spec.get("cudagraph_mode"):
        kwargs["compilation_config"] = {"cudagraph_mode": spec["cudagraph_mode"]}
    if spec.get("kv_cache_dtype"):
        kwargs["kv_cache_dtype"] = spec["kv_cache_dtype"]
    if spec.get("metrics"):
        kwargs["disable_log_stats"] = False
    llm = LLM(model=spec["model"], max_model_len=8192, enforce_eager=not spec.get("cudagraph_mode"),
              gpu_memory_utilization=0.5, seed=0, dtype=spec.get("dtype", "auto"), **kwargs)
    tok = llm.get_tokenizer()
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True,
                            extra_args=spec.get("extra_args"))

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
    if "prompt_ids" in spec:
        steps.append(run(spec["prompt_ids"], spec["salt"]))
    for turn in spec.get("turns", ()):
        ids = ids + tok.encode(turn, add_special_tokens=False)
        steps.append(run(ids, spec["salt"]))
        if spec.get("feed_outputs", True):
            ids = ids + steps[-1]["output_token_ids"]
    probe = {"other_salt": run(steps[-1]["prompt_token_ids"], spec["other_salt"]),
             "same_salt": run(steps[-1]["prompt_token_ids"], spec["salt"])}
    sc = llm.llm_engine.vllm_config.scheduler_config
    scheduler = {"class": str(sc.scheduler_cls), "async_scheduling": bool(sc.async_scheduling)}
    graphs = llm.llm_engine.vllm_config.compilation_config.cudagraph_mode
    metrics = {}
    if spec.get("metrics"):
        metrics = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:sekv_")
                   and hasattr(m, "value")}
    json.dump({"steps": steps, "probe": probe, "scheduler": scheduler, "cudagraph_mode": getattr(graphs, "name", None),
               "metrics": metrics}, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
