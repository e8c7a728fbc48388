"""A metric curve as a line of unicode block characters (the TUI's run view)."""

from __future__ import annotations

import math
from collections.abc import Iterable

BLOCKS = "▁▂▃▄▅▆▇█"


def sparkline(values: Iterable[float | None]) -> str:
    """One block per value, scaled between the finite minimum and maximum; a space for a missing or NaN value.

    A flat series draws at mid height so it does not read as "all zeros".
    """
    vals = [v if v is not None and math.isfinite(v) else None for v in values]
    finite = [v for v in vals if v is not None]
    if not finite:
        return " " * len(vals)
    lo, hi = min(finite), max(finite)
    if hi == lo:
        return "".join(BLOCKS[len(BLOCKS) // 2 - 1] if v is not None else " " for v in vals)
    top = len(BLOCKS) - 1
    return "".join(BLOCKS[round((v - lo) / (hi - lo) * top)] if v is not None else " " for v in vals)
