"""Transfer helpers a context uses to move tensor bytes to and from the server."""

from __future__ import annotations

from kvdrop_sdk.transport.contiguous import ContiguousTransferWrapper, TransferHelper

__all__ = ["ContiguousTransferWrapper", "TransferHelper"]
