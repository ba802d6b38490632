"""DMA to and from the server's shared memory: region registration, and the host fallback.

The CUDA runtime's calls are replaced by recording functions here (CI has no GPU); the real
registration and DMA run in benchmarks/transfer.py on a GPU machine."""

from __future__ import annotations

import logging

import pytest
import torch

import kvdrop_sdk as sdk
from kvdrop_sdk import CacheKind, CacheLayout
from kvdrop_sdk.testing.server import ServerHandle
from kvdrop_sdk.transport import cuda_host
from kvdrop_sdk.transport.cuda_host import REGION_BYTES, HostRegistration


class Recorder:
    def __init__(self, fail_at: int | None = None) -> None:
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.fail_at = fail_at

    def register(self, address: int, nbytes: int) -> int:
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            return 712  # cudaErrorHostMemoryAlreadyRegistered, say
        self.registered.append((address, nbytes))
        return 0

    def unregister(self, address: int, _nbytes: int) -> int:
        self.unregistered.append(address)
        return 0


def test_regions_are_registered_once_each_and_all_unregistered_on_close() -> None:
    rec = Recorder()
    size = 2 * REGION_BYTES + 12 * 4096
    reg = HostRegistration(1 << 40, size, rec.register, rec.unregister)
    assert reg.ensure(10, 100)
    assert reg.ensure(REGION_BYTES - 50, 100)  # straddles regions 0 and 1
    assert reg.ensure(5, 5)  # already registered: no new call
    assert reg.ensure(2 * REGION_BYTES + 1, 10)  # the short last region
    base = 1 << 40
    assert rec.registered == [
        (base, REGION_BYTES),
        (base + REGION_BYTES, REGION_BYTES),
        (base + 2 * REGION_BYTES, 12 * 4096),
    ]
    reg.close()
    assert sorted(rec.unregistered) == [a for a, _ in rec.registered]


def test_a_refused_registration_is_logged_once_and_every_later_call_says_no(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rec = Recorder(fail_at=1)
    reg = HostRegistration(0, 4 * REGION_BYTES, rec.register, rec.unregister)
    assert reg.ensure(0, 10)
    with caplog.at_level(logging.WARNING, logger=cuda_host.__name__):
        assert not reg.ensure(REGION_BYTES, 10)
        assert not reg.ensure(2 * REGION_BYTES, 10)
        assert not reg.ensure(0, 10)  # even a registered region: the caller falls back whole
    warnings = [r for r in caplog.records if "page-locked" in r.getMessage()]
    assert len(warnings) == 1 and "error 712" in warnings[0].getMessage()
    assert reg.failed is not None and len(rec.registered) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only default")
def test_without_cuda_registration_is_refused_up_front(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Asked for on a host without CUDA: refused, and said once per mapping (nothing was
    logged before, though the module docstring promised it)."""
    monkeypatch.setenv("KVDROP_CUDA_HOST_REGISTER", "1")
    with caplog.at_level(logging.WARNING, logger=cuda_host.__name__):
        reg = HostRegistration(0, REGION_BYTES)
        assert not reg.ensure(0, 10) and reg.failed == "CUDA is not available"
        assert not reg.ensure(0, 10)
    said = [r.getMessage() for r in caplog.records if "CUDA is not available" in r.getMessage()]
    assert len(said) == 1 and "KVDROP_CUDA_HOST_REGISTER=1" in said[0], said


@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_retrieve_to_a_device_returns_the_same_bytes(
    kv_server: ServerHandle, model_name: str, transport: str
) -> None:
    """``device=`` on a CPU machine: the host path, the same bytes as without it (on a GPU the
    slots come by DMA; benchmarks/transfer.py --device cuda checks them there)."""
    layout = CacheLayout(3, 2, 8, torch.bfloat16)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with sdk.kvcache.connect(
        kv_server.url, kv_server.http_url, model_name, 30, layout=layout, transport=transport
    ) as ctx:
        data = torch.randn(layout.shape(CacheKind.KV, 600)).to(torch.bfloat16)
        tokens = list(range(600))
        assert ctx.store(data.to(device), tokens)
        out = ctx.retrieve(tokens, device=device)
        assert out is not None and out.device.type == device and out.is_contiguous()
        assert torch.equal(out.cpu().view(torch.int16), data[:, :, :512].view(torch.int16))


def test_registration_is_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVDROP_CUDA_HOST_REGISTER", raising=False)
    assert not cuda_host.enabled()
    reg = HostRegistration(0, REGION_BYTES)
    assert not reg.ensure(0, 10)
    assert reg.failed == "off (KVDROP_CUDA_HOST_REGISTER=1 turns it on)"
    monkeypatch.setenv("KVDROP_CUDA_HOST_REGISTER", "1")
    assert cuda_host.enabled()


def test_a_failed_dma_sends_every_later_transfer_through_the_host(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rec = Recorder()
    reg = HostRegistration(0, 2 * REGION_BYTES, rec.register, rec.unregister)
    assert reg.ensure(0, 10)
    with caplog.at_level(logging.WARNING, logger=cuda_host.__name__):
        reg.give_up(RuntimeError("CUDA error: invalid argument"))
        reg.give_up(RuntimeError("again"))
    assert not reg.ensure(0, 10) and "invalid argument" in (reg.failed or "")
    assert len([r for r in caplog.records if "through the host" in r.getMessage()]) == 1
