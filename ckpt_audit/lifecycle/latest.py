"""The resume gate: which checkpoint of a run a job should resume from, and why each newer one was passed over.

`ckpt-audit latest RUN` answers `trainer.resume_from_path` for a job script. Resumable means what fix-tracker
points the tracker at (`rules.save_order.resumable`): complete, or whole beyond a lagging tracker; never one whose
files are still changing under a tracker that published it early. With `verified`, the chosen checkpoint must also
have been read by content (every file's hash and CRC) within `max_age_ns` of `now_ns` (0: by this call, at or after
`now_ns`); one that was not is handed back for a re-read (`Gate.reread`) and judged again on what that read found.
Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ckpt_audit.models import Checkpoint, Run, Severity, Status
from ckpt_audit.rules.save_order import resumable


@dataclass(frozen=True, slots=True, kw_only=True)
class Passed:
    """A checkpoint newer than the answer, and why it is not the answer."""

    step: int
    path: str
    status: str
    reasons: tuple[str, ...]  # finding codes (or a status) that rule it out, most telling first
    detail: str  # one line for people

    def to_dict(self) -> dict:
        return {
            "step": self.step,
            "path": self.path,
            "status": self.status,
            "reasons": list(self.reasons),
            "detail": self.detail,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Gate:
    run_path: str
    chosen: Checkpoint | None = None
    verified_ns: int | None = None  # when the chosen checkpoint was last read by content in full
    passed_over: tuple[Passed, ...] = ()
    reread: Checkpoint | None = None  # verified wanted: re-read this one by content, then ask again
    reason: str = ""  # why there is no answer (one line), "" when there is one


def oldest_verified(ckpt: Checkpoint, verified: Mapping[str, int | None]) -> int | None:
    """When the least recently content-read file of `ckpt` was read; None if one never was (or it has none)."""
    seen = [verified.get(f.path) for f in ckpt.all_files]
    if not seen or any(v is None for v in seen):
        return None
    return min(v for v in seen if v is not None)


def why_not(ckpt: Checkpoint, run: Run) -> Passed | None:
    """Why `ckpt` cannot be resumed from, or None when it can."""
    early = ckpt.step == run.tracker_step and any(f.code == "tracker-published-early" for f in run.findings)
    if resumable(ckpt) and not early and not any(f.code in NOT_AS_IS for f in ckpt.all_findings):
        return None
    if early:
        reasons: tuple[str, ...] = ("tracker-published-early",)
        detail = "its files are still changing after the tracker published it"
    else:
        bad = [f for f in ckpt.all_findings if f.severity is Severity.ERROR or f.code in _TELLING]
        codes = tuple(dict.fromkeys(f.code for f in bad)) or (ckpt.status.value,)
        reasons = codes[:8]
        first = bad[0] if bad else None
        detail = f"{ckpt.status.value}" + (f": {first.code}: {first.message}" if first else "")
        if ckpt.status is Status.UNCOMMITTED and not bad:
            detail = "uncommitted: newer than the tracker and not whole"
    return Passed(step=ckpt.step, path=ckpt.path, status=ckpt.status.value, reasons=reasons, detail=detail)


# complete (the weights are whole, so retention counts them) but a resume from them restarts the optimizer
MODEL_ONLY = frozenset({"hf-model-only", "torchtitan-model-only"})
# complete, but the trainer refuses to resume from it as it is (verl >= 0.9.1 and the pre-v2 Megatron layout; a
# DeepSpeed universal checkpoint, which only an engine configured to load universal checkpoints opens)
NOT_AS_IS = MODEL_ONLY | {"megatron-old-layout", "ds-universal"}


def is_model_only(ckpt: Checkpoint) -> bool:
    """Whole weights without the optimizer state: a resume from it restarts the optimizer (or fails)."""
    return any(f.code in MODEL_ONLY for f in ckpt.all_findings)


def resumes_as_is(ckpt: Checkpoint) -> bool:
    """Not model only, and not a layout the trainer refuses until it is converted (retention keeps the newest such)."""
    return not any(f.code in NOT_AS_IS for f in ckpt.all_findings)


# non-error findings that explain a status by themselves
_TELLING = frozenset(
    {"in-progress", "husk", "missing-dataloader-state", "symlink-outside-root", "file-vanished", *NOT_AS_IS}
)


def gate(
    run: Run,
    *,
    verified: Mapping[str, int | None] | None = None,
    now_ns: int = 0,
    max_age_ns: int = 0,
    reread: frozenset[str] = frozenset(),
) -> Gate:
    """The newest resumable checkpoint of `run`. With `verified` (path -> last content read, ns), it must also have
    been read by content within `max_age_ns` before `now_ns`, or be in `reread` (read by content just now)."""
    passed: list[Passed] = []
    for ckpt in sorted(run.checkpoints, key=lambda c: c.step, reverse=True):
        no = why_not(ckpt, run)
        if no is not None:
            passed.append(no)
            continue
        when = oldest_verified(ckpt, verified) if verified is not None else None
        if verified is not None and ckpt.path not in reread and (when is None or now_ns - when > max_age_ns):
            return Gate(run_path=run.path, passed_over=tuple(passed), reread=ckpt)
        return Gate(run_path=run.path, chosen=ckpt, verified_ns=when, passed_over=tuple(passed))
    if not run.checkpoints:
        reason = f"no checkpoint in {run.path}"
    else:
        newest = passed[0]
        reason = f"no complete checkpoint in {run.path} (newest, step {newest.step}: {newest.detail})"
    return Gate(run_path=run.path, passed_over=tuple(passed), reason=reason)
