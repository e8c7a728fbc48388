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
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from operator import itemgetter

DAY_NS = 86_400 * 10**9
DEFAULT_PERIOD_NS = 7 * DAY_NS


@dataclass(frozen=True, slots=True, kw_only=True)
class ScrubPolicy:
    """How much of the cache a scan re-verifies."""

    period_ns: int = DEFAULT_PERIOD_NS  # every reusable byte is re-read at least once per period (0: every scan)
    budget_bytes: int | None = None  # at most this many bytes re-read per scan, all roots together; None: no cap


@dataclass(frozen=True, slots=True, kw_only=True)
class ScrubPlan:
    paths: frozenset[str] = frozenset()
    bytes: int = 0
    overdue_files: int = 0  # left unread although last verified a period or more ago (the budget ran out)
    overdue_bytes: int = 0


def plan_scrub(
    verified: Mapping[str, int],
    size_of: Callable[[str], int],
    *,
    total_bytes: int,
    now_ns: int,
    policy: ScrubPolicy,
    budget_bytes: int | None,
) -> ScrubPlan:
    """The files to re-read now (see the module docstring for the rule), of those the scan could reuse: `verified`
    maps each to when it was last read by content, `size_of` gives its size and `total_bytes` their sum (the
    caller adds it up its own faster way). `budget_bytes` is what is left of the policy's budget for this root
    (None: no cap)."""
    if not verified:
        return ScrubPlan()
    files = ((path, v, size_of(path)) for path, v in oldest_first(verified))
    return plan_ordered(
        files,
        newest_ns=max(verified.values()),
        total_bytes=total_bytes,
        now_ns=now_ns,
        policy=policy,
        budget_bytes=budget_bytes,
    )


def plan_ordered(
    files: Iterable[tuple[str, int, int]],
    *,
    newest_ns: int,
    total_bytes: int,
    now_ns: int,
    policy: ScrubPolicy,
    budget_bytes: int | None,
) -> ScrubPlan:
    """plan_scrub's rule over the files already in order: (path, verified_ns, size) oldest verified first, ties by
    path, read only as far as the rule goes (a catalog query walks them by its index: scan.reuse); `newest_ns`:
    the latest verified_ns of them all."""
    since = max(0, now_ns - newest_ns)
    share = total_bytes if policy.period_ns <= 0 else total_bytes * min(1.0, since / policy.period_ns)
    due_before = now_ns - policy.period_ns
    taken: list[str] = []
    taken_bytes = 0
    overdue_files = overdue_bytes = 0
    for path, verified_ns, size in files:
        due = verified_ns <= due_before
        if not due and taken_bytes >= share:
            break  # oldest first: nothing later is due either
        if budget_bytes is not None and taken_bytes >= budget_bytes:
            if not due:
                break
            overdue_files += 1
            overdue_bytes += size
            continue
        taken.append(path)
        taken_bytes += size
    return ScrubPlan(
        paths=frozenset(taken), bytes=taken_bytes, overdue_files=overdue_files, overdue_bytes=overdue_bytes
    )


def oldest_first(verified: Mapping[str, int]) -> Iterator[tuple[str, int]]:
    """(path, verified_ns), oldest verified first, ties by path. A scan usually takes a few files of many (a
    million at 1M files): the first few are picked in one linear pass (nsmallest), more only when asked for."""
    n, done = 64, 0
    while done < len(verified):
        head = heapq.nsmallest(n, verified.items(), key=_age)
        yield from head[done:]
        done, n = len(head), n * 16


_age = itemgetter(1, 0)  # (verified_ns, path)
