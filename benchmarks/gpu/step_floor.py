"""The floor under any restore's time to first token inside vLLM.

    python benchmarks/gpu/step_floor.py --lengths 65536 130048 [--out benchmarks/results/gpu_step_floor/report]

A follow-up step after vLLM's GPU prefix cache was reset cannot show its first
token before two things that happen one after the other:

1. vLLM creates the request: the engine core hashes every full block of the
   prompt for its prefix cache (`Request` with the engine core's block hasher,
   vLLM's default hash and 16-token blocks). No connector hook runs before
   this, and a restore that is to be found by later steps needs these hashes.
2. The history's KV crosses PCIe: its bytes (Llama-3.1-8B geometry, bf16) at
   the pinned host->device bandwidth measured here.

The floor is their sum; the rest of vLLM's step (scheduling, the forward pass,
sampling) comes on top, partly hidden under the transfer. Measured with the
real vLLM `Request` and hasher and a real pinned copy; nothing is estimated.
Writes OUT.json and OUT.md (default benchmarks/results/gpu_step_floor/report),
the Markdown headed by the machine, commit and command; `--report-only`
writes the Markdown again from OUT.json.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import report_header as H  # noqa: E402
from restore_e2e import LLAMA31_8B, h2d_bandwidth  # noqa: E402

HASH_BLOCK_TOKENS = 16
# The targets for the follow-up step's time to first token (at 127K: 30x faster than re-prefill).
TARGETS_S = {65536: 0.19, 130048: 10.4 / 30}


def bytes_per_token(geometry: dict) -> int:
    return 2 * geometry["num_hidden_layers"] * geometry["num_key_value_heads"] * geometry["head_dim"] * 2


def request_creation_s(num_tokens: int, repeats: int = 5) -> float:
    """Median seconds for vLLM to create a request of `num_tokens` prompt
    tokens with the engine core's block hasher (default hash algorithm)."""
    from vllm.config import CacheConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name(CacheConfig().prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(HASH_BLOCK_TOKENS, hash_fn)
    rng = random.Random(num_tokens)
    times = []
    for i in range(repeats):
        tokens = [rng.randrange(1000, LLAMA31_8B["vocab_size"]) for _ in range(num_tokens)]
        t0 = time.perf_counter()
        Request(f"r{i}", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def report(data: dict, out: Path) -> None:
    """OUT.md from the run's JSON (`data`)."""
    bandwidth = data["bandwidth_bytes_per_s"]
    lines = [
        *H.header_from(data["meta"], "The floor under a restore's time to first token inside vLLM"),
        f"vLLM {data['vllm']}, torch {data.get('torch', '?')}, {data.get('gpu', '?')}; pinned host->device "
        f"{bandwidth / 1e9:.1f} GB/s measured here; Llama-3.1-8B KV ({bytes_per_token(LLAMA31_8B) // 1024} KiB "
        f"per token); vLLM's default prefix-cache hash, {HASH_BLOCK_TOKENS}-token blocks. Request creation: "
        "median of 5.",
        "",
        "| history | vLLM creates the request (hashing) | KV transfer bound | floor (sum) | target |",
        "|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        target = f"{r['target_s']:.3f} s" if r["target_s"] else "—"
        lines.append(f"| {r['history_tokens'] // 1024}K | {r['request_creation_s'] * 1e3:.1f} ms | "
                     f"{r['transfer_bound_s'] * 1e3:.1f} ms | {r['floor_s'] * 1e3:.1f} ms | {target} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    H.write_report(out.with_suffix(".md"), lines)
    print("\n".join(lines), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[65536, 130048])
    ap.add_argument("--out", default=str(H.results_dir("gpu_step_floor") / "report"), help="writes OUT.json and OUT.md")
    ap.add_argument("--report-only", action="store_true", help="only write OUT.md again from OUT.json")
    args = ap.parse_args()
    out = Path(args.out)
    if args.report_only:
        report(json.loads(out.with_suffix(".json").read_text()), out)
        return
    import torch
    import vllm

    bandwidth = h2d_bandwidth(1)
    rows = []
    for length in args.lengths:
        hashing = request_creation_s(length)
        transfer = length * bytes_per_token(LLAMA31_8B) / bandwidth
        rows.append({"history_tokens": length, "request_creation_s": hashing, "transfer_bound_s": transfer,
                     "floor_s": hashing + transfer, "target_s": TARGETS_S.get(length)})
        print(rows[-1], flush=True)
    data = {"meta": H.meta(H.command(__file__)), "rows": rows, "bandwidth_bytes_per_s": bandwidth,
            "vllm": vllm.__version__, "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    report(data, out)


if __name__ == "__main__":
    main()
