"""`vllm_sekv.prompt_tokens`: a chat prompt that extends a recent one is
tokenized from the recent one's tokens, and always to exactly the ids the
tokenizer gives the whole text (the bundled model's real tokenizer)."""
import random

import pytest

from vllm_sekv.prompt_tokens import PromptTokenCache, _overlap, markers_of, reuse_prompt_tokens

PIECES = ["def f(x):\n    return x", "  ", "\n\n", "日本語のテキスト", "naïve café", "<|im_start|>", "<|im_end",
          "|>", "<|im_end|>user", " <", "\t", "key = 0x1F", "ab" * 50, "🙂", "end of line \r\n"]


def text_of(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PIECES) if rng.random() < 0.3 else rng.choice("abc xyz.\n") * rng.randint(1, 30)
                   for _ in range(n))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def plain_ids(tokenizer, messages):
    return type(tokenizer).apply_chat_template(tokenizer, messages, tokenize=True, add_generation_prompt=True,
                                               return_dict=False)


def wrapped(tokenizer, **kwargs):
    import copy

    tok = copy.copy(tokenizer)  # as vLLM's renderer does: the wrapper lives on this object only
    reused = []
    cache = reuse_prompt_tokens(tok, on_reuse=reused.append, **kwargs)
    assert cache is not None
    return tok, reused


def test_the_chat_markers_are_the_tokens_no_other_added_token_overlaps(tokenizer):
    markers = markers_of(tokenizer)
    assert {"<|im_start|>", "<|im_end|>"} <= set(markers)
    assert markers["<|im_start|>"] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert _overlap("<|im_start|>", "<|im_start|>x") and _overlap("ab>", ">cd") and _overlap("<ab", "x<a")
    assert not _overlap("<|im_start|>", "<|im_end|>")


def test_an_added_token_that_overlaps_a_marker_takes_it_out(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>tool"]})
    markers = markers_of(tok)
    assert "<|im_start|>" not in markers and "<|im_end|>" in markers


@pytest.mark.parametrize("seed", range(6))
def test_growing_sessions_get_exactly_the_tokenizers_ids(tokenizer, seed):
    """Three interleaved agent sessions, each step the whole conversation;
    now and then a session rewrites an earlier message (an agent trimming a
    tool output), starts over, or repeats a step."""
    rng = random.Random(seed)
    tok, reused = wrapped(tokenizer, min_chars=256)
    sessions = [[{"role": "system", "content": f"agent {i}. " + text_of(rng, 3)}] for i in range(3)]
    extended = 0
    for _ in range(24):
        messages = rng.choice(sessions)
        event = rng.random()
        if event < 0.1 and len(messages) > 2:
            messages[rng.randrange(1, len(messages))]["content"] = text_of(rng, 5)
        elif event < 0.15:
            del messages[1:]
        elif event > 0.9:
            pass  # the same prompt again
        else:
            messages.append({"role": "user", "content": text_of(rng, rng.randint(5, 40))})
            extended += 1
        before = len(reused)
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert ids == plain_ids(tokenizer, messages)
        if len(reused) > before:
            assert 0 < reused[-1] < len(ids)
        if messages[-1]["role"] == "user":
            messages.append({"role": "assistant", "content": text_of(rng, rng.randint(1, 6))})
    assert len(reused) >= extended // 2  # most steps extend a kept prompt


def test_a_step_reuses_its_previous_prompt_up_to_the_assistant_marker(tokenizer):
    rng = random.Random(7)
    tok, reused = wrapped(tokenizer, min_chars=256)
    messages = [{"role": "user", "content": text_of(rng, 60)}]
    first = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert reused == []
    messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": text_of(rng, 20)}]
    second = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert second == plain_ids(tokenizer, messages)
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert reused == [len(first) - 1 - first[::-1].index(start)]  # all before the generation prompt's marker


def test_a_small_bound_drops_the_oldest_and_stays_exact(tokenizer):
    rng = random.Random(3)
    tok, reused = wrapped(tokenizer, min_chars=256, max_bytes=64 << 10)
    sessions = [[{"role": "user", "content": text_of(rng, 80)}] for _ in range(6)]
    for step in range(3):
        for messages in sessions:
            ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
            assert ids == plain_ids(tokenizer, messages)
            messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": text_of(rng, 10)}]
    cache = PromptTokenCache(lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
                             markers_of(tokenizer), min_chars=256, max_bytes=64 << 10)
    for messages in sessions:
        cache.encode(tokenizer.apply_chat_template(messages, tokenize=False))
    assert 0 < cache.kept_bytes <= 64 << 10 and 0 < len(cache) < len(sessions)


def test_vllms_prompt_call_goes_through_the_cache_and_truncates_as_before(tokenizer):
    tok, reused = wrapped(tokenizer, min_chars=256)
    rng = random.Random(11)
    text = tokenizer.apply_chat_template([{"role": "user", "content": text_of(rng, 60)}], tokenize=False)
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    # as vLLM's renderer asks: truncation at one more than the prompt may hold
    assert tok(text, add_special_tokens=False, truncation=True, max_length=len(whole) + 1)["input_ids"] == whole
    longer = text + "<|im_start|>user\n" + text_of(rng, 5)
    assert tok(longer, add_special_tokens=False, truncation=True, max_length=10**6)["input_ids"] == \
        tokenizer(longer, add_special_tokens=False)["input_ids"]
    assert reused and reused[-1] >= len(whole) - 8
    for kw in ({"truncation": True, "max_length": 10}, {"max_length": 10}):  # truncated: as the tokenizer does
        assert tok(longer, add_special_tokens=False, **kw)["input_ids"] == \
            tokenizer(longer, add_special_tokens=False, **kw)["input_ids"]
    assert type(tok).__name__.startswith("PromptReusing") and type(tokenizer).__name__ != type(tok).__name__


def test_other_calls_pass_through(tokenizer):
    tok, reused = wrapped(tokenizer, min_chars=16)
    messages = [{"role": "user", "content": "hello " * 40}]
    assert tok.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(messages, tokenize=False)
    as_dict = tok.apply_chat_template(conversation=messages, tokenize=True, return_dict=True)
    assert as_dict["input_ids"] == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    batched = tok.apply_chat_template([messages, messages], tokenize=True, return_dict=False)
    assert batched[0] == batched[1]
    assert reused == []
