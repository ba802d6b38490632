"""Round 4 (issue 33): text the server cannot encode is refused at the edge, and one client's
suspect slots cost that client, not everyone.

Every test talks to a real server (a subprocess) on 127.0.0.1; each failed on the code before
the fix.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvdrop_sdk import CacheLayout
from kvdrop_sdk.hashing import encode_tokens
from kvdrop_sdk.protocol import RpcClient, RpcError, check_salt
from kvdrop_sdk.testing.server import spawn_server

pytestmark = pytest.mark.timeout(120)

CHUNK = 256
LAYOUT = CacheLayout(num_layers=2, num_heads=2, head_dim=16, dtype=torch.float32)
LONE = "\ud800"  # a lone UTF-16 surrogate: valid JSON ("\\ud800"), no valid UTF-8


def toks(i: int, n: int) -> list[int]:
    return list(range(100_000 * (i + 1), 100_000 * (i + 1) + n))


def head(model: str = "m", salt: str = "") -> dict[str, Any]:
    return {"model": model, "kind": "kv", "salt": salt}


# -- G: lone surrogates ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("op", "fields", "where"),
    [
        ("lookup", head(salt=f"a{LONE}"), "field 'salt'"),
        ("reserve", {**head(salt=LONE), "lease_s": 5}, "field 'salt'"),
        ("get", head(salt=LONE), "field 'salt'"),
        ("register", {**head(model=f"m{LONE}"), "layout": LAYOUT.to_json()}, "field 'model'"),
        ("lookup", {**head(), "client": LONE}, "field 'client'"),
    ],
)
def test_lone_surrogates_are_a_bad_field_naming_it(
    op: str, fields: dict[str, Any], where: str
) -> None:
    """Each is refused with ``bad_field`` naming the field (was ``internal``:
    UnicodeEncodeError, or a model that registered and then failed); the server serves on."""
    with spawn_server(shm_name=None, l1_size_gb=0.01, chunk_size=CHUNK) as srv:
        with RpcClient(srv.url, 10) as rpc:
            rpc.call("register", {**head(), "layout": LAYOUT.to_json()})
            with pytest.raises(RpcError) as err:
                rpc.call(op, fields, [encode_tokens(toks(0, CHUNK))])
            assert err.value.code == "bad_field", str(err.value)
            assert where in str(err.value) and "lone UTF-16 surrogate (U+D800)" in str(err.value)
            reply, _ = rpc.call("lookup", head(), [encode_tokens(toks(0, CHUNK))])
            assert reply["ok"]
            assert LONE not in repr(srv.status())  # nothing registered under it


def test_salts_are_checked_before_sending() -> None:
    """The SDK and the engine refuse the salt themselves (``check_salt``: one rule)."""
    with pytest.raises(ValueError, match=r"cache_salt holds a lone UTF-16 surrogate"):
        check_salt(f"x{LONE}")
    assert check_salt("\U0001f600") == "\U0001f600"  # a pair is one code point: fine
