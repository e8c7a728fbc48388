"""`ckpt-audit export`: whether the exported model loads in transformers as written.

One entry per code, in docs/codes.md's order.
"""

from __future__ import annotations

from ckpt_audit.codes.entry import Code, E

TABLE: tuple[Code, ...] = (
    # export (ckpt_audit.export.model): is the export a model transformers loads as written?
    Code(
        code="export-no-config",
        severity=E,
        explanation="the export has no readable config.json (the step has no huggingface/): transformers cannot "
        "load it; export refuses unless --allow-unverified",
    ),
    Code(
        code="export-config-mismatch",
        severity=E,
        explanation="config.json disagrees with the exported tensors (names, shapes, dtype or tied embeddings): "
        "transformers would fail, or fill what is missing with random weights; export refuses unless "
        "--allow-unverified",
    ),
    Code(
        code="export-load-failed",
        severity=E,
        explanation="transformers' own load of the export failed, reported missing or unexpected weights, or "
        "gave tensors that differ from the exported ones; export refuses unless --allow-unverified",
    ),
)
