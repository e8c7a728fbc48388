"""A checkpoint's shard sets (which rank files a role directory holds) and each file's bytes: the scan's
shard-set and per-file rules (rules/shards.py, rules/files.py, readers/).

One entry per code, in docs/codes.md's order.
"""

from __future__ import annotations

from ckpt_audit.codes.entry import INFO, Code, E, W

TABLE: tuple[Code, ...] = (
    # shard sets
    Code(
        code="missing-rank",
        severity=E,
        explanation="a rank's shard file is absent: resume dies with FileNotFoundError on that rank",
    ),
    Code(
        code="world-size-mismatch",
        severity=E,
        explanation="fsdp_config.json's world_size differs from the W in the shard file names",
    ),
    Code(
        code="stale-world-size",
        severity=W,
        explanation=(
            "a second shard set with another world size sits beside the current one; it misleads the merger and a "
            "resume at that W"
        ),
    ),
    Code(
        code="missing-model",
        severity=E,
        explanation="a role directory has optimizer or extra-state shards but no model shards",
    ),
    Code(
        code="missing-optimizer",
        severity=E,
        explanation="model shards without any optimizer shards: resume cannot restore the optimizer",
    ),
    Code(
        code="missing-extra-state",
        severity=E,
        explanation="model shards without extra_state shards: resume cannot restore the LR scheduler and RNG",
    ),
    Code(
        code="missing-dataloader-state",
        severity=W,
        explanation="no data.pt in the step directory: a resume restarts the epoch and repeats data",
    ),
    Code(
        code="missing-fsdp-config",
        severity=INFO,
        explanation="no fsdp_config.json (written since verl v0.4.1): the current model merger refuses the directory",
    ),
    Code(code="fsdp-config-invalid", severity=W, explanation="fsdp_config.json is not the JSON object verl writes"),
    Code(code="empty-role", severity=W, explanation="a role directory (actor/, critic/) holds no shard files"),
    Code(
        code="mesh-size-mismatch",
        severity=E,
        explanation=(
            "the DeviceMesh recorded in a shard has a size that matches neither the file name's W nor an HSDP split"
            " of it"
        ),
    ),
    # per file
    Code(
        code="truncated",
        severity=E,
        explanation="the file is cut short: its zip directory is missing or points past the end",
        corrupts=True,
    ),
    Code(code="zero-byte", severity=E, explanation="the file is empty (0 bytes)", corrupts=True),
    Code(
        code="crc-mismatch",
        severity=E,
        explanation="a zip entry's bytes do not match the CRC-32 torch recorded: silent corruption (bit flip)",
        corrupts=True,
    ),
    Code(
        code="hash-drift",
        severity=E,
        explanation=(
            "a re-read (scrub, verify, --rehash) found the content changed while size, mtime and inode did not (bit"
            " rot or an in-place rewrite)"
        ),
        corrupts=True,
    ),
    Code(
        code="scrub-overdue",
        severity=W,
        explanation=(
            "files last verified by content a scrub period or more ago were not re-read: --scrub-budget is too "
            "small for --scrub-period"
        ),
    ),
    Code(
        code="not-a-zip",
        severity=E,
        explanation="a .pt file that is not a torch zip archive (garbage or another format)",
        corrupts=True,
    ),
    Code(
        code="bad-zip",
        severity=E,
        explanation="the zip structure is damaged (inconsistent directory or local headers)",
        corrupts=True,
    ),
    Code(
        code="legacy-pickle-format",
        severity=INFO,
        explanation="a .pt saved in torch's legacy non-zip format: no CRCs to check",
    ),
    Code(
        code="raw-pickle",
        severity=E,
        explanation=(
            "a .pt that is a bare pickle stream, not a torch.save file: torch.load unpickles its first object and "
            "then refuses it"
        ),
    ),
    Code(
        code="not-a-torch-archive",
        severity=E,
        explanation="a zip without torch's data.pkl/version records",
        corrupts=True,
    ),
    Code(
        code="zip-local-header-mismatch",
        severity=W,
        explanation=(
            "a zip entry's local header disagrees with its central-directory record (name, method, size or CRC): "
            "torch.load reads the directory and loads it, but the headers were damaged or rewritten"
        ),
    ),
    Code(
        code="pickle-over-bounds",
        severity=E,
        explanation=(
            "a pickle asks for more than a checkpoint ever holds (a constructor with a huge size, nesting deeper than "
            "the bound): loading it would exhaust memory or crash the loader; the checkpoint is unsafe to resume"
        ),
    ),
    Code(
        code="zip-prefix-mismatch",
        severity=W,
        explanation=(
            "the folder inside the zip differs from the file stem: the shard was renamed or copied from elsewhere"
        ),
    ),
    Code(
        code="bad-pickle",
        severity=E,
        explanation="data.pkl cannot be parsed by the restricted unpickler",
        corrupts=True,
    ),
    Code(
        code="unsafe-pickle",
        severity=E,
        explanation=(
            "a pickle in the file (zip, legacy or raw) names a global outside the allowlist: loading it as verl "
            "loads extra_state and data.pt would run code; the checkpoint is unsafe to resume"
        ),
    ),
    Code(
        code="storage-size-mismatch",
        severity=E,
        explanation="a tensor storage's size in data.pkl disagrees with its zip entry, or an entry is missing",
        corrupts=True,
    ),
    Code(code="unreadable", severity=E, explanation="the file or directory cannot be read (permissions, I/O error)"),
    Code(
        code="file-changed-during-scan",
        severity=W,
        explanation="the file's size or mtime moved while it was being read: it is being written",
    ),
    Code(code="file-vanished", severity=W, explanation="the file was listed but disappeared before it could be read"),
)
