"""Memory for what the CPU kernels stream every step (the weights, the KV cache) in
transparent huge pages.

A decode step reads every weight once: hundreds of megabytes through 4 KiB pages is a TLB
miss and a page walk every 4 KiB, and the hardware prefetchers stop at each page's end.
torch's CPU allocator asks for huge pages only where THP_MEM_ALLOC_ENABLE is set before
torch is imported, and only for allocations of 2 MiB or more (a small model's layers are
a few hundred KiB each), and Linux's default THP mode ("madvise") gives them to no one who
does not ask. So `gather` copies a model's weights into one anonymous mapping, 2 MiB
aligned and marked MADV_HUGEPAGE, in the order a step reads them, and `zeros` allocates
the KV cache the same way.

Measured on a 2-core Zen 5 VM (THP "madvise"): SmolLM2-135M's 30 layers of bf16 linears,
213 MB streamed at one row, 5.15 ms as separate tensors in 4 KiB pages, 4.69 in one mapping
of them, 3.71 in one huge-page mapping; benchmarks/hardware_limits.py's read rate 70 -> 76
GB/s with torch's own huge pages (docs/benchmarks.md, 2026-11-29).

Where the kernel offers no THP (mode "never", or built without it) the mapping is plain
memory, and `huge_pages()` says so (`pagedserve info`).

The KV cache, gigabytes the first steps do not touch, is faulted in behind the start
(`zeros(..., background=True)`): MADV_POPULATE_WRITE backs a range as a write would, without
writing, so a thread can run it while the engine already writes its first pages. The
bundled model's 4 GiB took 2.5-11 s to touch at startup on a 2-core VM, most of it the
kernel finding and clearing 2,048 huge pages.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import sys
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
# Each tensor's offset in a gathered mapping: a cache line, as the kernels' vector loads like.
ALIGN = 64
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# madvise(2): fault a range in writable, its contents untouched (Linux 5.14 and later).
MADV_POPULATE_WRITE = 23
POPULATE_CHUNK = 64 << 20
_populating: list[threading.Thread] = []


@functools.cache
def huge_pages() -> str:
    """Whether mappings from here get huge pages: "madvise" or "always" (they do), "never",
    or "unavailable" (no THP in this kernel, or not Linux)."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return "unavailable"
    try:
        text = THP_MODE.read_text()
    except OSError:
        return "unavailable"
    chosen = [word[1:-1] for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else "unavailable"


def zeros(nbytes: int, background: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` zeros, starting on a 2 MiB boundary of an anonymous
    mapping marked MADV_HUGEPAGE where the kernel takes that. The mapping lives as long
    as any tensor viewing it. `background`: return once the first POPULATE_CHUNK bytes
    are in, and fault in the rest on a thread of low priority (wait_populated waits for
    it), where the kernel has MADV_POPULATE_WRITE; else all of it now."""
    if nbytes <= 0:
        return torch.zeros(0, dtype=torch.uint8)
    # Private (a shared anonymous mapping is shmem, whose huge pages are another switch).
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` alive
    offset = -whole.data_ptr() % HUGE_PAGE
    if huge_pages() in ("madvise", "always"):
        # The kernel backs the mapping's whole 2 MiB ranges with huge pages as they are
        # first touched. madvise fails only where it has no THP at all, which huge_pages()
        # has ruled out.
        region.madvise(mmap.MADV_HUGEPAGE)
    view = whole[offset : offset + nbytes]
    first = min(nbytes, POPULATE_CHUNK)
    if background and _populate(view.data_ptr(), first) == 0:
        if first < nbytes:
            thread = threading.Thread(
                target=_populate_rest, args=(view, first), name="populate", daemon=True
            )
            thread.start()
            _populating.append(thread)
        return view
    # Touched by a write now, as torch.zeros would: a range first touched by a read maps
    # the shared zero page, and the write after it splits the range into 4 KiB pages.
    return view.zero_()


def _populate(address: int, length: int) -> int:
    """madvise(MADV_POPULATE_WRITE) over the range: 0, or the errno (EINVAL where the
    kernel lacks it, ENOMEM where it could not back the range). ctypes lets go of the GIL
    for the call."""
    if not sys.platform.startswith("linux"):
        return -1
    libc = ctypes.CDLL(None, use_errno=True)
    done = libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_POPULATE_WRITE)
    return 0 if done == 0 else ctypes.get_errno()


def _populate_rest(view: torch.Tensor, start: int) -> None:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # after the engine's work
    begin, nbytes = time.monotonic(), view.numel()
    for offset in range(start, nbytes, POPULATE_CHUNK):
        error = _populate(view.data_ptr() + offset, min(POPULATE_CHUNK, nbytes - offset))
        if error:
            logger.warning(
                "a %.1f GiB mapping (THP %s): faulting it in stopped at %.1f GiB: %s",
                nbytes / 2**30, huge_pages(), offset / 2**30, os.strerror(error),
            )  # fmt: skip
            return
    logger.info(
        "a %.1f GiB mapping (THP %s) faulted in, behind the start, in %.1f s",
        nbytes / 2**30, huge_pages(), time.monotonic() - begin,
    )  # fmt: skip


def wait_populated(timeout: float | None = None) -> bool:
    """Waits for the background population of every `zeros(..., background=True)` so far;
    whether all of it ended within `timeout` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for thread in list(_populating):
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            return False
        _populating.remove(thread)
    return True


def gather(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of CPU `tensors`, in order, side by side in one `zeros` mapping,
    each starting on an ALIGN-byte boundary; the same shapes, dtypes and values."""
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    arena = zeros(end)
    copies = []
    for t, offset in zip(tensors, offsets, strict=True):
        nbytes = t.numel() * t.element_size()
        copy = arena[offset : offset + nbytes].view(t.dtype).view(t.shape)
        copies.append(copy.copy_(t))
    return copies
