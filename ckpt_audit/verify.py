"""verify(): scan, then the deep checks each layout names for its checkpoints (`Layout.deep_checks`).

`verify(paths)` = `scan.scan(...)` + `deepen(result)`. `deepen` runs each component's checks (deep.check: chosen by
its Component.layout) and each checkpoint's own (by its run's layout), attaches the findings to what they concern,
compares each checkpoint with the run's previous one where a check asks to (`Deep.since`), and re-derives statuses.
It knows no format: the layouts name the checks, and the checks in `deep/` know the files. This is the one place that
knows both the scan and the deep checks (the scanner never calls back up here); torch is imported only below it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from ckpt_audit.codes import CODES, NAMED_BY_VERIFY, UNREAD_CODES
from ckpt_audit.deep.check import Deep, component_checks, step_checks
from ckpt_audit.models import IN_PROGRESS_WINDOW_S, Checkpoint, Finding, ScanResult, Severity, Status
from ckpt_audit.readers.pool import map_unordered
from ckpt_audit.rules import status as status_rules
from ckpt_audit.scan import scan
from ckpt_audit.scan.scrub import ScrubPolicy

Progress = Callable[[int, int], None]


def verify(
    paths: Sequence[str | Path],
    *,
    workers: int = 2,
    rehash: bool = False,
    progress: Progress | None = None,
    previous: Mapping | None = None,
    in_progress_window_s: float = IN_PROGRESS_WINDOW_S,
    scrub: ScrubPolicy | None = None,
) -> ScanResult:
    """Scan `paths` (step directories, runs or roots) and add the deep findings. Raises scan.ScanError."""
    result = scan(
        paths,
        workers=workers,
        rehash=rehash,
        previous=previous,
        progress=None,
        in_progress_window_s=in_progress_window_s,
        scrub=scrub,
    )
    result = deepen(result, workers=workers, progress=progress)
    return replace(result, deep=True, finished_ns=time.time_ns())


# -- deepen ---------------------------------------------------------------------------------------------------


def deepen(result: ScanResult, *, workers: int = 2, progress: Progress | None = None) -> ScanResult:
    """The result with deep findings attached and statuses re-derived."""
    # each run's checkpoints in step order, so a checkpoint's predecessor is done about when it is (Deep.since
    # compares the two) and only the results of the last few are held at a time
    jobs = [
        (ri, ci)
        for ri, run in enumerate(result.runs)
        for ci in sorted(range(len(run.checkpoints)), key=lambda i: run.checkpoints[i].step)
    ]
    total = len(jobs)
    done = 0
    runs = [list(r.checkpoints) for r in result.runs]
    ready: dict[tuple[int, int], Kept] = {}
    order: dict[int, deque[tuple[int, int]]] = {ri: deque() for ri in range(len(runs))}
    for j in jobs:
        order[j[0]].append(j)
    last: dict[int, dict[tuple[str, str], tuple[str, Deep]]] = {ri: {} for ri in range(len(runs))}
    for (ri, ci), (ckpt, kept) in map_unordered(
        lambda j: _deepen(result.runs[j[0]].checkpoints[j[1]], result.runs[j[0]].layout),
        jobs,
        workers=workers,
        name="ckpt-verify",
    ):
        runs[ri][ci] = ckpt
        ready[(ri, ci)] = kept
        while order[ri] and order[ri][0] in ready:  # the next checkpoint in step order is done: compare it
            _, cj = order[ri].popleft()
            runs[ri][cj] = _against_previous(runs[ri][cj], ready.pop((ri, cj)), last[ri])
        done += 1
        if progress is not None:
            progress(done, total)
    found = {  # a verdict on files being written describes nothing to keep
        ckpt.path: deep_only(ckpt, before=result.runs[ri].checkpoints[ci])
        for ri, ci in jobs
        if (ckpt := runs[ri][ci]).status is not Status.IN_PROGRESS
    }
    return replace(
        result,
        runs=tuple(replace(r, checkpoints=tuple(runs[i])) for i, r in enumerate(result.runs)),
        deep=True,
        deep_found=found,
    )


def deep_only(ckpt: Checkpoint, *, before: Checkpoint) -> tuple[Finding, ...]:
    """What the deep checks found beyond the scan: the verdict later scans keep (rules.deep_verdict). A file the
    deep checks could not read is no verdict on its bytes: the next scan reads it for itself."""
    had = set(before.all_findings)
    return tuple(f for f in ckpt.all_findings if f not in had and f.code not in UNREAD_CODES)


# what a checkpoint's checks keep for the next checkpoint's comparison: (role, check name) -> result
Kept = dict[tuple[str, str], Deep]


def _deepen(ckpt: Checkpoint, run_layout: str) -> tuple[Checkpoint, Kept]:
    """The checkpoint with its deep findings, and what its checks keep for the next checkpoint's comparison."""
    if ckpt.status is Status.HUSK and not ckpt.components:
        return ckpt, {}
    bad = _bad_paths(ckpt)
    comps = []
    kept: Kept = {}
    for comp in ckpt.components:
        found: list[Finding] = []
        for name, check in component_checks(comp.layout):
            res = check(ckpt, comp, bad)
            found.extend(res.findings)
            if res.since is not None:
                kept[(comp.role, name)] = res
        comps.append(replace(comp, findings=comp.findings + _new(comp.findings, found)))
    # .safetensors headers are not read again here: verify's own scan judges afresh and checked each one just now
    step_found = [f for check in step_checks(run_layout) for f in check(ckpt, bad)]
    out = replace(ckpt, components=tuple(comps), findings=ckpt.findings + _new(ckpt.findings, step_found))
    return rejudge(out, before=ckpt), kept


def _against_previous(ckpt: Checkpoint, kept: Kept, last: dict[tuple[str, str], tuple[str, Deep]]) -> Checkpoint:
    """Findings of each kept result against the previous checkpoint's of the same role and check (`last`, updated)."""
    comps = []
    for comp in ckpt.components:
        found: list[Finding] = []
        for key, res in kept.items():
            if key[0] != comp.role:
                continue
            if key in last and res.since is not None:
                name, prev = last[key]
                found.extend(res.since(prev, name))
            last[key] = (Path(ckpt.path).name, res)
        comps.append(replace(comp, findings=comp.findings + _new(comp.findings, found)))
    out = replace(ckpt, components=tuple(comps))
    return rejudge(out, before=ckpt) if out != ckpt else ckpt


def _new(existing: Sequence[Finding], found: Sequence[Finding]) -> tuple[Finding, ...]:
    """Deep findings the scan has not already made (the scanner flags unsafe pickles too)."""
    have = {(f.code, f.path) for f in existing}
    out, seen = [], set()
    for f in found:
        key = (f.code, f.path, f.rank, f.tensor, f.message)
        named = f.code in NAMED_BY_VERIFY and f.tensor is not None
        if ((f.code, f.path) in have and not named) or key in seen:
            continue
        seen.add(key)
        out.append(f)
    return tuple(out)


def _bad_paths(ckpt: Checkpoint) -> set[str]:
    """Files the scan already found broken beyond loading: not opened again."""
    return {f.path for f in ckpt.all_findings if f.code in CODES and CODES[f.code].corrupts}


def rejudge(ckpt: Checkpoint, *, before: Checkpoint) -> Checkpoint:
    """Status after deep findings, in the scan's order (rules.status.PRECEDENCE): a deep error can only make a
    checkpoint worse (complete -> incomplete, unsafe or corrupt), never better."""
    if ckpt.status is Status.IN_PROGRESS:
        soft = lambda fs: tuple(replace(f, severity=Severity.INFO) if f.severity > Severity.INFO else f for f in fs)  # noqa: E731
        return replace(
            ckpt,
            findings=soft(ckpt.findings),
            components=tuple(replace(c, findings=soft(c.findings)) for c in ckpt.components),
        )
    added = set(ckpt.all_findings) - set(before.all_findings)
    errors = [f for f in added if f.severity is Severity.ERROR]
    if not errors:
        return ckpt
    return replace(ckpt, status=status_rules.worst(ckpt.status, status_rules.from_errors(errors)))
