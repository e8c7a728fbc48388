"""The multi-node judgement, on the driver after the reduce: which node holds what, replicas that differ, and
nodes that did not answer. Pure: answers and the reduced result in, a new result out.

Copies of one logical file that differ between nodes (two jobs that wrote the same path on different node-local
disks, or a rank's file left from an earlier placement) are a conflict, not evidence of corruption: which copy a
rank loads depends on where it runs. Every such file is `replica-differs` (shards, `data.pt`, configs alike) and,
when every file of the checkpoint is whole on some node, the checkpoint is `unknown`: prune keeps it, on every
node, and the resume gate does not name it. Trackers that differ are reported on their run and on each step a
node's copy names (prune keeps those)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from ckpt_audit.codes import finding
from ckpt_audit.layouts import run_tracker
from ckpt_audit.models import Checkpoint, FileFacts, Finding, Run, ScanResult, Severity, Status
from ckpt_audit.units import format_age

from .noderoots import NodePartials


def holders(answers: Sequence[NodePartials]) -> dict[str, dict[str, FileFacts]]:
    """logical path -> {node id: that node's facts of its copy} over every node's partials."""
    out: dict[str, dict[str, FileFacts]] = defaultdict(dict)
    for a in answers:
        for part in a.partials:
            for path, facts in part.facts.items():
                out[path][a.node_id] = facts
    return dict(out)


def _whole(copy: FileFacts) -> bool:
    """Read in full with nothing wrong found: a copy a rank could load."""
    return (
        copy.hash is not None
        and copy.crc_ok is not False
        and not any(f.severity is Severity.ERROR for f in copy.findings)
    )


def _differs(copies: Mapping[str, FileFacts]) -> bool:
    return len({c.hash for c in copies.values()}) > 1


def _ranges(ranks: Sequence[int]) -> str:
    spans, start = [], None
    for r in sorted(set(ranks)):
        if start is None:
            start = prev = r
        elif r == prev + 1:
            prev = r
        else:
            spans.append((start, prev))
            start = prev = r
    if start is not None:
        spans.append((start, prev))
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _judge(
    ckpt: Checkpoint,
    held: Mapping[str, dict[str, FileFacts]],
    silent: Sequence[str],
    recalled: Mapping[str, tuple[str, ...]],
    gone: Mapping[str, int],
    now_ns: int,
) -> Checkpoint:
    found = list(ckpt.findings)
    status = ckpt.status
    for comp in ckpt.components:
        by_node: dict[str, list[int]] = defaultdict(list)
        ranks = {f.rank for f in comp.files if f.rank is not None}
        for f in comp.files:
            if f.rank is None:
                continue
            for node in held.get(f.path, {}):
                by_node[node].append(f.rank)
        if ranks and by_node and not any(set(r) >= ranks for r in by_node.values()):
            where = "; ".join(f"ranks {_ranges(r)} on node {n}" for n, r in sorted(by_node.items()))
            found.append(finding("ranks-spread-over-nodes", comp.path, where))
    differ = [f for f in ckpt.all_files if _differs(held.get(f.path, {}))]
    for f in differ:
        copies = held[f.path]
        whole = sorted(n for n, c in copies.items() if _whole(c))
        why = f"different content on nodes {', '.join(sorted(copies))}: which one a rank loads depends on its node"
        found.append(
            finding("replica-differs", f.path, why + (f" (whole on {', '.join(whole)})" if whole else ""), rank=f.rank)
        )
    if differ and all(any(_whole(c) for c in held.get(f.path, {}).values()) for f in ckpt.all_files):
        status = Status.UNKNOWN  # a conflict, not corruption: every file is whole somewhere; both copies stay
    known_only = {f.path: recalled[f.path] for f in ckpt.all_files if f.path in recalled}
    if known_only:  # some files are known only from the catalog: their only copies are on nodes that did not answer
        status = Status.UNKNOWN
        for node in sorted({n for ns in known_only.values() for n in ns}):
            files = sorted(p for p, ns in known_only.items() if node in ns)
            code, why = (
                ("node-gone", f"silent for {format_age(gone[node], now_ns)}")
                if node in gone
                else ("node-silent", "did not answer")
            )
            found.append(
                finding(
                    code,
                    ckpt.path,
                    f"{len(files)} file(s) (e.g. {files[0]}) were catalogued only on node {node}, which {why}: "
                    "unknown until it answers or the files are found elsewhere",
                )
            )
        return replace(ckpt, findings=tuple(found), status=status)
    recent = [n for n in silent if n not in gone]
    if status == Status.INCOMPLETE and recent:  # a node that may come back may hold anything: nothing is missing yet
        status = Status.UNKNOWN
        found.append(
            finding("node-silent", ckpt.path, f"node(s) {', '.join(recent)} did not answer: they may hold the rest")
        )
    return replace(ckpt, findings=tuple(found), status=status)


def judge_nodes(
    result: ScanResult,
    answers: Sequence[NodePartials],
    silent: Sequence[str],
    *,
    recalled: Mapping[str, tuple[str, ...]] | None = None,
    gone: Mapping[str, int] | None = None,
    now_ns: int = 0,
) -> ScanResult:
    """The multi-node findings. A checkpoint with files known only from the catalog (`recalled`: path -> the silent
    nodes that last held it) is unknown: node-silent, or node-gone for a node in `gone` (node -> when it was last
    known to answer: silent past the window). Else a silent node not in `gone` makes an incomplete checkpoint
    unknown (it may hold anything); a gone node no longer does."""
    held = holders(answers)
    gone = gone or {}
    recalled = recalled or {}
    runs = tuple(
        _trackers(
            replace(r, checkpoints=tuple(_judge(c, held, silent, recalled, gone, now_ns) for c in r.checkpoints)), held
        )
        for r in result.runs
    )
    extra = tuple(
        finding(
            "node-silent",
            "",
            f"node {n} did not answer the scan"
            + (f" (silent for {format_age(gone[n], now_ns)}: counted as gone)" if n in gone else ""),
        )
        for n in silent
    )
    return replace(result, runs=runs, findings=result.findings + extra)


def _trackers(run: Run, held: Mapping[str, dict[str, FileFacts]]) -> Run:
    """`run` with its tracker's copies that differ between nodes reported: on the run, and on each checkpoint some
    node's copy names (each node's ranks resume from the step their own copy names)."""
    path, step_of = _tracker_of(run)
    copies = held.get(path, {})
    if not _differs(copies):
        return run
    named = {n: step_of(c.text) if c.text is not None else None for n, c in sorted(copies.items())}
    said = "; ".join(f"node {n}: {'no step' if s is None else f'step {s}'}" for n, s in named.items())

    def told(message: str) -> Finding:
        return finding("replica-differs", path, message)

    ckpts = tuple(
        replace(c, findings=(*c.findings, told(f"the tracker differs between nodes ({said}): some resume here")))
        if c.step in named.values()
        else c
        for c in run.checkpoints
    )
    return replace(run, checkpoints=ckpts, findings=(*run.findings, told(f"the tracker differs between nodes: {said}")))


def _tracker_of(run: Run) -> tuple[str, Callable[[str], int | None]]:
    """The run's tracker file and the step a copy of it names, as its layout reads it (Layout.tracker): DeepSpeed's
    `latest` names a tag (each node's local rank 0 writes its own under use_node_local_storage), verl's tracker a
    step number."""
    tracker = run_tracker(run.layout)
    return tracker.path(run.path), lambda text: tracker.named(text, run.checkpoints)[0]
