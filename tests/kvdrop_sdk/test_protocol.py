"""Wire-level pieces: chunk-key hashing, token encoding, headers, CacheLayout JSON."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvdrop_sdk import CacheKind, CacheLayout
from kvdrop_sdk.hashing import chunk_keys, decode_tokens, encode_tokens, root_hash
from kvdrop_sdk.protocol import MAX_HEADER_BYTES, ProtocolError, decode_header, encode_header


def test_chunk_keys_follow_the_documented_chain() -> None:
    tokens = list(range(10, 10 + 600))
    root = root_hash("m", "kv", "salt")
    field = lambda s: struct.pack("<Q", len(s)) + s.encode()  # noqa: E731
    assert (
        root
        == hashlib.sha256(b"kvdrop-chunk-v1" + field("m") + field("kv") + field("salt")).digest()
    )
    keys = chunk_keys(root, encode_tokens(tokens), 256)
    assert len(keys) == 2  # the 88-token tail has no key
    h1 = hashlib.sha256(root + b"".join(t.to_bytes(8, "little") for t in tokens[:256])).digest()
    h2 = hashlib.sha256(h1 + b"".join(t.to_bytes(8, "little") for t in tokens[256:512])).digest()
    assert keys == [h1, h2]


def test_keys_are_stable_across_processes() -> None:
    code = (
        "from kvdrop_sdk.hashing import *;"
        "print(chunk_keys(root_hash('m','kv',''), encode_tokens(range(512)), 256)[1].hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    here = chunk_keys(root_hash("m", "kv", ""), encode_tokens(range(512)), 256)[1].hex()
    assert out.stdout.strip() == here


@given(
    a=st.lists(st.integers(0, 2**40), min_size=8, max_size=40),
    b=st.lists(st.integers(0, 2**40), min_size=8, max_size=40),
)
def test_a_key_depends_on_every_earlier_token(a: list[int], b: list[int]) -> None:
    root = root_hash("m", "kv", "")
    ka, kb = chunk_keys(root, encode_tokens(a), 4), chunk_keys(root, encode_tokens(b), 4)
    for i in range(min(len(ka), len(kb))):
        assert (ka[i] == kb[i]) == (a[: 4 * (i + 1)] == b[: 4 * (i + 1)])


def test_roots_differ_by_model_kind_salt_without_ambiguity() -> None:
    roots = {
        root_hash("m", "kv", ""),
        root_hash("m##query", "query", ""),
        root_hash("m", "query", ""),
        root_hash("m", "kv", "s"),
        root_hash("ab", "c", ""),
        root_hash("a", "bc", ""),
    }
    assert len(roots) == 6


def test_token_encoding() -> None:
    assert decode_tokens(encode_tokens([0, 1, 2**63 - 1])) == [0, 1, 2**63 - 1]
    assert encode_tokens([1]) == b"\x01" + b"\0" * 7
    with pytest.raises(ValueError, match="non-negative"):
        encode_tokens([3, -1])
    with pytest.raises(ValueError, match=r"ints in \[0, 2\*\*63\)"):
        encode_tokens([2**64])
    with pytest.raises(ValueError, match="ints"):
        encode_tokens([1.5])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="multiple of 8"):
        decode_tokens(b"123")


def test_headers() -> None:
    assert decode_header(encode_header({"op": "ping", "rid": 1})) == {"op": "ping", "rid": 1}
    for raw, code in [
        (b"\xff", "bad_header"),
        (b"nope", "bad_header"),
        (b"3", "bad_header"),
        (b"{" + b" " * MAX_HEADER_BYTES + b"}", "oversized"),
    ]:
        with pytest.raises(ProtocolError) as info:
            decode_header(raw)
        assert info.value.code == code


def test_layout_json_round_trip_and_shapes() -> None:
    lay = CacheLayout(num_layers=4, num_heads=8, head_dim=64, dtype=torch.bfloat16)
    assert lay.width == 512 and lay.itemsize == 2
    assert lay.to_json() == {"num_layers": 4, "num_heads": 8, "head_dim": 64, "dtype": "bfloat16"}
    assert CacheLayout.from_json(lay.to_json()) == lay
    assert CacheLayout.from_json({**lay.to_json(), "dtype": "torch.bfloat16"}) == lay
    assert lay.shape(CacheKind.KV, 10) == (2, 4, 10, 512)
    assert lay.shape("query", 10) == (1, 4, 10, 512)
    assert lay.nbytes(CacheKind.KV, 256) == 2 * 4 * 256 * 512 * 2


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([1, 2], "must be a JSON object"),
        ({"num_layers": 1}, "missing"),
        (
            {"num_layers": 1, "num_heads": 1, "head_dim": 1, "dtype": "float32", "x": 1},
            "unexpected",
        ),
        ({"num_layers": 0, "num_heads": 1, "head_dim": 1, "dtype": "float32"}, "num_layers"),
        ({"num_layers": 1, "num_heads": True, "head_dim": 1, "dtype": "float32"}, "num_heads"),
        ({"num_layers": 1, "num_heads": 1, "head_dim": 1.5, "dtype": "float32"}, "head_dim"),
        ({"num_layers": 1, "num_heads": 1, "head_dim": 1, "dtype": "complex64"}, "unknown dtype"),
        ({"num_layers": 1, "num_heads": 1, "head_dim": 1, "dtype": 3}, "dtype must be a string"),
    ],
)
def test_layout_validation(data: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CacheLayout.from_json(data)


def test_layout_rejects_unsupported_dtype() -> None:
    with pytest.raises(ValueError, match="unsupported dtype"):
        CacheLayout(1, 1, 1, torch.complex64)


def test_one_salt_rule_and_short_scoped_salts() -> None:
    from kvdrop_sdk.protocol import MAX_SALT_CHARS, check_salt, scoped_salt

    assert check_salt("x" * MAX_SALT_CHARS) == "x" * MAX_SALT_CHARS
    with pytest.raises(ValueError, match=f"at most {MAX_SALT_CHARS}"):
        check_salt("x" * (MAX_SALT_CHARS + 1))
    with pytest.raises(TypeError, match="cache_salt must be a string"):
        check_salt(3)
    assert scoped_salt("s", "edit.r1") == "s.edit.r1"
    long = scoped_salt("y" * 4000, "edit.r1")
    assert len(long) <= 128 and long.endswith(".edit.r1") and "/" not in long
    assert long == scoped_salt("y" * 4000, "edit.r1") != scoped_salt("z" * 4000, "edit.r1")


def test_an_edit_salts_tenant_is_the_salt_it_was_scoped_from() -> None:
    """Engines share memory and the prefill budget per tenant: a stream's edit salt counts as
    the salt its stream began under (issue 31's pipelined job)."""
    from kvdrop_sdk.edit import edit_salt
    from kvdrop_sdk.protocol import scoped_salt, tenant_salt

    assert tenant_salt(edit_salt("job", "r1")) == "job" == tenant_salt("job")
    assert tenant_salt(edit_salt("a.b", "r1")) == "a.b" and tenant_salt("") == ""
    assert tenant_salt(edit_salt("", "r1")) == ""  # an unsalted stream's edit: unsalted
    # a salt too long for LMCache with the scope is hashed: its edits count under the hash
    digest = scoped_salt("y" * 4000, "edit.r1").removesuffix(".edit.r1")
    assert tenant_salt(edit_salt("y" * 4000, "r1")) == digest
