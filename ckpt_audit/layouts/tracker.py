"""The tracker `latest_checkpointed_iteration.txt`: the one place that knows its name, where it sits and how it parses.

verl (and Megatron) write the step of the last finished save into `<run>/latest_checkpointed_iteration.txt` and
resume with `int(f.read().decode())` (docs/verl-format.md §1.2, §4). Everything else that names, reads or
writes the tracker (the scan's rules, prune's re-check, export's guard, the CLI) imports it from here; a command
that rewrites the tracker should add its writer here too. No IO: callers read the bytes.
"""

from __future__ import annotations

import re

from ckpt_audit.codes import finding
from ckpt_audit.models import MAX_STEP, Finding

TRACKER = "latest_checkpointed_iteration.txt"

_STEP = re.compile(r"\s*(\d+)\s*")


def tracker_path(run_dir: str) -> str:
    """Where a run's tracker is."""
    return f"{run_dir.rstrip('/')}/{TRACKER}"


def resume_step(data: bytes | str) -> int | None:
    """The step verl's `int(f.read().decode())` makes of the tracker's content, or None where that raises.

    Looser than `read_tracker` (a sign or `_` between digits still resumes): this is the question "could resume load
    step N", which a deletion must answer conservatively."""
    try:
        return int(data.decode() if isinstance(data, bytes) else data)
    except (ValueError, UnicodeDecodeError):
        return None


def read_tracker(path: str, text: str | None, *, present: bool) -> tuple[int | None, tuple[Finding, ...]]:
    """(step, findings) for the tracker's content as the scan read it: plain digits (whitespace is fine) within
    2^63-1, else `tracker-empty` / `tracker-invalid` and no step."""
    if not present or text is None:
        return None, ()
    if not text.strip():
        return None, (finding("tracker-empty", path, "tracker file is empty: resume raises ValueError"),)
    m = _STEP.fullmatch(text)
    if m is None:
        return None, (finding("tracker-invalid", path, f"tracker holds {text[:40]!r}, not a step number"),)
    step = int(m.group(1))
    if step > MAX_STEP:
        return None, (finding("tracker-invalid", path, f"tracker holds step {step}, past 2^63-1"),)
    return step, ()
