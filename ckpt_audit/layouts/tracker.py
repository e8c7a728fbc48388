"""Trackers: the file a run's resume reads to find its checkpoint (`Tracker`, each run layout's `Layout.tracker`),
and verl's `latest_checkpointed_iteration.txt`: the one place that knows its name, where it sits and how it parses.

verl (and Megatron) write the step of the last finished save into `<run>/latest_checkpointed_iteration.txt` and
resume with `int(f.read().decode())` (docs/verl-format.md §1.2, §4). Everything else that names, reads or
writes the tracker (the scan's rules, prune's re-check, export's guard, the CLI) imports it from here; a command
that rewrites the tracker should add its writer here too. No IO: callers read the bytes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ckpt_audit.codes import finding
from ckpt_audit.models import MAX_STEP, Checkpoint, Finding
from ckpt_audit.rules.deepspeed import read_latest

TRACKER = "latest_checkpointed_iteration.txt"

_STEP = re.compile(r"\s*(\d+)\s*")


def tracker_path(run_dir: str) -> str:
    """Where a run's tracker is."""
    return f"{run_dir.rstrip('/')}/{TRACKER}"


def content_for(step: int) -> bytes:
    """What verl writes: the decimal step, no newline."""
    return str(step).encode()


def _any_name(name: str, step: int) -> bool:
    return True


def _no_entry(name: str) -> bool:
    return False


@dataclass(frozen=True, slots=True, kw_only=True)
class Tracker:
    """The file a run layout's resume reads to find its checkpoint: what fix-tracker reads and writes, what `latest
    --print tag` may answer, what the cluster compares between nodes. Pure: callers read the bytes, list the dirs."""

    file: str  # its name in the run directory
    # it names a checkpoint by its directory's name, a tag the resume takes (DeepSpeed's `latest`, read stripped),
    # not by its step (verl's, read by int())
    takes_tag: bool = False
    # whether the resume opens a checkpoint directory by this name, at this step, from a tracker naming it
    resolves: Callable[[str, int], bool] = _any_name
    # the entries of the run directory that are its checkpoints (fix-tracker re-lists them before it writes): an
    # entry by a name this accepts; with takes_tag (a tag has no telling name), a directory holding a file by one
    step_entry: Callable[[str], bool] = _no_entry
    refusal: str = ""  # the layout's resume reads no tracker: why fix-tracker writes none ("" when it may)

    def path(self, run_dir: str) -> str:
        return f"{run_dir.rstrip('/')}/{self.file}"

    def named(self, text: str, checkpoints: Iterable[Checkpoint]) -> tuple[int | None, Checkpoint | None]:
        """(step a copy of the tracker holding `text` names, the checkpoint of `checkpoints` it resolves to or None).
        A tag is matched by directory name, its step is that checkpoint's."""
        if self.takes_tag:
            tag = read_latest(text)
            ckpt = next((c for c in checkpoints if os.path.basename(c.path) == tag), None)
            return (None if ckpt is None else ckpt.step), ckpt
        step = resume_step(text)
        return step, next((c for c in checkpoints if c.step == step), None)

    def render(self, ckpt_path: str, step: int) -> bytes:
        """What a fix writes to name the checkpoint at `ckpt_path`: its tag as DeepSpeed's `save_checkpoint` writes
        it (`fd.write(tag)`, no newline), else its step as verl does."""
        return os.path.basename(ckpt_path).encode() if self.takes_tag else content_for(step)


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
