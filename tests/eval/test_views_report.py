"""The views benchmark's report (benchmarks/gpu/views_e2e.py): runs made on
different machines and merged into one report each compare against their
own run's plain vLLM, never another machine's."""
from __future__ import annotations

import argparse
import json

import pytest


@pytest.fixture(scope="module")
def views(gpu_benchmark):
    return gpu_benchmark("views_e2e")


def _sekv(commit: str, machine: str, tokens: int, ttft: float, decode: float, codec: str) -> dict:
    step = {"ttft_s": ttft, "kv_transfer_params": {"sekv": {"restored_tokens": {"host": 2046 * 32}}}}
    return {"engine": "sekv", "commit": commit, "machine": machine, "codec": codec, "session_tokens": tokens,
            "grow_s": 1.0, "ttft_s": ttft, "steps": [step], "memory": {"allocated_gib": 60.0},
            "decode": {"decode_s_per_token": decode}}


def _plain(commit: str, machine: str, warm: float, decode: float) -> dict:
    return {"engine": "plain", "commit": commit, "machine": machine, "context_tokens": 65536, "cold_ttft_s": 3.0,
            "warm_ttft_s": warm, "memory": {"allocated_gib": 50.0}, "decode": {"decode_s_per_token": decode}}


def test_merged_runs_compare_each_row_with_its_own_runs_plain_vllm(views, tmp_path):
    rows = [_sekv("aaa", "H200", 524288, 0.3, 0.0071, "exact"), _plain("aaa", "H200", 0.04, 0.0069),
            _sekv("bbb", "H100", 1048576, 0.45, 0.0095, "fp8"), _plain("bbb", "H100", 0.03, 0.0091)]
    assert views.plain_of(rows, rows[2]) is rows[3]
    # a run without one: the first run's on the same GPU (versions aside), none on another
    assert views.plain_of(rows, {"engine": "sekv", "commit": "ccc", "machine": "H100 (vLLM 0.26); host"}) is rows[3]
    assert views.plain_of(rows, {"engine": "sekv", "commit": "ccc", "machine": "B200; host"}) is None
    args = argparse.Namespace(model_dir=None, cuda_graphs=True, view_tokens=65536, host_bytes="66G",
                              decode_tokens=128)
    meta = {"machine": "H200; H100", "commit": "aaa; bbb", "date": "today", "commands": ["merge"]}
    views.report(rows, args, tmp_path / "report", meta)
    summary = json.loads((tmp_path / "summary.json").read_text())["rows"]
    assert [(r["codec"], r["machine"], r["plain_decode_ms_per_token"]) for r in summary] == [
        ("exact", "H200", 6.9), ("fp8", "H100", 9.1)]
    text = (tmp_path / "report.md").read_text()
    assert "| 0.450 s | 0.450 (0/2046) | 2046 | 0 | 60.00 GiB | 15.0x | fp8 | bbb |" in text  # 0.45 / 0.03
    assert "Decode (128 tokens, run bbb): sekv at 1024K session 9.50 ms/token vs plain 64K 9.10 ms/token" in text
