"""The units flags are given in: durations (90m, 36h, 7d, 2w) and sizes (500MB, 5GB, 50GiB). One owner, so that
`prune --keep-within`, `scan --scrub-period`, `scan --scrub-budget` and `export --max-shard-size` read alike."""

from __future__ import annotations

import re

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
