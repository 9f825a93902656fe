"""Flat buffers on transparent huge pages (CPU, Linux).

Every pass of a step streams whole flat buffers, hundreds of MiB for a large model. With 4 KiB pages such a stream
needs a new address translation every 4 KiB, and the pass that only reads (the energies) waits on them most; a 2 MiB
page needs one translation where 4 KiB pages need 512. So the flat buffers of a CPU bucket are advised onto
transparent huge pages (``madvise(MADV_HUGEPAGE)``) before they are first written, which is when the kernel gives a
region its pages.

It is advice: where the kernel has no transparent huge pages, has them switched off (``never`` in
``/sys/kernel/mm/transparent_hugepage/enabled``) or has no free 2 MiB page at hand, the buffer gets 4 KiB pages and
every value is the same.
"""

from __future__ import annotations

import ctypes
import sys

import torch

#: the size of a transparent huge page on x86-64 and (with 4 KiB base pages) aarch64
HUGE_PAGE = 2 * 2**20
#: ``MADV_HUGEPAGE`` of Linux's ``<sys/mman.h>``
MADV_HUGEPAGE = 14


def _libc_madvise():
    """libc's ``madvise``, None off Linux or where the C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _libc_madvise()


def huge_page_setting() -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise`` or ``never``: which regions get huge pages;
    ``madvise`` or ``always`` honour :func:`advise_huge_pages`), None where it has none."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            words = f.read().split()
    except OSError:
        return None
    return next((w[1:-1] for w in words if w.startswith("[")), None)


def huge_page_range(address: int, nbytes: int) -> tuple[int, int] | None:
    """The whole huge pages inside ``[address, address + nbytes)``: their first address and length, None if none."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    return (start, end - start) if end > start else None


def advise_huge_pages(buffer: torch.Tensor) -> bool:
    """Advise the whole huge pages inside ``buffer``'s memory onto transparent huge pages; True if advised. Only pages
    not yet written get them at once, so call it on a buffer fresh from :func:`torch.empty`."""
    if _madvise is None or buffer.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    span = huge_page_range(buffer.data_ptr(), buffer.nbytes)
    return span is not None and _madvise(span[0], span[1], MADV_HUGEPAGE) == 0


def flat_empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised flat buffer, on transparent huge pages where :func:`advise_huge_pages` can have them."""
    buffer = torch.empty(numel, dtype=dtype, device=device)
    advise_huge_pages(buffer)
    return buffer


def flat_zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of zeros, advised as :func:`flat_empty`'s before the zeros are written."""
    return flat_empty(numel, dtype, device).zero_()
