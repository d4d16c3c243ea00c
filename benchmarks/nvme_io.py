"""NVMe tier I/O path alone: record reads through `RecordIO` (checked, threaded,
O_DIRECT where allowed) vs the disk's plain sequential O_DIRECT read, measured
in the same run on the same folder. No vLLM needed (runs on the GPU machine too).

    python benchmarks/nvme_io.py --dir /path/on/the/disk [--records 512] [--threads 8]

Records have the size of a SmolLM2-135M block (32 tokens, bf16: 720 KiB payload)
unless --block-kib says otherwise. Writes benchmarks/results/nvme_io/<tag>.{json,md}
(`SEKV_BENCH_TAG`, default `cpu`: the machine it ran on), the Markdown headed by
the machine, commit and command; `--report-only` writes it again from the JSON.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import socket
import time
from pathlib import Path

import torch

import report_header as H
from vllm_sekv.store.nvme import NvmeLayout, RecordIO

RESULTS = H.results_dir("nvme_io")


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def sequential_direct_read_gbps(path: Path, total_bytes: int, chunk_bytes: int = 8 << 20) -> float:
    """Plain sequential O_DIRECT read of one file: the disk's own figure."""
    with open(path, "wb") as f:
        block = os.urandom(1 << 20)
        for _ in range(total_bytes >> 20):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    drop_caches()
    buf = mmap.mmap(-1, chunk_bytes)
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    t0 = time.perf_counter()
    got = 0
    while True:
        n = os.readv(fd, [buf])
        if n <= 0:
            break
        got += n
    seconds = time.perf_counter() - t0
    os.close(fd)
    path.unlink()
    return got / seconds / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="a folder on the disk to measure (a subfolder is made)")
    ap.add_argument("--records", type=int, default=512)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--block-kib", type=int, default=720)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--report-only", action="store_true", help="only write <tag>.md again from <tag>.json")
    args = ap.parse_args()
    tag = os.environ.get("SEKV_BENCH_TAG", "cpu")
    if args.report_only:
        write_report(json.loads((RESULTS / f"{tag}.json").read_text()), tag)
        return
    if not args.dir:
        ap.error("--dir is required")
    work = Path(args.dir) / f"sekv-nvme-bench-{os.getpid()}"
    work.mkdir(parents=True)
    try:
        numel = args.block_kib * 1024 // 2
        pool = torch.randint(-30000, 30000, (args.records, numel), dtype=torch.int16).view(torch.bfloat16)
        layout = NvmeLayout(work, "fp-bench")
        io = RecordIO(layout, pool, rank=0, threads=8)
        hashes = [i.to_bytes(16, "little") for i in range(args.records)]
        t0 = time.perf_counter()
        for i, h in enumerate(hashes):
            io.submit_write(i, h, 32 * i)
        assert all(c.ok for c in io.drain(wait=True))
        write_s = time.perf_counter() - t0
        total = args.records * io.record_bytes
        rows = []
        for threads in args.threads:
            for r in range(args.repeats):
                base = sequential_direct_read_gbps(work / "seq.bin", total)
                reader = RecordIO(layout, pool, rank=0, threads=threads)
                cached = not drop_caches()
                t0 = time.perf_counter()
                for i, h in enumerate(hashes):
                    reader.submit_read(h, i, 32 * i)
                done = reader.drain(wait=True)
                seconds = time.perf_counter() - t0
                reader.close()
                assert all(c.ok for c in done), [c.reason for c in done if not c.ok][:3]
                gbps = total / seconds / 1e9
                rows.append({"threads": threads, "repeat": r, "records_gbps": round(gbps, 3),
                             "sequential_direct_gbps": round(base, 3), "ratio": round(gbps / base, 3),
                             "page_cache_dropped": not cached})
                print(f"threads={threads} records {gbps:.2f} GB/s vs sequential O_DIRECT {base:.2f} GB/s "
                      f"-> {gbps / base:.2f}", flush=True)
        command = H.command(__file__)
        meta = {**H.meta(command), "command": command, "host": socket.gethostname(),
                "dir": str(args.dir), "o_direct": io.o_direct, "records": args.records,
                "record_bytes": io.record_bytes, "write_gbps": round(total / write_s / 1e9, 3)}
        if tag != "cpu":
            command = f"SEKV_BENCH_TAG={tag} {command}"
            meta.update(command=command, commands=[command])
        RESULTS.mkdir(parents=True, exist_ok=True)
        data = {"meta": meta, "rows": rows}
        (RESULTS / f"{tag}.json").write_text(json.dumps(data, indent=1))
        write_report(data, tag)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write_report(data: dict, tag: str) -> None:
    meta, rows = data["meta"], data["rows"]
    best = max(rows, key=lambda r: r["ratio"])
    lines = [*H.header_from(meta, f"NVMe record reads vs sequential O_DIRECT read ({tag})"),
             f"Folder `{meta['dir']}`; {meta['records']} records of {meta['record_bytes']} bytes, "
             f"O_DIRECT={meta['o_direct']}, write-behind {meta['write_gbps']} GB/s.", "",
             "| threads | repeat | records GB/s | sequential O_DIRECT GB/s | ratio |", "|---|---|---|---|---|"]
    lines += [f"| {r['threads']} | {r['repeat']} | {r['records_gbps']} | {r['sequential_direct_gbps']} | "
              f"{r['ratio']} |" for r in rows]
    lines += ["", f"Best: {best['ratio']:.2f} of the disk's sequential O_DIRECT read "
                  f"({best['threads']} threads)."]
    H.write_report(RESULTS / f"{tag}.md", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
