"""CPU benchmark of the remote tier: a follow-up step on server B after the
history was computed on server A, both sekv servers sharing one real Redis,
against plain vLLM prefilling the same prompt again; and the tier's read
throughput against a plain redis-py GET loop of the same bytes.

    python benchmarks/remote_restore.py [--histories 1024 7168] [--repeats 3]

Per history length H and repeat (a fresh tenant each, so that B holds nothing
of it): A serves H tokens of essay; once Redis holds every full block, B
serves the same text + ~64 new tokens, 1 output token; its time to first
token is vLLM's own (`vllm:time_to_first_token_seconds`), beside the plain
server's for the same prompt after its prefix cache was reset. SmolLM2-135M
(bf16), real `vllm serve` processes, one after the other on this machine.
Writes benchmarks/results/remote_restore/{summary.json,report.md}, the
Markdown headed by the machine, commit and command; `--report-only` writes it
again from summary.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # testbed
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import report_header as H  # noqa: E402
from redis_server import RedisServer  # noqa: E402
from testbed.serving import metrics  # noqa: E402

VLLM_ARGS = ["--max-model-len", "8192", "--enforce-eager", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.5"]
ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "SEKV_HASH_SECRET": "benchmark fleet secret"}
TTFT = "vllm:time_to_first_token_seconds"


def post(url: str, path: str, body: dict | None = None) -> dict | None:
    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1800) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


def step(url: str, model: str, prompt: str, tenant: str, max_tokens: int = 1) -> tuple[float, dict]:
    """(vLLM's time to first token, the response) of one completion."""
    post(url, "/reset_prefix_cache")
    before = metrics(url)
    out = post(url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                        "temperature": 0, "cache_salt": tenant})
    for _ in range(50):
        after = metrics(url)
        if after.get(TTFT + "_count", 0) > before.get(TTFT + "_count", 0):
            break
        time.sleep(0.1)
    return after[TTFT + "_sum"] - before.get(TTFT + "_sum", 0.0), out


def read_throughput(url: str, blocks: int = 64) -> dict:
    """GB/s of RemoteIO reads (into host slots, every record checked) and of a
    plain redis-py GET loop over the same keys, same bytes, same run."""
    import torch

    from vllm_sekv.store import HostPool
    from vllm_sekv.store.records import RecordLayout
    from vllm_sekv.store.remote import RedisStore, record_key
    from vllm_sekv.store.remote_io import RemoteIO

    pool = HostPool(2 * blocks, num_layers=30, block_tokens=32, kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16))
    layout = RecordLayout.of_pool(b"\x01" * 32, pool.data, 0)
    io = RemoteIO(RedisStore(url, timeout_s=5), pool.data, layout, "bench:", threads=2, batch_blocks=4)
    hashes = [i.to_bytes(16, "little") for i in range(blocks)]
    io.submit_writes([(i, h, 32 * i, b"\x02" * 16) for i, h in enumerate(hashes)])
    assert all(c.ok for c in io.drain(wait=True))
    import redis

    client = redis.Redis.from_url(url)
    keys = [record_key("bench:", h, 0) for h in hashes]
    total = sum(len(client.get(k)) for k in keys)
    out = {"blocks": blocks, "bytes": total}
    for name in ("sekv", "plain_get"):
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            if name == "sekv":
                io.submit_reads([(blocks + i, h, 32 * i, b"\x02" * 16) for i, h in enumerate(hashes)])
                assert all(c.ok for c in io.drain(wait=True))
            else:
                for k in keys:
                    client.get(k)
            times.append(time.perf_counter() - t0)
        out[f"{name}_gbps"] = round(total / statistics.median(times) / 1e9, 3)
    out["sekv_over_plain"] = round(out["sekv_gbps"] / out["plain_get_gbps"], 2)
    io.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--histories", type=int, nargs="+", default=[1024, 7168])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(H.results_dir("remote_restore")))
    p.add_argument("--report-only", action="store_true", help="only write report.md again from summary.json")
    args = p.parse_args(argv)
    out_dir = Path(args.out)
    if args.report_only:
        write_report(json.loads((out_dir / "summary.json").read_text()), out_dir)
        return 0
    from transformers import AutoTokenizer

    from vllm_sekv.calibration_corpus import essay_text
    from vllm_sekv.models import prepare_model
    from testbed.serving import LocalServer

    model = str(prepare_model(quiet=True))
    tok = AutoTokenizer.from_pretrained(model)
    corpus = tok.encode(essay_text(), add_special_tokens=False)
    work = Path(tempfile.mkdtemp(prefix="sekv-remote-bench-"))
    rows = []
    with RedisServer(work / "redis") as redis:
        throughput = read_throughput(redis.url)
        print("read throughput", throughput, flush=True)
        sekv = {"host_bytes": "2G", "remote_url": redis.url}
        servers = {name: LocalServer(model, sekv if name != "plain" else None, VLLM_ARGS, ENV,
                                     log_path=work / f"{name}.log").start() for name in ("a", "b", "plain")}
        try:
            for h in args.histories:
                for r in range(args.repeats):
                    offset = (h + 200) * (len(rows) + 1)
                    history = tok.decode(corpus[offset : offset + h])
                    follow_up = history + tok.decode(corpus[offset + h : offset + h + 64])
                    tenant = f"bench-{h}-{r}"
                    before = len(redis.client().keys("sekv:b:*"))
                    step(servers["a"].url, model, history, tenant)
                    deadline = time.monotonic() + 120  # until A's blocks are written behind
                    while len(redis.client().keys("sekv:b:*")) < before + h // 32 - 1 and time.monotonic() < deadline:
                        time.sleep(0.1)
                    ttft_b, out = step(servers["b"].url, model, follow_up, tenant)
                    ttft_plain, plain = step(servers["plain"].url, model, follow_up, tenant)
                    restored = (out.get("kv_transfer_params") or {}).get("sekv", {}).get("restored_tokens", {})
                    rows.append({"history_tokens": h, "repeat": r, "prompt_tokens": out["usage"]["prompt_tokens"],
                                 "remote_restored_tokens": restored.get("remote", 0),
                                 "ttft_remote_s": round(ttft_b, 4), "ttft_plain_s": round(ttft_plain, 4)})
                    print(rows[-1], flush=True)
        finally:
            for server in servers.values():
                server.stop()
    cells = []
    for h in args.histories:
        rs = [r for r in rows if r["history_tokens"] == h]
        remote = statistics.median(r["ttft_remote_s"] for r in rs)
        plain = statistics.median(r["ttft_plain_s"] for r in rs)
        cells.append({"history_tokens": h, "ttft_remote_s": round(remote, 4), "ttft_plain_s": round(plain, 4),
                      "speedup": round(plain / remote, 2),
                      "remote_restored_tokens": statistics.median(r["remote_restored_tokens"] for r in rs)})
    command = H.command(__file__, argv)
    meta = H.meta(command)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"machine": meta["machine"], "commit": meta["commit"], "command": command, "meta": meta,
               "repeats": args.repeats, "rows": cells, "read_throughput": throughput, "trials": rows}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    write_report(summary, out_dir)
    return 0


def write_report(summary: dict, out_dir: Path) -> None:
    cells, throughput = summary["rows"], summary["read_throughput"]
    lines = [*H.header_from(summary["meta"], "Remote tier: a follow-up on another server, restored from Redis"),
             f"SmolLM2-135M bf16, real `vllm serve`, one real Redis server; medians of {summary['repeats']}.", "",
             "| history tokens | restored from Redis | TTFT from Redis | plain re-prefill TTFT | ratio |",
             "|---|---|---|---|---|"]
    lines += [f"| {c['history_tokens']} | {c['remote_restored_tokens']:.0f} | {c['ttft_remote_s']:.3f} s | "
              f"{c['ttft_plain_s']:.3f} s | {c['speedup']:.1f}x |" for c in cells]
    lines += ["", f"Remote reads ({throughput['blocks']} SmolLM2 blocks, {throughput['bytes'] / 2**20:.0f} MiB, "
              f"every record's identity and checksum verified, into host slots): "
              f"{throughput['sekv_gbps']} GB/s against {throughput['plain_get_gbps']} GB/s for a plain "
              f"redis-py GET loop of the same keys ({throughput['sekv_over_plain']}x), same run."]
    H.write_report(out_dir / "report.md", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
