"""Scrub: which cached files a scan re-reads by content, so that a stat-keyed cache never outlives its meaning.

A file whose size, mtime and inode are unchanged reuses its recorded hash, CRC verdict and findings; bit rot that
keeps the stat is invisible to that cache. So each scan also re-reads a rolling share of those files, oldest
verified first, sized so that every byte is re-read at least once per `period`:

    due    = every file last verified `period` or more ago;
    share  = (bytes of the reusable files) x (time since the last content read under this root) / period;
    scrub  = the oldest-verified files, in order, while the bytes taken are under `share` or the file is due,
             and (with a budget) while the bytes taken are under the budget (the last file may overshoot it).

On a daily cron with a 7-day period that is a seventh of the bytes a day; after a pause (or `--no-scrub` runs) the
share grows to catch up. A budget too small to keep the promise leaves files overdue: the scan reports them.
Files the catalog never verified by content are not scrubbed here: they are not reusable at all (always read).
Pure planning; the scanner does the reading.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import NamedTuple

DAY_NS = 86_400 * 10**9
DEFAULT_PERIOD_NS = 7 * DAY_NS


@dataclass(frozen=True, slots=True, kw_only=True)
class ScrubPolicy:
    """How much of the cache a scan re-verifies."""

    period_ns: int = DEFAULT_PERIOD_NS  # every reusable byte is re-read at least once per period (0: every scan)
    budget_bytes: int | None = None  # at most this many bytes re-read per scan, all roots together; None: no cap


class Cached(NamedTuple):
    """A file the scan could reuse from the catalog: its size and when it was last read by content. A tuple, not a
    dataclass: a scan makes one per catalogued file, and a slotted dataclass costs ~30x a tuple to build."""

    path: str
    size_bytes: int
    verified_ns: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ScrubPlan:
    paths: frozenset[str] = frozenset()
    bytes: int = 0
    overdue_files: int = 0  # left unread although last verified a period or more ago (the budget ran out)
    overdue_bytes: int = 0


def plan_scrub(
    cached: Sequence[Cached | tuple[str, int, int]], *, now_ns: int, policy: ScrubPolicy, budget_bytes: int | None
) -> ScrubPlan:
    """The files to re-read now (see the module docstring for the rule). `budget_bytes` is what is left of the
    policy's budget for this root (None: no cap). `cached` may hold plain (path, size_bytes, verified_ns) tuples:
    a re-scan passes one per catalogued file, and a NamedTuple costs ~0.5 us more each to make."""
    if not cached:
        return ScrubPlan()
    # by position, in C: the scanner passes a plain (path, size, verified) per catalogued file
    total = sum(map(itemgetter(1), cached))
    since = max(0, now_ns - max(map(itemgetter(2), cached)))
    share = total if policy.period_ns <= 0 else total * min(1.0, since / policy.period_ns)
    due_before = now_ns - policy.period_ns
    taken: list[Cached] = []
    taken_bytes = 0
    overdue_files = overdue_bytes = 0
    # oldest verified first, ties by path: a heap, as a scan usually takes a few files of many (sorting 100k paths
    # that tie on one verified_ns cost ~0.4 s; heapify is linear and each file taken costs log n)
    heap = [(c[2], c[0], c) for c in cached]
    heapq.heapify(heap)
    while heap:
        c = Cached(*heapq.heappop(heap)[2])
        due = c.verified_ns <= due_before
        if not due and taken_bytes >= share:
            break  # sorted oldest first: nothing later is due either
        if budget_bytes is not None and taken_bytes >= budget_bytes:
            if not due:
                break
            overdue_files += 1
            overdue_bytes += c.size_bytes
            continue
        taken.append(c)
        taken_bytes += c.size_bytes
    return ScrubPlan(
        paths=frozenset(c.path for c in taken),
        bytes=taken_bytes,
        overdue_files=overdue_files,
        overdue_bytes=overdue_bytes,
    )
