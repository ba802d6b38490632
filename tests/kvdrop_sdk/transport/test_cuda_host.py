"""DMA to and from the server's shared memory: region registration, copies split at region
boundaries, the runtime's error cleared after a failure, and the host fallback.

The CUDA runtime is replaced by a recording one that behaves as the H200's did (2026-12-02): a
copy whose host range spans two registrations is refused with "invalid argument", and a failed
call leaves its error as the last error until ``cudaGetLastError``. The real runtime runs in
benchmarks/decode_gain.py --device cuda on a GPU machine."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvdrop_sdk as sdk
from kvdrop_sdk import CacheKind, CacheLayout
from kvdrop_sdk.testing.server import ServerHandle
from kvdrop_sdk.transport import cuda_host
from kvdrop_sdk.transport.cuda_host import HostRegistration, split_at_regions

REGION = 4096  # small regions, so small pools hold many boundaries
HEADER = 4096


@pytest.fixture(autouse=True)
def small_regions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_host, "REGION_BYTES", REGION)


class RecordingRuntime:
    """A CUDA runtime on the CPU: records registrations and copies, refuses a copy that spans
    two registrations (or any copy while ``refuse_copies``), fails registrations from the
    ``fail_at``-th on, and keeps the last error until ``clear_error``."""

    def __init__(self, pool: torch.Tensor, fail_at: int | None = None) -> None:
        self.base, self.size = pool.data_ptr(), pool.numel()
        self.regions: dict[int, int] = {}  # address -> bytes
        self.unregistered: list[int] = []
        self.copies: list[tuple[int, int]] = []  # host (start, end) offsets of each copy
        self.fail_at = fail_at
        self.calls = 0
        self.refuse_copies = False
        self.last_error = 0

    def register(self, address: int, nbytes: int) -> int:
        self.calls += 1
        if self.fail_at is not None and self.calls > self.fail_at:
            self.last_error = 2  # cudaErrorMemoryAllocation
            return 2
        self.regions[address] = nbytes
        return 0

    def unregister(self, address: int) -> int:
        self.unregistered.append(address)
        del self.regions[address]
        return 0

    def clear_error(self) -> int:
        err, self.last_error = self.last_error, 0
        return err

    def _host_range(self, *tensors: torch.Tensor) -> tuple[int, int]:
        for t in tensors:
            if self.base <= t.data_ptr() < self.base + self.size:
                start = t.data_ptr() - self.base
                return start, start + t.numel() * t.element_size()
        raise AssertionError("a copy that touches no registered memory")

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        assert self.last_error == 0, "a call was made while an error was left uncleared"
        start, end = self._host_range(dst, src)
        inside = any(
            a - self.base <= start and end <= a - self.base + n for a, n in self.regions.items()
        )
        if self.refuse_copies or not inside:
            self.last_error = 1  # cudaErrorInvalidValue
            raise RuntimeError("CUDA error: invalid argument")
        self.copies.append((start, end))
        dst.copy_(src)


def layout_pool(slot_bytes: int, offsets: list[int]) -> torch.Tensor:
    """A pool holding the header and slots at ``offsets``, each slot filled with its index."""
    pool = torch.zeros(max(offsets) + slot_bytes + REGION, dtype=torch.uint8)
    for j, off in enumerate(offsets):
        pool[off : off + slot_bytes] = j + 1
    return pool


def test_a_range_is_cut_at_every_region_boundary() -> None:
    assert split_at_regions(10, 20) == [(10, 30)]
    assert split_at_regions(REGION - 5, 10) == [(REGION - 5, REGION), (REGION, REGION + 5)]
    assert split_at_regions(0, 2 * REGION) == [(0, REGION), (REGION, 2 * REGION)]
    assert split_at_regions(REGION - 1, REGION + 2) == [
        (REGION - 1, REGION),
        (REGION, 2 * REGION),
        (2 * REGION, 2 * REGION + 1),
    ]


@settings(derandomize=True, max_examples=60, deadline=None)
@given(
    slot_elems=st.integers(1, 3 * REGION // 16),
    gaps=st.lists(st.integers(0, 3), min_size=1, max_size=8),
)
def test_no_copy_spans_two_registrations_for_any_slot_layout(
    slot_elems: int, gaps: list[int]
) -> None:
    """Slots of any size (smaller or larger than a region) packed after the header, with holes:
    reads and writes move every byte, and each copy lies inside one registration."""
    lead, layers, width = 2, 2, 2  # (2, 2, c, 2) float32: 16 bytes per token
    slot_bytes = slot_elems * lead * layers * width * 4
    offsets, at = [], HEADER
    for gap in gaps:
        at += gap * slot_bytes
        offsets.append(at)
        at += slot_bytes
    pool = layout_pool(slot_bytes, offsets)
    rt = RecordingRuntime(pool)
    reg = HostRegistration(pool, rt)
    assert reg.ready(offsets, slot_bytes)
    shape = (lead, layers, slot_elems, width)
    out = reg.read(offsets, shape, torch.float32, torch.device("cpu"))
    assert out is not None and out.shape == (lead, layers, len(offsets) * slot_elems, width)
    for j in range(len(offsets)):
        piece = out[:, :, j * slot_elems : (j + 1) * slot_elems].contiguous()
        assert bool((piece.view(torch.uint8) == j + 1).all())
    parts = [torch.full(shape, float(j)) for j in range(len(offsets))]
    assert reg.write(parts, offsets)
    for j, off in enumerate(offsets):
        assert torch.equal(pool[off : off + slot_bytes].view(torch.float32).view(shape), parts[j])
    assert rt.copies and rt.last_error == 0
    reg.close()
    assert not rt.regions  # every registration undone


def test_a_keys_only_read_moves_the_first_half_of_each_slot() -> None:
    """``retrieve_keys`` to a GPU: the ``(1, L, c, W)`` read of ``(2, L, c, W)`` slots is the
    keys, the first half of each slot's bytes, through the same registration."""
    shape, c = (2, 2, 8, 2), 8
    slot_bytes = 2 * 2 * 8 * 2 * 4
    offsets = [HEADER, HEADER + 3 * slot_bytes]
    pool = layout_pool(slot_bytes, offsets)
    slots = [torch.randn(shape) for _ in offsets]
    for off, slot in zip(offsets, slots, strict=True):
        pool[off : off + slot_bytes].view(torch.float32).copy_(slot.view(-1))
    reg = HostRegistration(pool, RecordingRuntime(pool))
    assert reg.ready(offsets, slot_bytes)
    keys = reg.read(offsets, (1, *shape[1:]), torch.float32, torch.device("cpu"))
    assert keys is not None and keys.shape == (1, 2, 2 * c, 2)
    assert torch.equal(keys, torch.cat([s[:1] for s in slots], dim=2))
    reg.close()


def test_a_slot_across_a_boundary_is_copied_in_two_pieces() -> None:
    slot_bytes = 1024
    off = REGION - 256  # straddles regions 0 and 1
    pool = layout_pool(slot_bytes, [off])
    rt = RecordingRuntime(pool)
    reg = HostRegistration(pool, rt)
    assert reg.ready([off], slot_bytes)
    assert sorted(rt.regions) == [rt.base, rt.base + REGION]
    out = reg.read([off], (1, 1, 256, 1), torch.float32, torch.device("cpu"))
    assert out is not None and bool((out.view(torch.uint8) == 1).all())
    assert rt.copies == [(off, REGION), (REGION, off + slot_bytes)]
    assert reg.write([], [])  # a store whose every chunk was a duplicate: nothing to move


def test_a_refused_registration_clears_the_error_and_only_its_region_loses_dma(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A refusal (a locked-memory limit, say) sends the transfers touching that region through
    the host; regions registered before keep their DMA, and a refused one is not retried."""
    pool = torch.zeros(4 * REGION, dtype=torch.uint8)
    rt = RecordingRuntime(pool, fail_at=1)
    reg = HostRegistration(pool, rt)
    assert reg.ensure(0, 10)
    with caplog.at_level(logging.WARNING, logger=cuda_host.__name__):
        assert not reg.ensure(REGION, 10)
        assert rt.last_error == 0  # cleared: the next launch does not see it
        assert not reg.ensure(REGION + 100, 10)  # refused once, not asked again
        assert not reg.ensure(REGION - 5, 10)  # a slot across into the refused region
        assert not reg.ensure(2 * REGION, 10)
        assert reg.ensure(0, 10)  # region 0 keeps its DMA
    warnings = [r for r in caplog.records if "page-locked" in r.getMessage()]
    assert len(warnings) == 1 and "error 2" in warnings[0].getMessage()
    assert rt.calls == 3 and reg.failed is None and "error 2" in (reg.refused or "")


def test_a_failed_dma_falls_back_for_that_transfer_and_clears_the_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool = layout_pool(512, [HEADER])
    rt = RecordingRuntime(pool)
    reg = HostRegistration(pool, rt)
    assert reg.ready([HEADER], 512)
    rt.refuse_copies = True
    shape = (1, 1, 128, 1)
    with caplog.at_level(logging.WARNING, logger=cuda_host.__name__):
        assert reg.read([HEADER], shape, torch.float32, torch.device("cpu")) is None
        assert rt.last_error == 0
        assert not reg.write([torch.zeros(shape)], [HEADER])
        assert rt.last_error == 0
    assert reg.failed is None  # one bad transfer does not end DMA for the mapping
    rt.refuse_copies = False
    assert reg.read([HEADER], shape, torch.float32, torch.device("cpu")) is not None
    rt.refuse_copies = True
    for _ in range(cuda_host.MAX_DMA_FAILURES):
        reg.read([HEADER], shape, torch.float32, torch.device("cpu"))
    assert reg.failed is not None and not reg.ready([HEADER], 512)
    logged = [r.getMessage() for r in caplog.records]
    assert sum("went through the host" in m for m in logged) == 1


@pytest.mark.parametrize(
    ("value", "mode"), [(None, "on"), ("1", "on"), ("on", "on"), ("0", "off"), ("fail", "fail")]
)
def test_registration_is_on_by_default_and_the_variable_is_checked(
    monkeypatch: pytest.MonkeyPatch, value: str | None, mode: str
) -> None:
    if value is None:
        monkeypatch.delenv("KVDROP_CUDA_HOST_REGISTER", raising=False)
    else:
        monkeypatch.setenv("KVDROP_CUDA_HOST_REGISTER", value)
    assert cuda_host.register_mode() == mode
    assert cuda_host.enabled() is (mode != "off")


def test_a_bad_variable_names_the_accepted_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDROP_CUDA_HOST_REGISTER", "maybe")
    with pytest.raises(ValueError, match=r"one of on, off, fail.*'maybe'"):
        cuda_host.register_mode()
    reg = HostRegistration(torch.zeros(REGION, dtype=torch.uint8))
    assert not reg.ensure(0, 10) and "maybe" in (reg.failed or "")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only default")
def test_without_cuda_registration_is_refused_up_front(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Refused up front; silent at the default, said once per mapping when asked for
    (``KVDROP_CUDA_HOST_REGISTER=1`` on a CPU host logged nothing before)."""
    monkeypatch.delenv("KVDROP_CUDA_HOST_REGISTER", raising=False)
    with caplog.at_level(logging.WARNING, logger=cuda_host.__name__):
        reg = HostRegistration(torch.zeros(REGION, dtype=torch.uint8))
        assert not reg.ensure(0, 10) and reg.failed == "CUDA is not available"
        assert not caplog.records
        monkeypatch.setenv("KVDROP_CUDA_HOST_REGISTER", "1")
        reg = HostRegistration(torch.zeros(REGION, dtype=torch.uint8))
        assert not reg.ensure(0, 10) and not reg.ensure(0, 10)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "KVDROP_CUDA_HOST_REGISTER=1, but CUDA" in said[0], said


@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_retrieve_to_a_device_returns_the_same_bytes(
    kv_server: ServerHandle, model_name: str, transport: str
) -> None:
    """``device=`` on a CPU machine: the host path, the same bytes as without it (on a GPU the
    slots come by DMA; benchmarks/decode_gain.py --device cuda runs it there)."""
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


def test_contexts_of_one_process_share_one_mapping_of_the_segment(
    kv_server: ServerHandle, model_name: str
) -> None:
    """Page-locking is paid once per process: every context of one server shares the mapping
    (and its registration); it is unmapped when the last one closes."""
    from kvdrop_sdk.transport import contiguous

    layout = CacheLayout(3, 2, 8, torch.bfloat16)
    connect = sdk.kvcache.connect
    a = connect(kv_server.url, kv_server.http_url, model_name, 30, layout=layout, transport="shm")
    b = connect(kv_server.url, kv_server.http_url, model_name, 30, layout=layout, transport="shm")
    try:
        mapping = a.transfer_ctx._mapping
        assert mapping is not None and b.transfer_ctx._mapping is mapping and mapping.users == 2
        a.close()
        data = torch.randn(layout.shape(CacheKind.KV, 256)).to(torch.bfloat16)
        assert b.store(data, list(range(256)))  # still mapped for b
        out = b.retrieve(list(range(256)))
        assert out is not None and torch.equal(out.view(torch.int16), data.view(torch.int16))
        assert mapping.users == 1
    finally:
        a.close()
        b.close()
    assert mapping.users == 0 and mapping.key not in contiguous._SHARED


def test_concurrent_first_transfers_make_one_registration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first DMA transfers of a mapping often start at once (an engine's loads): they must
    share one registration. Two registered the same regions twice (error 712 on an H200), and
    the regions of the one that was dropped were never unregistered."""
    import threading
    import time

    from kvdrop_sdk.transport import contiguous

    made: list[HostRegistration] = []

    class SlowRegistration(HostRegistration):
        def __init__(self, pool: torch.Tensor) -> None:
            time.sleep(0.05)  # finding the CUDA runtime takes a while
            super().__init__(pool, RecordingRuntime(pool))
            made.append(self)

    monkeypatch.setattr(contiguous, "HostRegistration", SlowRegistration)
    pool = torch.zeros(4 * REGION, dtype=torch.uint8)
    mapping = contiguous._Mapping(mm=None, pool=pool, instance=None)  # type: ignore[arg-type]
    start = threading.Barrier(6)
    got: list[HostRegistration | None] = []

    def first_transfer(i: int) -> None:
        start.wait()
        got.append(mapping.dma([HEADER + i * 64], 64))

    threads = [threading.Thread(target=first_transfer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and all(g is made[0] for g in got)


def test_a_registration_in_progress_holds_up_only_the_transfers_that_need_it() -> None:
    """Registering a GiB of fresh pages takes about 0.4 s: a transfer whose regions are
    registered goes on meanwhile, and two that need the same region make one call."""
    import threading

    pool = torch.zeros(4 * REGION, dtype=torch.uint8)
    release = threading.Event()
    entered = threading.Event()

    class SlowRuntime(RecordingRuntime):
        def register(self, address: int, nbytes: int) -> int:
            if address == self.base + REGION:
                entered.set()
                assert release.wait(30)
            return super().register(address, nbytes)

    rt = SlowRuntime(pool)
    reg = HostRegistration(pool, rt)
    assert reg.ensure(0, 10)  # region 0
    results: list[bool] = []
    waiters = [
        threading.Thread(target=lambda: results.append(reg.ensure(REGION + 5, 10)))
        for _ in range(2)
    ]
    for t in waiters:
        t.start()
    assert entered.wait(30)
    assert reg.ensure(100, 10)  # region 0 is registered: no waiting behind region 1
    release.set()
    for t in waiters:
        t.join()
    assert results == [True, True] and rt.calls == 2  # region 1 was registered once
    reg.close()
    assert not rt.regions


def test_register_all_locks_every_region_once_ahead_of_the_transfers() -> None:
    pool = torch.zeros(3 * REGION + 100, dtype=torch.uint8)
    rt = RecordingRuntime(pool)
    reg = HostRegistration(pool, rt)
    assert reg.ensure(REGION + 1, 10)  # one region done already
    assert reg.register_all() and reg.register_all()  # the second call has nothing to do
    assert rt.regions == {
        rt.base: REGION,
        rt.base + REGION: REGION,
        rt.base + 2 * REGION: REGION,
        rt.base + 3 * REGION: 100,  # the short last region
    }
    assert rt.calls == 4
    refused = RecordingRuntime(pool, fail_at=2)
    assert not HostRegistration(pool, refused).register_all() and refused.last_error == 0


@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_prepare_dma_without_a_gpu_says_no_and_transfers_still_work(
    kv_server: ServerHandle, model_name: str, transport: str
) -> None:
    layout = CacheLayout(3, 2, 8, torch.bfloat16)
    with sdk.kvcache.connect(
        kv_server.url, kv_server.http_url, model_name, 30, layout=layout, transport=transport
    ) as ctx:
        assert ctx.prepare_dma() is (torch.cuda.is_available() and transport == "shm")
        data = torch.randn(layout.shape(CacheKind.KV, 256)).to(torch.bfloat16)
        assert ctx.store(data, list(range(256)))
        out = ctx.retrieve(list(range(256)))
        assert out is not None and torch.equal(out.view(torch.int16), data.view(torch.int16))
