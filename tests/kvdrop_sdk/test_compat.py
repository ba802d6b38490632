"""Upstream LMCache names: defined once in kvdrop_sdk.compat, importable where upstream has them."""

from __future__ import annotations

import importlib
import subprocess
import sys

import kvdrop_sdk as lmc_sdk
from kvdrop_sdk import compat


def test_aliases_are_the_kvdrop_classes() -> None:
    assert lmc_sdk.LMCacheSDKContext is lmc_sdk.Context
    assert lmc_sdk.LMCacheSDKError is lmc_sdk.SDKError
    assert lmc_sdk.LMCacheSDKCacheKind.QUERY.value == "query"
    assert lmc_sdk.LMCacheRequestStream is lmc_sdk.RequestStream
    assert lmc_sdk.LMCacheBatchedStream is lmc_sdk.BatchedStream
    assert set(compat.__all__) <= set(lmc_sdk.__all__)


def test_upstream_module_paths_work() -> None:
    """The paths of the upstream API text (``context.LMCacheSDKContext``, ...) all resolve."""
    for module, names in compat.MODULE_ALIASES.items():
        mod = importlib.import_module(f"kvdrop_sdk.{module}")
        for name in names:
            assert getattr(mod, name) is getattr(compat, name), f"kvdrop_sdk.{module}.{name}"
    assert lmc_sdk.context.ModifyFnType is lmc_sdk.ModifyFnType


def test_a_fresh_process_can_import_an_alias_from_its_module_first() -> None:
    code = (
        "from kvdrop_sdk.batch import LMCacheBatchedStream, LMCacheBatchedStreamError\n"
        "from kvdrop_sdk.request import LMCacheRequestStream\n"
        "import kvdrop_sdk.batch as lmc_batch\n"
        "assert lmc_batch.LMCacheBatchedStream is lmc_batch.BatchedStream\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
