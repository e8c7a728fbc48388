"""Units, read and written: durations (90m, 36h, 7d, 2w) and sizes (500MB, 5GB, 50GiB) as flags take them, and
sizes and ages as reports and the TUI print them. One owner, so that `prune --keep-within`, `scan --scrub-period`,
`scan --scrub-budget` and `export --max-shard-size` read alike, and the CLI and the TUI print alike."""

from __future__ import annotations

import re
import time

NS_PER_S = 1_000_000_000

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400, None: 1}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)


def parse_duration(text: str) -> int:
    """'90m', '36h', '7d', '2w', '0s' or plain seconds -> nanoseconds. Raises ValueError."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90m, 36h, 7d, 2w)")
    return int(float(m.group(1)) * _UNIT_S[m.group(2)] * NS_PER_S)


def format_duration(ns: int) -> str:
    s = ns / NS_PER_S
    for unit, size in (("w", 7 * 86400), ("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size and s % size == 0:
            return f"{int(s // size)}{unit}"
    return f"{s:g}s"


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1000' -> bytes (decimal units as transformers reads them; *iB binary). ValueError."""
    m = _SIZE.fullmatch(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 500MB, 5GB, 50GiB)")
    unit = (m.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    return int(float(m.group(1)) * base**power)


def format_size(n: int) -> str:
    """Bytes for a person, binary units: '512 B', '1.5 KiB', '3.2 GiB' (scan, prune, export and the TUI)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def format_age(then_ns: int | None, now_ns: int) -> str:
    """How long before `now_ns` `then_ns` was, floored to its largest unit: '3d', '5h', '12m', '40s'; '-' when
    unknown (None or 0). Coarse for a table column; `format_duration` is the exact form a flag reads back."""
    if not then_ns:
        return "-"
    s = max(0, (now_ns - then_ns) // NS_PER_S)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def format_ago(then_ns: int | None, now_ns: int) -> str:
    """When content was last read in full: '3h ago', or 'never' (None: the catalog never read it whole)."""
    return "never" if then_ns is None else f"{format_age(then_ns, now_ns)} ago"


def format_utc(ns: int) -> str:
    """A clock time for a log line: '2026-12-04T19:31:02Z' (UTC, to the second)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ns // NS_PER_S))
