"""Host time of capturing one decode step's K/V (the per-layer work the
attention hook adds to every decode step), on the GPU machine.

    python benchmarks/gpu/bench_capture.py [--paged] [--out benchmarks/results/gpu_capture/report]

Llama-3.1-8B geometry (32 layers, 8 KV heads, head_dim 128, bf16). K/V of each
layer are strided views into a fused qkv buffer, as vLLM hands them over. Each
simulated step first queues a 4096x4096 matmul (the forward's earlier work),
then times, on the host (median of `--steps`):

* `sync`: reading the step's slot mapping on the host (`slot_mapping.cpu()`,
  what `_begin_forward` does once per step). It waits for the queued matmul:
  this is the read's cost when the GPU is behind, not its cost in a decode
  step, where the GPU is idle at that point;
* `rows`: the capture's row tensors moved to the device (`to_device`, twice);
* `take`: `StepCapture.take` for every layer (two `index_select`s each);
  with `--paged`, nothing (the path CUDA workers take where the paged cache
  has vLLM 0.26 FlashAttention's packed layout);
* `write`: `CaptureWriter.write` (rotation by the view's delta, pitched
  device->host copies into the pinned pool, asynchronous); with `--paged`
  preceded by `StepCapture.gather` (one launch reading every layer's rows
  from the paged caches, rotation fused);
* `settle`: the next step's wait for those copies.

Writes OUT.json and OUT.md (default benchmarks/results/gpu_capture/report),
the Markdown headed by the machine, commit and command; `--report-only`
writes the Markdown again from OUT.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from vllm_sekv import compat
from vllm_sekv.ops import RopeSpec
from vllm_sekv.store import HostPool
from vllm_sekv.store.capture import CaptureWriter, StepCapture
from vllm_sekv.store.host_pool import to_device

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import report_header as RH  # noqa: E402

LAYERS, HQ, H, D = 32, 32, 8, 128


def report(data: dict, out: Path) -> None:
    """OUT.md from the run's JSON (`data`)."""
    a = data["args"]
    mode = "paged (gathered after the forward)" if a["paged"] else "layer by layer"
    lines = [*RH.header_from(data["meta"], f"Capture host time per step ({a['tokens']} tokens, {LAYERS} layers, "
                                           f"{mode}; median of {a['steps']})"),
             "| part | us |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in data["us"].items()]
    RH.write_report(out.with_suffix(".md"), lines)
    print("\n".join(lines), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=1, help="batch rows per step (decode: 1)")
    ap.add_argument("--paged", action="store_true", help="gather from paged caches after the forward")
    ap.add_argument("--out", default=str(RH.results_dir("gpu_capture") / "report"), help="writes OUT.json and OUT.md")
    ap.add_argument("--report-only", action="store_true", help="only write OUT.md again from OUT.json")
    args = ap.parse_args()
    if args.report_only:
        report(json.loads(Path(args.out).with_suffix(".json").read_text()), Path(args.out))
        return
    dev = torch.device("cuda")
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    rope = RopeSpec(inv, D, True)
    pool = HostPool(64, LAYERS, 32, H, D, torch.bfloat16, pin_memory=True)
    writer = CaptureWriter(pool, dev)
    qkv = [torch.randn(args.tokens, (HQ + 2 * H) * D, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    keys = [t[:, HQ * D:(HQ + H) * D].view(-1, H, D) for t in qkv]
    values = [t[:, (HQ + H) * D:].view(-1, H, D) for t in qkv]
    slot_mapping = torch.arange(args.tokens, device=dev) + 1000
    pages = 1000 // 16 + args.tokens // 16 + 2
    caches = [torch.randn(pages, H, 16, 2 * D, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    views = [compat.paged_kv_views(c, H, D) for c in caches]  # vLLM 0.26 FlashAttention's packed layout
    cache_views = ([k for k, _ in views], [v for _, v in views])
    busy = torch.randn(4096, 4096, device=dev)
    parts: dict[str, list[float]] = {k: [] for k in ("sync", "rows", "take", "write", "settle", "total")}
    for step in range(args.steps + 10):
        busy @ busy  # the GPU is busy with the forward's earlier work
        t0 = time.perf_counter()
        writer.settle()
        t1 = time.perf_counter()
        mapping = slot_mapping.cpu().numpy()
        t2 = time.perf_counter()
        rows = to_device(mapping if args.paged else np.argsort(mapping), dev)
        deltas = to_device(np.full(args.tokens, 12345, dtype=np.int64), dev)
        host_rows = (np.arange(args.tokens) + step * args.tokens) % (64 * 32)
        cap = StepCapture(rows, host_rows, deltas, LAYERS, H, D, torch.bfloat16, paged=args.paged)
        t3 = time.perf_counter()
        if not args.paged:
            for layer in range(LAYERS):
                cap.take(layer, keys[layer], values[layer])
        t4 = time.perf_counter()
        if args.paged:
            assert cap.gather(*cache_views, rope)
        assert writer.write(cap, rope)
        t5 = time.perf_counter()
        if step >= 10:
            for k, v in (("settle", t1 - t0), ("sync", t2 - t1), ("rows", t3 - t2), ("take", t4 - t3),
                         ("write", t5 - t4), ("total", t5 - t0)):
                parts[k].append(v * 1e6)
        torch.cuda.synchronize()
    writer.settle()
    result = {k: statistics.median(v) for k, v in parts.items()}
    result["take_per_layer_us"] = result["take"] / LAYERS
    data = {"meta": RH.meta(RH.command(__file__)), "args": {"steps": args.steps, "tokens": args.tokens,
                                                               "paged": args.paged},
            "us": result, "runs_us": parts}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    report(data, out)


if __name__ == "__main__":
    main()
