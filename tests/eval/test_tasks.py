"""The evaluation's task generators (benchmarks/eval/tasks.py): no engine, a few seconds.

Histories are deterministic per seed, hold their needles inside a tool turn,
land on their token target (counted with SmolLM2's own tokenizer and chat
template), and the answer checker accepts the gold answer and rejects others.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EVAL_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "eval"


@pytest.fixture(scope="module")
def tasks():
    spec = importlib.util.spec_from_file_location("eval_tasks", EVAL_DIR / "tasks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["eval_tasks"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("task", ["passkey", "multikey", "vartrack"])
def test_same_seed_same_history_other_seed_other_history(tasks, tok, task):
    a = tasks.generate(task, 4096, 7, tok)
    b = tasks.generate(task, 4096, 7, tok)
    c = tasks.generate(task, 4096, 8, tok)
    assert a.messages == b.messages and a.answer == b.answer
    assert c.messages != a.messages


@pytest.mark.parametrize("task, target", [("passkey", 4096), ("multikey", 7168), ("vartrack", 5120),
                                          ("passkey", 16384)])
def test_length_lands_on_target(tasks, tok, task, target):
    t = tasks.generate(task, target, 1, tok)
    assert t.prompt_tokens == tasks.count_tokens(tok, t.messages)
    assert target * 0.98 <= t.prompt_tokens <= target


@pytest.mark.parametrize("task", ["passkey", "multikey", "vartrack"])
def test_needles_and_answer_are_in_tool_turns(tasks, tok, task):
    for seed in range(3):
        t = tasks.generate(task, 4096, seed, tok)
        tool_text = "\n".join(m["content"] for m in t.messages if m["role"] == "tool")
        assert t.required_lines and all(line in tool_text for line in t.required_lines)
        assert t.answer in tool_text
        assert t.needle_turns and all(t.messages[i]["role"] == "tool" for i in t.needle_turns)
        assert t.answer not in t.messages[-1]["content"] and t.answer not in t.question
        roles = [m["role"] for m in t.messages]
        assert roles[:2] == ["system", "user"] and roles[-2:] == ["user", "assistant"]
        assert set(roles[2:-2]) == {"assistant", "tool"}


def test_checker_accepts_gold_and_rejects_others(tasks):
    assert tasks.is_correct("48213", " 48213.")
    assert tasks.is_correct("48213", "The pass key is 48213")
    assert not tasks.is_correct("48213", " 48231.")
    assert not tasks.is_correct("48213", " 1.")
    assert not tasks.is_correct("2134", "123456")     # not inside a longer number


def test_sliding_window_keeps_head_question_and_fits(tasks, tok):
    t = tasks.generate("passkey", 7168, 2, tok)
    for budget in (2048, 4096):
        w = tasks.sliding_window(t.messages, tok, budget)
        assert budget * 0.97 <= tasks.count_tokens(tok, w) <= budget
        assert w[:2] == t.messages[:2] and w[-2:] == t.messages[-2:]
        # what is kept is the most recent history: the last tool turn is intact
        assert w[-3] == t.messages[-3]
    assert tasks.sliding_window(t.messages, tok, 8192) is t.messages
