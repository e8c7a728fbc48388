"""verl's Megatron layout v2 and the file checks that came with it: `.distcp` items, dist_ckpt's integrity.json,
safetensors headers (rules/megatron_v2.py, docs/megatron.md).

One entry per code, in docs/codes.md's order.
"""

from __future__ import annotations

from ckpt_audit.codes.entry import INFO, Code, E, W

TABLE: tuple[Code, ...] = (
    # verl's Megatron layout v2 (verl >= 0.9.1; rules/megatron_v2.py, docs/megatron.md)
    Code(
        code="megatron-v2-manifest-missing",
        severity=E,
        explanation="a v2 role directory (model/, optimizer/, extra/) without ckpt_contents.json, which verl writes "
        "last: the save did not finish (in progress while young)",
    ),
    Code(
        code="megatron-v2-manifest-invalid",
        severity=E,
        explanation="ckpt_contents.json is not JSON, not schema 2 of framework megatron, or names a path outside the "
        "role directory: what the save holds is unknown",
    ),
    Code(
        code="megatron-v2-content-missing",
        severity=E,
        explanation="a content ckpt_contents.json lists is absent or empty (or an HF content lacks its config or "
        "weights): verl's load of it fails",
    ),
    Code(
        code="megatron-v2-step-mismatch",
        severity=E,
        explanation="ckpt_contents.json names another global_step than its directory (a copied or renamed step): "
        "verl resumes that step's state under this step's number",
    ),
    Code(
        code="megatron-v2-role-mismatch",
        severity=E,
        explanation="ckpt_contents.json names another role than its directory",
    ),
    Code(
        code="megatron-old-layout",
        severity=W,
        explanation="the pre-v2 Megatron layout (dist_ckpt/ directly under the role): whole, but verl >= 0.9.1 "
        "refuses to load it until verl's migrate_megatron_checkpoint_layout.py has run; never the answer of `latest`",
    ),
    Code(
        code="megatron-migrated",
        severity=INFO,
        explanation="a role directory migrated by verl's script: model/, optimizer/, extra/ dist_ckpt mirror the old "
        "dist_ckpt/ (hardlinked files counted once), no ckpt_contents.json",
    ),
    Code(
        code="megatron-link-dangling",
        severity=E,
        explanation="a symbolic link in a Megatron v2 role (verl's migration script in symlink mode makes them) leads "
        "to nothing under the scanned roots: verl's load reads through it and fails (the run was moved or copied)",
    ),
    Code(
        code="megatron-link-absolute",
        severity=W,
        explanation="a symbolic link in a Megatron v2 role is absolute or leads out of its run (verl's migration "
        "script in symlink mode): it breaks when the run is moved, and a copy of the run reads the original's files",
    ),
    Code(
        code="fsdp-huggingface-moved",
        severity=W,
        explanation="verl's Megatron migration script (--checkpoint-root --all-steps) moved an FSDP role's "
        "huggingface/ to model/huggingface/: verl's FSDP resume does not read it, but its model merger and export do",
    ),
    Code(
        code="distcp-crc-mismatch",
        severity=E,
        explanation=(
            "an item of a .distcp (a torch.save zip) fails its CRC-32: DCP and megatron-core load it silently with"
            " changed values"
        ),
        corrupts=True,
    ),
    Code(
        code="distcp-item-invalid",
        severity=E,
        explanation="the bytes .metadata gives for an item of a .distcp are not the torch.save zip DCP wrote there",
        corrupts=True,
    ),
    Code(
        code="megatron-integrity-mismatch",
        severity=E,
        explanation="a file's SHA-256 differs from dist_ckpt/integrity.json (Megatron's verify_integrity load refuses)",
        corrupts=True,
    ),
    Code(
        code="megatron-integrity-file-missing",
        severity=E,
        explanation="a file dist_ckpt/integrity.json lists is gone",
    ),
    Code(
        code="megatron-integrity-invalid",
        severity=E,
        explanation="dist_ckpt/integrity.json is not JSON with 'files', or names a hash algorithm other than sha256",
    ),
    Code(
        code="safetensors-header-invalid",
        severity=E,
        explanation="a .safetensors header is unreadable (length past the file end, not JSON, malformed entry)",
        corrupts=True,
    ),
    Code(
        code="safetensors-offsets",
        severity=E,
        explanation=(
            "a .safetensors tensor's dtype x shape disagrees with its offsets, or offsets leave gaps/overlaps or do"
            " not end at the file size"
        ),
        corrupts=True,
    ),
)
