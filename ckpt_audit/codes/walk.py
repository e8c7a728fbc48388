"""The walk over a root: what it finds or cannot follow, on a local disk or in an object store
(scan/walk.py, ckpt_audit.remote).

One entry per code, in docs/codes.md's order.
"""

from __future__ import annotations

from ckpt_audit.codes.entry import INFO, Code, E, W

TABLE: tuple[Code, ...] = (
    # the walk
    Code(
        code="no-runs",
        severity=W,
        explanation="a root holds no checkpoint run that any layout recognises (wrong path, or an unmounted disk)",
    ),
    Code(
        code="symlink-outside-root",
        severity=W,
        explanation="a symbolic link points outside the scanned root; not followed",
    ),
    Code(
        code="symlink-loop",
        severity=W,
        explanation="a symbolic link leads back to a directory already being walked; not followed again",
    ),
    Code(code="broken-symlink", severity=W, explanation="a symbolic link whose target does not exist"),
    # object stores (ckpt_audit.remote, docs/remote.md)
    Code(
        code="remote-checksum-mismatch",
        severity=E,
        explanation="an object's size or store checksum differs from the catalogued local copy of the same file",
        corrupts=True,
    ),
    Code(
        code="remote-unverified",
        severity=W,
        explanation="an object judged by listing alone (no catalogued checksum, or only a composite one): its "
        "checkpoint is unknown until --read-data reads it",
    ),
    Code(
        code="upload-in-progress",
        severity=W,
        explanation="a multipart upload under the prefix was begun and not completed: its checkpoint is unknown",
    ),
    Code(
        code="prune-leftover",
        severity=INFO,
        explanation=(
            "an interrupted prune left an entry renamed to .ckpt-audit-trash-*: it is not a checkpoint any more, is"
            " not hashed, and the next prune deletes it"
        ),
    ),
    Code(
        code="non-utf8-name",
        severity=W,
        explanation="a file or directory name is not valid UTF-8; it is reported but not catalogued",
    ),
)
