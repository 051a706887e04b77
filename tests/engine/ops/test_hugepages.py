"""engine/ops/hugepages.py: zeroed huge-page mappings, and tensors gathered into one."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest
import torch

from engine.ops import hugepages


def test_zeros_are_zeros_on_a_huge_page_boundary() -> None:
    t = hugepages.zeros(3 * hugepages.HUGE_PAGE + 5)
    assert t.dtype == torch.uint8 and t.numel() == 3 * hugepages.HUGE_PAGE + 5
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    assert int(t.count_nonzero()) == 0
    t.fill_(7)  # writable, and each call's memory its own
    assert int(hugepages.zeros(64).count_nonzero()) == 0


def test_a_view_keeps_the_mapping_alive() -> None:
    view = hugepages.zeros(1 << 20)[4096:8192].view(torch.float32)
    view.fill_(1.5)
    assert float(view.sum()) == 1.5 * 1024


def anon_huge_kb(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping holding t's first byte (/proc/self/smaps)."""
    return mapping_field(t, "AnonHugePages:")


def resident_kb(t: torch.Tensor) -> int:
    """Rss of the mapping holding t's first byte."""
    return mapping_field(t, "Rss:")


def mapping_field(t: torch.Tensor, field: str) -> int:
    """A field of /proc/self/smaps, in kB, for the mapping holding t's first byte."""
    address, inside = t.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == field:
            return int(line.split()[1])
    raise AssertionError("no mapping holds the tensor")


@pytest.mark.skipif(
    hugepages.huge_pages() not in ("madvise", "always"), reason="this kernel gives no THP"
)
def test_the_memory_is_in_huge_pages() -> None:
    t = hugepages.zeros(8 * hugepages.HUGE_PAGE)
    assert anon_huge_kb(t) >= 2048  # at least one 2 MiB page of the eight


@pytest.mark.parametrize(
    ("text", "mode"),
    [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
     ("always madvise [never]", "never"), ("", "unavailable")],
)  # fmt: skip
def test_the_thp_mode_is_read_from_sysfs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, mode: str
) -> None:
    path = tmp_path / "enabled"
    path.write_text(text)
    monkeypatch.setattr(hugepages, "THP_MODE", path)
    hugepages.huge_pages.cache_clear()
    try:
        assert hugepages.huge_pages() == mode
    finally:
        hugepages.huge_pages.cache_clear()


def test_gather_copies_each_tensor_side_by_side() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, 5, generator=g),
        torch.randint(0, 255, (1000,), dtype=torch.uint8, generator=g),
        torch.randn(96, 70, generator=g).bfloat16().t(),  # not contiguous
        torch.empty(0, dtype=torch.float16),
        torch.randint(-8, 8, (4, 33), dtype=torch.int8, generator=g),
    ]
    copies = hugepages.gather(tensors)
    base = copies[0].data_ptr()
    assert base % hugepages.HUGE_PAGE == 0
    for t, c in zip(tensors, copies, strict=True):
        assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous()
        assert torch.equal(c, t)
        assert c.numel() == 0 or c.data_ptr() % hugepages.ALIGN == 0
    # One mapping, in order: each copy begins after the one before it ends (an empty
    # tensor has no address).
    held = [c for c in copies if c.numel()]
    ends = [c.data_ptr() + c.numel() * c.element_size() for c in held]
    starts = [c.data_ptr() for c in held]
    assert all(start >= end for start, end in zip(starts[1:], ends, strict=False))
    assert starts[-1] - base < 1 << 20


def test_zeros_are_in_and_zero_when_they_return() -> None:
    """Every page faulted in (MADV_POPULATE_WRITE, in chunks, the last one short), and
    every byte zero."""
    nbytes = 3 * hugepages.POPULATE_CHUNK + 12345
    t = hugepages.zeros(nbytes)
    assert t.numel() == nbytes and t.data_ptr() % hugepages.HUGE_PAGE == 0
    assert resident_kb(t) * 1024 >= nbytes
    assert int(t.count_nonzero()) == 0


def test_without_the_kernels_populate_zeros_are_written(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hugepages, "MADV_POPULATE_WRITE", 0x7FFF)  # an advice no kernel has
    assert hugepages._populate(hugepages.zeros(4096).data_ptr(), 4096) == errno.EINVAL
    nbytes = 2 * hugepages.POPULATE_CHUNK
    t = hugepages.zeros(nbytes)
    assert resident_kb(t) * 1024 >= nbytes and int(t.count_nonzero()) == 0


def test_a_range_the_kernel_cannot_back_is_a_memory_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hugepages, "_populate", lambda address, length: errno.ENOMEM)
    with pytest.raises(MemoryError, match=r"faulting in 0\.1 GiB: Cannot allocate memory"):
        hugepages.zeros(hugepages.POPULATE_CHUNK + 4096)


def test_chunks_fault_in_on_torchs_threads_each_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first chunk on the calling thread, the rest two at once (torch's two threads);
    a later chunk the kernel refuses is written instead."""
    calls: list[tuple[int, int]] = []
    lock = threading.Lock()
    both = threading.Barrier(2, timeout=30)
    real = hugepages._populate

    def populate(address: int, length: int) -> int:
        with lock:
            calls.append((address, length))
            nth = len(calls)
        if nth > 1:
            both.wait()  # breaks (and fails the test) unless two chunks run at once
        return errno.EINVAL if nth == 3 else real(address, length)

    monkeypatch.setattr(hugepages, "_populate", populate)
    monkeypatch.setattr(hugepages, "POPULATE_CHUNK", 4 * hugepages.HUGE_PAGE)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        t = hugepages.zeros(4 * hugepages.POPULATE_CHUNK + 4096)
    finally:
        torch.set_num_threads(threads)
    base = t.data_ptr()
    assert sorted((a - base, n) for a, n in calls) == [
        (0, hugepages.POPULATE_CHUNK),
        (hugepages.POPULATE_CHUNK, hugepages.POPULATE_CHUNK),
        (2 * hugepages.POPULATE_CHUNK, hugepages.POPULATE_CHUNK),
        (3 * hugepages.POPULATE_CHUNK, hugepages.POPULATE_CHUNK),
        (4 * hugepages.POPULATE_CHUNK, 4096),
    ]
    assert resident_kb(t) * 1024 >= t.numel() and int(t.count_nonzero()) == 0
