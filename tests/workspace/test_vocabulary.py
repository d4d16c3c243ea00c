"""The tokenizer's vocabulary (`workspace.vocabulary`): its break tokens as
`passages.break_token_ids` finds them, and each id's word, by which a name's
pieces match however the text before them split them."""
import numpy as np
import pytest
from transformers import AutoTokenizer

from vllm_sekv.workspace.passages import break_token_ids
from vllm_sekv.workspace.vocabulary import Vocabulary, words_of


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def test_a_names_pieces_after_a_space_or_not_are_one_word(tokenizer):
    vocab = Vocabulary.of(tokenizer)
    for a, b in ((" MIN", "MIN"), (" count", "count"), (" name", "name")):  # `(MIN` and `= MIN`
        ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in (a, b)]
        assert [len(i) for i in ids] == [1, 1], ids  # each one token of SmolLM2's vocabulary
        assert ids[0] != ids[1] and vocab.words[ids[0][0]] == vocab.words[ids[1][0]]
    other = tokenizer("MAX", add_special_tokens=False)["input_ids"]
    assert vocab.words[other[0]] != vocab.words[tokenizer("MIN", add_special_tokens=False)["input_ids"][0]]


def test_every_word_is_an_id_spelling_it_and_special_tokens_are_their_own(tokenizer):
    vocab = Vocabulary.of(tokenizer)
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    assert len(vocab.words) == len(tokenizer) and np.array_equal(vocab.words[vocab.words], vocab.words)
    changed = np.flatnonzero(vocab.words != np.arange(len(vocab.words)))
    assert len(changed) > 1000
    assert all(texts[i].lstrip(" _") == texts[vocab.words[i]].lstrip(" _") for i in changed)
    assert all(vocab.words[i] == i for i in tokenizer.all_special_ids)
    assert set(tokenizer.all_special_ids) <= set(vocab.turns.tolist())
    assert {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")} <= set(vocab.turns.tolist())
    assert np.all(np.diff(vocab.turns) > 0)
    expected = break_token_ids(tokenizer)
    assert all(np.array_equal(getattr(vocab.breaks, f), getattr(expected, f))
               for f in ("whole", "closes", "opens", "newlines"))


def test_a_text_of_spaces_and_underscores_only_is_its_own_word():
    assert words_of(["a", " a", "_", "__", " ", "_a", "b"], special=set()).tolist() == [0, 0, 2, 3, 4, 0, 6]
    assert words_of(["a", " a"], special={1}).tolist() == [0, 1]
