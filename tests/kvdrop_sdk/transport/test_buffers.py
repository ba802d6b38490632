"""Transport buffers: parallel copies, the GIL-free page population of shm slots."""

from __future__ import annotations

import ctypes
import mmap
import threading
import time

import pytest
import torch

from kvdrop_sdk.transport import buffers
from kvdrop_sdk.transport.buffers import copy_threads, empty_tensor, populate_write, run_copies


def memmove_tasks(dst: torch.Tensor, src: torch.Tensor, pieces: int) -> list:
    step = src.numel() // pieces
    return [
        lambda i=i: ctypes.memmove(dst.data_ptr() + i * step, src.data_ptr() + i * step, step)
        for i in range(pieces)
    ]


@pytest.mark.parametrize("nbytes", [1 << 10, 32 << 20])  # serial and parallel paths
def test_run_copies_copies_everything(nbytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDROP_COPY_THREADS", "3")
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    run_copies(memmove_tasks(dst, src, 16), nbytes)
    assert torch.equal(dst, src)


def test_run_copies_uses_several_threads_for_large_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDROP_COPY_THREADS", "4")
    names: set[str] = set()
    lock = threading.Lock()

    def task() -> None:
        time.sleep(0.02)
        with lock:
            names.add(threading.current_thread().name)

    run_copies([task] * 8, buffers.PARALLEL_MIN_BYTES)
    assert len(names) > 1 and all(n.startswith("kvdrop-copy") for n in names)
    names.clear()
    run_copies([task] * 3, buffers.PARALLEL_MIN_BYTES - 1)  # small: on the caller's thread
    assert names == {threading.current_thread().name}


@pytest.mark.parametrize("threads", ["1", "3"])
def test_run_copies_raises_once_no_task_runs(threads: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDROP_COPY_THREADS", threads)
    running = 0
    seen_after: list[int] = []
    lock = threading.Lock()

    def slow() -> None:
        nonlocal running
        with lock:
            running += 1
        time.sleep(0.05)
        with lock:
            running -= 1

    def bad() -> None:
        raise OSError("slot gone")

    with pytest.raises(OSError, match="slot gone"):
        run_copies([slow, bad, slow, slow, slow], 1 << 30)
    seen_after.append(running)
    time.sleep(0.1)
    assert seen_after == [0] and running == 0


def test_copy_threads_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDROP_COPY_THREADS", "5")
    assert copy_threads() == 5
    monkeypatch.setenv("KVDROP_COPY_THREADS", "zero")
    assert 1 <= copy_threads() <= 16


def test_populate_faults_in_writable_pages_without_the_gil() -> None:
    size = 8 << 20
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pool = torch.frombuffer(mm, dtype=torch.uint8)
    populate_write(pool.data_ptr() + 4096 + 7, size - 8192)  # unaligned start: rounded down
    pool[4096:].fill_(3)
    assert int(pool[-1]) == 3
    del pool
    mm.close()


def test_empty_tensor_without_populate_is_usable() -> None:
    t = empty_tensor((3, 4 << 20), torch.uint8, populate=False)
    t.fill_(7)
    assert t.shape == (3, 4 << 20) and int(t.sum()) == 7 * t.numel()
