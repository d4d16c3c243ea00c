"""The fidelity report's cells (benchmarks/fidelity/report.py): what each
row counts, from trial lines written the way run.py writes them."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPORT = Path(__file__).resolve().parents[2] / "benchmarks" / "fidelity" / "report.py"


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("fidelity_report", REPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trial(method: str, question: int, correct: bool, **more) -> dict:
    name, _, budget = method.partition(":")
    return {"family": "multikey", "history_tokens": 131072, "seed": 0, "question": question, "method": method,
            "method_name": name, "budget": int(budget) if budget else None, "correct": correct,
            "answer_in_view": True, "prompt_tokens": 130000, "ttft_s": 0.5, "bytes_moved": 0, **more}


def test_a_rerun_trial_counts_once_from_the_last_file(report, tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(json.dumps(trial("rag:8192", 0, False)) + "\n")
    second.write_text(json.dumps(trial("rag:8192", 0, True)) + "\n")
    (row, _) = report.cells(list(report.read_trials([first, second]).values()))  # the family's and "all"
    assert (row["n"], row["correct"]) == (1, 1)


def test_device_kv_is_the_view_for_views_and_the_prompt_for_text_methods(report):
    rows = report.cells([trial("views-rerank:8192", 0, True, view_tokens=8165, bytes_moved=2.4e8),
                         trial("views-rerank:8192", 1, False, view_tokens=8101, bytes_moved=2.5e8),
                         trial("rag:8192", 0, True, prompt_tokens=8050)])
    by = {(r["task"], r["method"]): r for r in rows}
    views, rag = by[("multikey", "views-rerank")], by[("multikey", "rag")]
    assert views["device_kv_tokens_median"] == 8133 and rag["device_kv_tokens_median"] == 8050
    assert (views["n"], views["correct"], views["later_questions"]) == (2, 1, {"n": 1, "correct": 0})
    assert views["bytes_moved_median"] == 245_000_000
    assert by[("all", "views-rerank")]["n"] == 2


def test_the_interval_is_wilsons(report):
    assert report.wilson(42, 75) == pytest.approx((0.4475, 0.6667), abs=1e-4)  # by hand: (0.4475, 0.6667)
    assert report.wilson(0, 15)[0] == 0.0
