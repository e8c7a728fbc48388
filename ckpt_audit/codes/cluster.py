"""`scan --ray`: where ranks and replicas sit across nodes (ckpt_audit.cluster).

One entry per code, in docs/codes.md's order.
"""

from __future__ import annotations

from ckpt_audit.codes.entry import INFO, Code, E, W

TABLE: tuple[Code, ...] = (
    # scan --ray (ckpt_audit.cluster): node-local placement
    Code(
        code="ranks-spread-over-nodes",
        severity=INFO,
        explanation="no one node holds all of a checkpoint's ranks (normal for node-local saves); export and a "
        "single-node resume need them gathered first",
    ),
    Code(
        code="replica-differs",
        severity=E,
        explanation="the same file (or tracker) is on several nodes with different content: which one a resume loads "
        "is chance; a conflict, not corruption: the checkpoint is unknown when every file is whole on some node, and "
        "prune keeps it",
    ),
    Code(
        code="node-silent",
        severity=W,
        explanation="a Ray node did not answer the scan: checkpoints it may complete are unknown, not incomplete",
    ),
    Code(
        code="node-gone",
        severity=W,
        explanation=(
            "a Ray node silent for longer than --node-gone-after held the only catalogued copies of some of this "
            "checkpoint's files: unknown (prune keeps it) until the node answers or the files are found elsewhere"
        ),
    ),
)
