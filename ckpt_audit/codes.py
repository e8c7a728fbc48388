"""The registry of finding codes: each stable slug with its severity and a one-line explanation.

README, `docs/scan.md` and the TUI read explanations from here; rules construct findings through `finding()`, so a
code that is not registered fails loudly in tests instead of leaking an undocumented slug. Other parts of ckpt-audit
(verify's deep rules, lifecycle) add their codes to `CODES` below, one line each.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_audit.models import Finding, Severity

E, W, I = Severity.ERROR, Severity.WARNING, Severity.INFO


@dataclass(frozen=True, slots=True, kw_only=True)
class Code:
    code: str
    severity: Severity
    explanation: str
    corrupts: bool = False  # an ERROR of this code makes the checkpoint "corrupt" (not merely "incomplete")


_TABLE: tuple[Code, ...] = (
    # shard sets
    Code(code="missing-rank", severity=E, explanation="a rank's shard file is absent: resume dies with FileNotFoundError on that rank"),
    Code(code="world-size-mismatch", severity=E, explanation="fsdp_config.json's world_size differs from the W in the shard file names"),
    Code(code="stale-world-size", severity=W, explanation="a second shard set with another world size sits beside the current one; it misleads the merger and a resume at that W"),
    Code(code="missing-model", severity=E, explanation="a role directory has optimizer or extra-state shards but no model shards"),
    Code(code="missing-optimizer", severity=E, explanation="model shards without any optimizer shards: resume cannot restore the optimizer"),
    Code(code="missing-extra-state", severity=E, explanation="model shards without extra_state shards: resume cannot restore the LR scheduler and RNG"),
    Code(code="missing-dataloader-state", severity=W, explanation="no data.pt in the step directory: a resume restarts the epoch and repeats data"),
    Code(code="missing-fsdp-config", severity=I, explanation="no fsdp_config.json (written since verl v0.4.1): the current model merger refuses the directory"),
    Code(code="fsdp-config-invalid", severity=W, explanation="fsdp_config.json is not the JSON object verl writes"),
    Code(code="empty-role", severity=W, explanation="a role directory (actor/, critic/) holds no shard files"),
    Code(code="mesh-size-mismatch", severity=E, explanation="the DeviceMesh recorded in a shard has a size that matches neither the file name's W nor an HSDP split of it"),
    # per file
    Code(code="truncated", severity=E, explanation="the file is cut short: its zip directory is missing or points past the end", corrupts=True),
    Code(code="zero-byte", severity=E, explanation="the file is empty (0 bytes)", corrupts=True),
    Code(code="crc-mismatch", severity=E, explanation="a zip entry's bytes do not match the CRC-32 torch recorded: silent corruption (bit flip)", corrupts=True),
    Code(code="hash-drift", severity=E, explanation="--rehash: the content changed while size, mtime and inode did not (bit rot or an in-place rewrite)", corrupts=True),
    Code(code="not-a-zip", severity=E, explanation="a .pt file that is not a torch zip archive (garbage or another format)", corrupts=True),
    Code(code="bad-zip", severity=E, explanation="the zip structure is damaged (inconsistent directory or local headers)", corrupts=True),
    Code(code="legacy-pickle-format", severity=I, explanation="a .pt saved in torch's legacy non-zip format: no CRCs to check"),
    Code(code="not-a-torch-archive", severity=E, explanation="a zip without torch's data.pkl/version records", corrupts=True),
    Code(code="zip-prefix-mismatch", severity=W, explanation="the folder inside the zip differs from the file stem: the shard was renamed or copied from elsewhere"),
    Code(code="bad-pickle", severity=E, explanation="data.pkl cannot be parsed by the restricted unpickler", corrupts=True),
    Code(code="unsafe-pickle", severity=W, explanation="data.pkl references globals outside the tensor allowlist; never torch.load it with weights_only=False"),
    Code(code="storage-size-mismatch", severity=E, explanation="a tensor storage's size in data.pkl disagrees with its zip entry, or an entry is missing", corrupts=True),
    Code(code="unreadable", severity=E, explanation="the file or directory cannot be read (permissions, I/O error)"),
    Code(code="file-changed-during-scan", severity=W, explanation="the file's size or mtime moved while it was being read: it is being written"),
    Code(code="file-vanished", severity=W, explanation="the file was listed but disappeared before it could be read"),
    # tracker and step names
    Code(code="tracker-missing", severity=W, explanation="no latest_checkpointed_iteration.txt: resume_mode=auto starts training from scratch"),
    Code(code="tracker-empty", severity=E, explanation="the tracker file is empty (crash while writing it): resume raises ValueError"),
    Code(code="tracker-invalid", severity=E, explanation="the tracker does not hold a decimal step number: resume raises ValueError"),
    Code(code="tracker-dangling", severity=E, explanation="the tracker names a step that is missing or not complete: verl silently trains from scratch or fails to load"),
    Code(code="misnamed-step", severity=W, explanation="a step directory named global_steps_N (the docs' typo) or similar: verl never reads it"),
    Code(code="in-progress", severity=I, explanation="the checkpoint is being written now (recent and not yet committed by the tracker); judged on a later scan"),
    Code(code="husk", severity=I, explanation="only data.pt (or nothing resumable) is left: the usual remains of retention"),
    Code(code="no-complete-checkpoint", severity=E, explanation="the run has checkpoints but none is complete"),
    # the walk
    Code(code="no-runs", severity=W, explanation="a root holds no checkpoint run that any layout recognises (wrong path, or an unmounted disk)"),
    Code(code="symlink-outside-root", severity=W, explanation="a symbolic link points outside the scanned root; not followed"),
    Code(code="symlink-loop", severity=W, explanation="a symbolic link leads back to a directory already being walked; not followed again"),
    Code(code="broken-symlink", severity=W, explanation="a symbolic link whose target does not exist"),
    Code(code="non-utf8-name", severity=W, explanation="a file or directory name is not valid UTF-8; it is reported but not catalogued"),
)

CODES: dict[str, Code] = {c.code: c for c in _TABLE}


def finding(code: str, path: str, message: str, *, rank: int | None = None, tensor: str | None = None) -> Finding:
    """A Finding with the registered severity of `code` (KeyError for an unregistered code)."""
    return Finding(severity=CODES[code].severity, code=code, path=path, message=message, rank=rank, tensor=tensor)


def explain(code: str) -> str:
    entry = CODES.get(code)
    return entry.explanation if entry is not None else ""
