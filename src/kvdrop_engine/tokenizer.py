"""Tokenizers (text <-> token ids) and the one incremental detokenizer of the engine.

:class:`Tokenizer` is built from a GGUF file's metadata with the ``tokenizers`` package (no hub
access). It supports byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``: SmolLM,
Qwen, Llama 3 ...): tokens and merges come from ``tokenizer.ggml.*``, tokens marked CONTROL become
special tokens, and the pre-tokenizer follows ``tokenizer.ggml.pre`` as llama.cpp does. The chat
template stored in the file is rendered with jinja2 in a sandbox, the way transformers renders it.
:class:`JSONTokenizer` reads an HF ``tokenizer.json`` (and the chat template of the
``tokenizer_config.json`` beside it). :class:`IncrementalDetokenizer` turns a
growing list of generated ids into text deltas (used by the engine and by the HTTP server).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "ChatTurns",
    "IncrementalDetokenizer",
    "JSONTokenizer",
    "SpecialTokens",
    "TextTokenizer",
    "TokenDecoder",
    "Tokenizer",
    "TokenizerError",
    "user_turn",
]

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split regex, split digits one by one first). Unknown names use GPT-2's.
_PRE: dict[str, tuple[str, bool]] = {
    "default": (_GPT2_SPLIT, False),
    "gpt2": (_GPT2_SPLIT, False),
    "smollm": (_GPT2_SPLIT, True),
    "starcoder": (_GPT2_SPLIT, True),
    "llama3": (_LLAMA3_SPLIT, False),
    "llama-bpe": (_LLAMA3_SPLIT, False),
    "smaug-bpe": (_LLAMA3_SPLIT, False),
    "qwen2": (_QWEN2_SPLIT, False),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False),
}


class TokenDecoder(Protocol):
    """What detokenisation needs: token ids in, text out."""

    def decode(self, token_ids: Sequence[int]) -> str: ...


class TextTokenizer(TokenDecoder, Protocol):
    """What the HTTP server needs: text prompts in (``encode``), token text out (``decode``)."""

    def encode(self, text: str) -> list[int]: ...


@runtime_checkable
class SpecialTokens(Protocol):
    """A tokenizer that says which ids are special (``<|im_end|>``...): what
    ``skip_special_tokens`` leaves out of the text."""

    special_token_ids: frozenset[int]


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting multi-byte characters.

    Each :meth:`add` decodes a short window (the tokens since the last emitted boundary plus the
    new one), never the whole output, and returns what the new token adds. A trailing U+FFFD means
    an incomplete UTF-8 sequence: the text is held back until it completes, or until ``final``.
    Ids in ``skip`` (the special tokens, with ``skip_special_tokens``) add no text.
    """

    def __init__(self, tokenizer: TokenDecoder, skip: frozenset[int] = frozenset()) -> None:
        self._tok = tokenizer
        self._skip = skip
        self._ids: list[int] = []
        self._start = 0  # the window: ids[start:emitted] is text already returned
        self._emitted = 0

    def add(self, token_id: int, *, final: bool = False) -> str:
        """Append one token; return the new text it completes (possibly empty). ``final`` flushes
        whatever is held back (the last token of a request)."""
        if token_id in self._skip:
            return self.flush() if final else ""
        self._ids.append(token_id)
        return self._delta(final)

    def flush(self) -> str:
        """The text held back (an incomplete character), now; the request ends."""
        return self._delta(True)

    def _delta(self, final: bool) -> str:
        before = self._tok.decode(self._ids[self._start : self._emitted])
        now = self._tok.decode(self._ids[self._start :])
        if len(now) <= len(before) or (not final and now.endswith("\ufffd")):
            return ""
        delta = now[len(before) :] if now.startswith(before) else now
        self._start, self._emitted = self._emitted, len(self._ids)
        return delta


class JSONTokenizer:
    """An HF ``tokenizer.json`` (via ``tokenizers``) with ``encode``/``decode``, and the chat
    template of the ``tokenizer_config.json`` beside it when there is one."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as e:
            raise ImportError(
                "the tokenizer needs 'tokenizers': pip install 'kvdrop[model]'"
            ) from e
        path = Path(path)
        self._tk = HFTokenizer.from_file(str(path))
        self.vocab_size = self._tk.get_vocab_size(with_added_tokens=True)
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, added in self._tk.get_added_tokens_decoder().items() if added.special
        )
        self.name = path.parent.name or path.name
        self.chat_template: str | None = None
        self.bos_token: str | None = None
        self.eos_token: str | None = None
        config_file = path.with_name("tokenizer_config.json")
        if config_file.is_file():
            import json

            config = json.loads(config_file.read_text(encoding="utf-8"))
            self.chat_template = _config_template(config.get("chat_template"))
            self.bos_token = _token_text(config.get("bos_token"))
            self.eos_token = _token_text(config.get("eos_token"))

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``: by default as the file's post-processor makes them; with
        ``add_bos`` False no special token is added, with True the config's BOS leads."""
        if add_bos is None:
            return list(self._tk.encode(text).ids)
        ids = list(self._tk.encode(text, add_special_tokens=False).ids)
        bos = None if self.bos_token is None else self._tk.token_to_id(self.bos_token)
        return [bos, *ids] if add_bos and bos is not None else ids

    def backend(self) -> Any:
        """The ``tokenizers.Tokenizer`` underneath (what structured outputs read the vocabulary
        from)."""
        return self._tk

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The chat template rendered to text (as transformers renders it)."""
        return _render_chat(
            self.chat_template,
            f"{self.name}: no chat_template in tokenizer_config.json",
            messages,
            add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    def user_turn(self) -> tuple[list[int], list[int]] | None:
        """Token ids before and after a user message's text in the chat template (the
        assistant turn opened), or None without a template."""
        return user_turn(self)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids`` (special tokens kept unless ``skip_special_tokens``)."""
        ids = [int(t) for t in token_ids]
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered chat (the template writes BOS itself where it wants one)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs), False)


def _config_template(value: Any) -> str | None:
    """``chat_template`` of a tokenizer_config.json: a string, or a list of named templates."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) and value else None


def _token_text(value: Any) -> str | None:
    """A special token of a tokenizer_config.json: a string or an ``AddedToken`` dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class TokenizerError(ValueError):
    """The GGUF tokenizer metadata is missing or of an unsupported kind, or a template failed."""


class Tokenizer:
    """Byte-level BPE tokenizer plus chat template, from GGUF metadata.

    ``encode`` never adds BOS unless the file asks for it (``tokenizer.ggml.add_bos_token``) and
    matches special tokens written in the text (``<|im_start|>``) as single ids.
    """

    def __init__(self, metadata: Mapping[str, Any], name: str = "gguf") -> None:
        try:
            from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as e:
            raise ImportError(
                "the tokenizer needs 'tokenizers': pip install 'kvdrop[model]'"
            ) from e
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(
                f"{name}: tokenizer.ggml.model is {kind!r}; "
                "only byte-level BPE ('gpt2') is supported"
            )
        tokens = metadata.get("tokenizer.ggml.tokens")
        merges = metadata.get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise TokenizerError(
                f"{name}: tokenizer.ggml.tokens and tokenizer.ggml.merges are required"
            )
        types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(types) != len(tokens):
            raise TokenizerError(
                f"{name}: tokenizer.ggml.token_type has {len(types)} entries, expected one per "
                f"token ({len(tokens)})"
            )
        self.tokens: list[str] = list(tokens)
        vocab = {tok: i for i, tok in enumerate(self.tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        model = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False)
        tk = HFTokenizer(model)
        split, digits = _PRE.get(
            str(metadata.get("tokenizer.ggml.pre", "default")), _PRE["default"]
        )
        steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
        steps += [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
        tk.pre_tokenizer = pre_tokenizers.Sequence(steps)
        tk.decoder = decoders.ByteLevel()
        special = [t for t, ty in zip(self.tokens, types, strict=True) if ty == _CONTROL]
        tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        user = [t for t, ty in zip(self.tokens, types, strict=True) if ty == _USER_DEFINED]
        if user:
            tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
        self._tk = tk
        self.name = name
        self.special_tokens: frozenset[str] = frozenset(special)
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, ty in enumerate(types) if ty == _CONTROL
        )
        self.chat_template: str | None = metadata.get("tokenizer.chat_template")
        self.bos_token_id: int | None = _opt_int(metadata.get("tokenizer.ggml.bos_token_id"))
        eos = _opt_int(metadata.get("tokenizer.ggml.eos_token_id"))
        eot = _opt_int(metadata.get("tokenizer.ggml.eot_token_id"))
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys(i for i in (eos, eot) if i is not None)
        )
        self.add_bos: bool = bool(metadata.get("tokenizer.ggml.add_bos_token", False))

    def backend(self) -> Any:
        """The ``tokenizers.Tokenizer`` built from the GGUF metadata (what structured outputs
        read the vocabulary from)."""
        return self._tk

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Read the tokenizer metadata of a ``.gguf`` file."""
        from kvdrop_engine.weights import gguf_metadata

        return cls(gguf_metadata(path), name=Path(path).name)

    @property
    def vocab_size(self) -> int:
        """Number of tokens in the vocabulary (special tokens included)."""
        return len(self.tokens)

    @property
    def bos_token(self) -> str | None:
        """BOS token text, or None."""
        return None if self.bos_token_id is None else self.tokens[self.bos_token_id]

    @property
    def eos_token(self) -> str | None:
        """The first EOS token's text, or None."""
        return self.tokens[self.eos_token_ids[0]] if self.eos_token_ids else None

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; BOS prepended when ``add_bos`` (default: the file's flag)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        ids = self._tk.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (invalid UTF-8 from partial byte sequences becomes U+FFFD)."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {bad[:4]}")
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The chat template rendered to text (jinja2 sandbox, trim_blocks/lstrip_blocks as HF)."""
        return _render_chat(
            self.chat_template,
            f"{self.name}: the GGUF file has no tokenizer.chat_template",
            messages,
            add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered chat (special tokens in the template become single ids)."""
        return self.encode(
            self.render_chat(messages, add_generation_prompt, **kwargs), add_bos=False
        )

    def user_turn(self) -> tuple[list[int], list[int]] | None:
        """Token ids before and after a user message's text in the chat template (the
        assistant turn opened), or None without a template."""
        return user_turn(self)


class _Renders(Protocol):
    chat_template: str | None

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str: ...

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]: ...


@runtime_checkable
class ChatTurns(Protocol):
    """A tokenizer that splits its chat template around a user message (both of kvdrop's)."""

    def user_turn(self) -> tuple[list[int], list[int]] | None: ...


#: Stands for the user's text while the template is rendered (no template writes it itself).
_MARKER = "\x00KVDROP\x00"


def user_turn(tokenizer: _Renders) -> tuple[list[int], list[int]] | None:
    """The one split of the chat template around a user message: the ids rendered before its
    text and after it (the assistant turn opened), or None when there is no template."""
    if not tokenizer.chat_template:
        return None
    text = tokenizer.render_chat([{"role": "user", "content": _MARKER}])
    before, sep, after = text.partition(_MARKER)
    if not sep:
        return None
    return tokenizer.encode(before, add_bos=False), tokenizer.encode(after, add_bos=False)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _render_chat(
    template: str | None,
    missing: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    **context: Any,
) -> str:
    """Check ``messages`` and render them with the model's chat ``template`` (``missing`` is
    the error when there is none)."""
    if not template:
        raise TokenizerError(missing)
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be a mapping with 'role' and 'content'")
    cont = bool(context.pop("continue_final_message", False))
    text = _render(
        template,
        messages=[dict(m) for m in messages],
        add_generation_prompt=add_generation_prompt and not cont,
        **context,
    )
    if not cont:
        return text
    # As transformers does: the rendered chat ends where the last message's text does, so the
    # model continues it instead of closing its turn.
    last = str(messages[-1]["content"]).strip()
    at = text.rfind(last) if last else -1
    if at < 0:
        raise TokenizerError("continue_final_message: the template does not write the last message")
    return text[: at + len(last)]


def _render(template: str, **context: Any) -> str:
    """Render a chat template the way transformers does (sandboxed, trimmed blocks)."""
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ImportError("chat templates need 'jinja2': pip install 'kvdrop[model]'") from e
    import json
    from datetime import datetime

    def raise_exception(message: str) -> None:
        raise TokenizerError(f"chat template error: {message}")

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(**context)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"chat template failed to render: {e}") from e
