"""Request options beside sampling (``kvdrop_engine.request_options``): one slot, built and
validated once -- one HTTP request runs ``SamplingParams.from_dict``, ``check_salt`` and the
``"kvdrop"`` override parser once each, and the engine takes the objects as they are."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests
import torch

from kvdrop_engine import drop
from kvdrop_engine.drop import UNSET, Override, PromptDropper
from kvdrop_engine.engine import Engine
from kvdrop_engine.errors import InvalidRequestError
from kvdrop_engine.http import CompletionHTTPServer
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer
from kvdrop_engine.request_options import RequestOptionError, RequestOptions, submission
from kvdrop_engine.sampling import SamplingParams
from kvdrop_sdk import protocol
from kvdrop_sdk.events import kept_prompt_tokens

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer.random(preset_config("tiny"), seed=0)


def test_options_are_validated_on_construction() -> None:
    opts = RequestOptions("tenant", {"policy": "knorm"})
    assert opts.cut == Override("knorm", None) and opts.asks_cut
    assert RequestOptions().cut is UNSET and not RequestOptions(cut=None).asks_cut
    for kwargs, field in [
        ({"cache_salt": 3}, "cache_salt"),
        ({"cut": {"ratio": 0.5}}, "kvdrop"),
        ({"reconstruct": "yes"}, "reconstruct"),
    ]:
        with pytest.raises(RequestOptionError) as err:
            RequestOptions(**kwargs)
        assert err.value.field == field


def test_a_sampling_dict_is_split_once() -> None:
    params, opts = submission({"max_tokens": 3, "kvdrop": None, "reconstruct": True}, "s")
    assert params == SamplingParams(max_tokens=3)
    assert (opts.cache_salt, opts.cut, opts.reconstruct) == ("s", None, True)
    same = SamplingParams(max_tokens=2)
    assert submission(same, opts) == (same, opts)  # objects are taken as they are
    with pytest.raises(InvalidRequestError, match="not in the sampling parameters as well"):
        submission({"kvdrop": None}, opts)
    with pytest.raises(InvalidRequestError, match="unsupported sampling parameter"):
        SamplingParams.from_dict({"reconstruct": True})  # an option, not sampling


def _counting(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Count every call of the three validators, wherever a module imported them."""
    calls: Counter[str] = Counter()

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name, original in [
        ("check_salt", protocol.check_salt),
        ("parse_override", drop.parse_override),
    ]:
        wrapped = counted(name, original)
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("kvdrop") and (
                getattr(mod, name, None) is original
            ):
                monkeypatch.setattr(mod, name, wrapped)
    from_dict = SamplingParams.from_dict.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(
        SamplingParams,
        "from_dict",
        classmethod(lambda cls, p: (calls.update(["from_dict"]), from_dict(cls, p))[1]),
    )
    return calls


def test_one_http_request_validates_once(
    model: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    dropper = PromptDropper(model.config, "knorm", keep_ratio=0.5)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 200, (200,), generator=gen).tolist()
    body = {
        "prompt": prompt,
        "max_tokens": 3,
        "temperature": 0,
        "cache_salt": "tenant-a",
        "kvdrop": {"policy": "knorm", "keep_ratio": 0.25},
    }
    with Engine(model, num_blocks=64, dropper=dropper) as engine:
        with CompletionHTTPServer(engine.post_completion, model_name="m", port=0) as srv:
            calls = _counting(monkeypatch)
            r = requests.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["kept_prompt_tokens"] == 50
    assert calls == Counter(from_dict=1, check_salt=1, parse_override=1)


def test_a_python_caller_is_validated_once(
    model: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    dropper = PromptDropper(model.config, "knorm", keep_ratio=0.5)
    with Engine(model, num_blocks=64, dropper=dropper) as engine:
        calls = _counting(monkeypatch)
        events: Iterator[Any] = engine.post_completion(
            list(range(3, 203)), {"max_tokens": 2, "kvdrop": {"keep_ratio": 0.25}}, "salt"
        )
        assert kept_prompt_tokens(events) == 50
    assert calls == Counter(from_dict=1, check_salt=1, parse_override=1)
