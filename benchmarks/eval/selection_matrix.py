"""Which index settings let a view find a distant fact: served end to end.

    python benchmarks/eval/selection_matrix.py 16384 2048 0,1,2,3,4,5,6,7 \
        '[{}, {"index_combine":"top8"}, {"index_summary":"mean_pre"}, {"probe_query_tokens":0},
          {"index_summary":"sub8_pre"}, {"index_summary":"minmax_post","index_combine":"mean"}]'

For each config (sekv `kv_connector_extra_config` overrides), one sekv server
(SmolLM2, bf16, `--max-model-len 131072`, `view_tokens` = the budget) answers
the `passkey` task (benchmarks/eval/tasks.py) at the given length for each
seed, twice: the first request ingests the history, the second is served
from a view of the stored history (probe + restore). For the second it
prints whether the view selected the block holding the pass key's digits and
whether the answer was right. The workspace persists in an NVMe folder
(`/tmp/sekv_selection_nvme`), so configs after the first read the history back
instead of ingesting it again (blocks are content-addressed; the index is
rebuilt from them with each config's summary).
"""
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "tests" / "engine"))
sys.path.insert(0, str(HERE.parents[1]))  # testbed

import tasks as T  # noqa: E402
from test_http_serve import post  # noqa: E402
from vllm_sekv import models  # noqa: E402
from testbed.serving import LocalServer  # noqa: E402

ARGS = ["--max-model-len", "131072", "--enforce-eager", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.5"]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "SEKV_HOST_BYTES": "3G", "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}


def main() -> None:
    from transformers import AutoTokenizer

    length, budget = int(sys.argv[1]), int(sys.argv[2])
    seeds = [int(x) for x in sys.argv[3].split(",")]
    configs = json.loads(sys.argv[4])
    model_dir = str(models.prepare_model(quiet=True))
    tok = AutoTokenizer.from_pretrained(model_dir)

    def needle_block(task):
        ids = T.render_ids(tok, task.messages)
        digits = tok.encode(task.answer, add_special_tokens=False)
        return next(i for i in range(len(ids)) if ids[i:i + len(digits)] == digits) // 32

    tasks = [T.generate("passkey", length, seed, tok) for seed in seeds]
    for cfg in configs:
        res = []
        sekv = {"view_tokens": budget, "nvme_dir": "/tmp/sekv_selection_nvme", **cfg}
        with LocalServer(model_dir, sekv=sekv, vllm_args=ARGS, env=ENV) as server:
            for task in tasks:
                body = {"model": model_dir, "messages": task.messages, "max_tokens": 12, "temperature": 0,
                        "session_id": f"t{task.seed}", "continue_final_message": True,
                        "add_generation_prompt": False}
                post(server.url, "/v1/chat/completions", body)
                r = post(server.url, "/v1/chat/completions", body)
                view = r["kv_transfer_params"]["sekv"]["view"]
                res.append((needle_block(task) in view.get("selected_blocks", []),
                            T.is_correct(task.answer, r["choices"][0]["message"]["content"])))
        print(json.dumps(cfg), "selected", sum(a for a, _ in res), "correct", sum(b for _, b in res),
              "of", len(res), res, flush=True)


if __name__ == "__main__":
    main()
