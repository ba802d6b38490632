"""What a request asks of the engine beyond sampling: :class:`RequestOptions`, one slot beside
:class:`~kvdrop_engine.sampling.SamplingParams` (as vLLM passes ``kv_transfer_params`` beside
its sampling parameters).

A request is validated once, where it enters: the OpenAI server builds its ``SamplingParams``
and ``RequestOptions`` from the HTTP body and hands both to the engine as objects;
:func:`submission` turns what a Python caller passes (a sampling dict that may carry the
option keys ``"kvdrop"``, ``"reconstruct"`` and ``"structured_outputs"``, and a cache salt)
into the same two objects. Nothing downstream validates them again. A new per-request option
is a field here, read where it acts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvdrop_engine.drop import UNSET, Override, parse_override
from kvdrop_engine.errors import InvalidRequestError
from kvdrop_engine.sampling import SamplingParams
from kvdrop_engine.structured import Guide, guide_of
from kvdrop_sdk.protocol import check_salt

__all__ = [
    "OPTION_KEYS",
    "RequestOptionError",
    "RequestOptions",
    "check_request",
    "submission",
]

#: The keys of a sampling dict that are request options, not sampling (:func:`submission`),
#: and the field each fills.
OPTION_KEYS = {"kvdrop": "cut", "reconstruct": "reconstruct", "structured_outputs": "guide"}


class RequestOptionError(InvalidRequestError):
    """One request option is malformed; ``field`` names it as the client sent it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


@dataclass(frozen=True)
class RequestOptions:
    """A request's options, validated on construction (``RequestOptionError`` naming the field).

    ``cache_salt`` isolates its cached prefixes; ``cut`` is its ``"kvdrop"`` field (``UNSET``:
    not sent, the engine's ``--policy`` applies; None: no cut; an
    :class:`~kvdrop_engine.drop.Override`, parsed once by
    :func:`~kvdrop_engine.drop.parse_override`); ``reconstruct`` scores its prompt with KVzip's
    reconstruction pass when it ends (an engine built with ``reconstruction``; the ``kvzip``
    policy reads the scores); ``guide`` is the structured output it must follow (a
    :class:`~kvdrop_engine.structured.Guide`, or its ``{"kind", "value"}`` dict; None: free).
    """

    cache_salt: str = ""
    cut: Override | Any | None = UNSET
    reconstruct: bool = False
    guide: Guide | None = None

    def __post_init__(self) -> None:
        try:
            check_salt(self.cache_salt, "'cache_salt'")
        except (TypeError, ValueError) as exc:
            raise RequestOptionError("cache_salt", str(exc)) from None
        if self.cut is not UNSET and not isinstance(self.cut, Override):
            try:
                object.__setattr__(self, "cut", parse_override(self.cut))
            except ValueError as exc:
                raise RequestOptionError("kvdrop", str(exc)) from None
        if self.guide is not None and not isinstance(self.guide, Guide):
            try:
                object.__setattr__(self, "guide", guide_of(self.guide))
            except InvalidRequestError as exc:
                raise RequestOptionError("structured_outputs", str(exc)) from None
        if not isinstance(self.reconstruct, bool):
            raise RequestOptionError(
                "reconstruct", f"'reconstruct' must be a bool, got {self.reconstruct!r}"
            )

    @property
    def prompt_cut(self) -> Override | Any | None:
        """The prompt cut's override (``UNSET``: none sent, or only a decode cut; None: off)."""
        return self.cut.prompt_cut if isinstance(self.cut, Override) else self.cut

    @property
    def decode_cut(self) -> Any:
        """The cut while decoding's override (``UNSET``: none sent; None: off, as ``"kvdrop":
        null`` turns both off; else a ``DecodeOverride``)."""
        return self.cut.decode if isinstance(self.cut, Override) else self.cut

    @property
    def asks_cut(self) -> bool:
        """Whether the request asks for a cut of its own (an override that is not None)."""
        return self.cut is not UNSET and self.cut is not None


def submission(
    sampling_params: Mapping[str, Any] | SamplingParams | None,
    cache_salt: str | RequestOptions = "",
) -> tuple[SamplingParams, RequestOptions]:
    """A Python caller's request as the engine's two objects, each validated once: a
    ``SamplingParams`` is taken as it is, a dict is split into its option keys
    (:data:`OPTION_KEYS`) and its sampling values (``SamplingParams.from_dict``); a
    ``RequestOptions`` in place of the salt is taken whole (the OpenAI server's form)."""
    if isinstance(cache_salt, RequestOptions):
        if isinstance(sampling_params, Mapping) and set(OPTION_KEYS) & set(sampling_params):
            raise InvalidRequestError(
                f"give the request options {list(OPTION_KEYS)} in the RequestOptions, not in "
                "the sampling parameters as well"
            )
        options = cache_salt
    else:
        found: dict[str, Any] = {}
        if isinstance(sampling_params, Mapping) and set(OPTION_KEYS) & set(sampling_params):
            sampling_params = dict(sampling_params)
            found = {
                field: sampling_params.pop(key)
                for key, field in OPTION_KEYS.items()
                if key in sampling_params
            }
        options = RequestOptions(cache_salt, **found)
    if not isinstance(sampling_params, SamplingParams):
        sampling_params = SamplingParams.from_dict(sampling_params)
    check_request(sampling_params, options)
    return sampling_params, options


def check_request(params: SamplingParams, options: RequestOptions) -> None:
    """The rules between a request's sampling and its options, in one place: the OpenAI
    server's parse calls it (a 400 before anything is posted) and :func:`submission` does, so a
    Python caller meets the same rule. A structured output (``response_format``, ``guided_*``,
    a required or named ``tool_choice``) ends where its grammar ends, at the end-of-sequence
    token, so it takes neither ``ignore_eos`` nor a ``min_tokens`` (which would ban the only
    token the grammar allows once it is complete). ``RequestOptionError`` names the field."""
    if options.guide is None:
        return
    if params.ignore_eos:
        raise RequestOptionError(
            "ignore_eos",
            "structured outputs end at the end-of-sequence token; leave 'ignore_eos' out",
        )
    if params.min_tokens:
        raise RequestOptionError(
            "min_tokens",
            f"'min_tokens' ({params.min_tokens}) cannot be combined with a structured output: "
            "its grammar decides where the output ends (the end-of-sequence token that "
            "'min_tokens' would ban); leave 'min_tokens' out",
        )
