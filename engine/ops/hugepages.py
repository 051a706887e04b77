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

A mapping is faulted in before zeros() returns, with MADV_POPULATE_WRITE where the kernel
has it (Linux 5.14 and later): it backs the range as a write would, from pages the kernel
has cleared, without writing them again from here, in 64 MiB chunks on as many threads as
torch's: on a 2-core VM the bundled model's 4 GiB KV cache took 0.3-11.1 s on one thread
and 0.2-1.5 on two (the hypervisor backs the pages as they fault; its speed swings from
run to run). It was once faulted in behind the engine's start on a low-priority thread:
the server was ready about 4 s sooner, but served 20-25% slower until the thread ended,
16 s and more after ready on a 2-core VM (see docs/benchmarks.md, 2026-12-07).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
# Each tensor's offset in a gathered mapping: a cache line, as the kernels' vector loads like.
ALIGN = 64
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# madvise(2): fault a range in writable, its contents untouched (Linux 5.14 and later).
MADV_POPULATE_WRITE = 23
# Bytes faulted in per madvise call.
POPULATE_CHUNK = 64 << 20


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


def zeros(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` zeros, starting on a 2 MiB boundary of an anonymous
    mapping marked MADV_HUGEPAGE where the kernel takes that, every page of it in. The
    mapping lives as long as any tensor viewing it."""
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
    address = view.data_ptr()
    chunks = [(b, min(POPULATE_CHUNK, nbytes - b)) for b in range(0, nbytes, POPULATE_CHUNK)]
    # The first chunk here, to learn whether the kernel has the advice; the rest on as many
    # threads as torch's (each madvise lets go of the GIL).
    first = _populate(address, chunks[0][1])
    errors = [first] * len(chunks)
    if first == 0 and len(chunks) > 1:
        workers = min(torch.get_num_threads(), len(chunks) - 1)
        with ThreadPoolExecutor(workers, thread_name_prefix="populate") as pool:
            errors[1:] = pool.map(lambda chunk: _populate(address + chunk[0], chunk[1]), chunks[1:])
    if errno.ENOMEM in errors:  # the kernel could not back a range
        raise MemoryError(f"faulting in {nbytes / 2**30:.1f} GiB: {os.strerror(errno.ENOMEM)}")
    for (begin, length), error in zip(chunks, errors, strict=True):
        if error != 0:
            # No MADV_POPULATE_WRITE (EINVAL: a kernel before 5.14; not Linux): touched by
            # a write, as torch.zeros would (a range first touched by a read maps the shared
            # zero page, and the write after it splits the range into 4 KiB pages).
            view[begin : begin + length].zero_()
    return view


def _populate(address: int, length: int) -> int:
    """madvise(MADV_POPULATE_WRITE) over the range: 0, or the errno (EINVAL where the
    kernel lacks it, ENOMEM where it could not back the range). ctypes lets go of the GIL
    for the call."""
    if not sys.platform.startswith("linux"):
        return -1
    libc = ctypes.CDLL(None, use_errno=True)
    done = libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_POPULATE_WRITE)
    return 0 if done == 0 else ctypes.get_errno()


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
