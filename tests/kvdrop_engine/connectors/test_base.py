"""The argument checks every cache-server connector shares (one owner: ``check_server_args``)."""

from __future__ import annotations

import pytest

from kvdrop_engine.connectors.base import check_server_args
from kvdrop_engine.connectors.kvdrop import ServerConnector
from kvdrop_engine.connectors.lmcache import LMCacheConnector


@pytest.mark.parametrize("connector", [ServerConnector, LMCacheConnector])
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model_name": ""}, "model_name must be a non-empty str, got ''"),
        ({"model_name": 3}, "model_name must be a non-empty str, got 3"),
        ({"model_name": "m", "transfer_query": "yes"}, "transfer_query must be a bool or None"),
    ],
)
def test_connectors_refuse_bad_server_args(connector: type, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        connector("tcp://127.0.0.1:1", "http://127.0.0.1:1", **kwargs)


def test_check_server_args_accepts_defaults() -> None:
    for transfer_query in (None, True, False):
        check_server_args("model", transfer_query)
