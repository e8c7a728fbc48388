"""Dropping the pages of read-only file mappings from this process (madvise MADV_DONTNEED), so the torch engine's
memory stays near its largest tensor while it reads every shard through mmap. Linux only; a no-op elsewhere."""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Iterable

_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        _libc = None


def mapped_ranges(paths: set[str]) -> list[tuple[int, int]]:
    """Address ranges of this process mapped from `paths` (Linux /proc/self/maps; empty elsewhere)."""
    ranges = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].strip() in paths:
                    lo, hi = parts[0].split("-")
                    ranges.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    return ranges


def drop_ranges(ranges: list[tuple[int, int]]) -> None:
    """Drop whole read-only file mappings' pages (see release_pieces for why this is safe)."""
    if _libc is not None:
        for lo, hi in ranges:
            _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)


def release_pieces(pieces: Iterable, ranges: list[tuple[int, int]]) -> None:
    """Drop the pages of a tensor's source `pieces` (torch tensors) from this process. Only pages inside a mapping
    of a shard file are touched: those are clean pages of a private read-only-used mapping, and touching them again
    simply re-reads the file (on anonymous memory MADV_DONTNEED would zero data, so nothing else is ever passed).
    Without this the mapped pages of every shard stay resident and RSS grows to the model's size."""
    if _libc is None or not ranges:
        return
    for p in pieces:
        try:
            storage = p.untyped_storage()
            ptr, n = storage.data_ptr(), storage.nbytes()
        except Exception:  # noqa: BLE001 - best effort: memory accounting only
            continue
        lo, hi = -(-ptr // _PAGE) * _PAGE, (ptr + n) // _PAGE * _PAGE  # whole pages inside the piece
        for mlo, mhi in ranges:
            a, b = max(lo, mlo), min(hi, mhi)
            if b > a:
                _libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), _MADV_DONTNEED)
