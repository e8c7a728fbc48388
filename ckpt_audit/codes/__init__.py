"""The registry of finding codes: each stable slug with its severity and a one-line explanation.

`docs/codes.md` is generated from here (`python scripts/gen_codes_doc.py`; tests/test_docs.py fails while it is
stale) and the TUI reads explanations from here; rules construct findings through `finding()`, so a code that is
not registered fails loudly in tests instead of leaking an undocumented slug. A new code goes in its family's
table, one entry each: `shards` (shard sets, each file's bytes), `steps` (tracker, step names, save order), `deep`
(verify), `megatron`, `hf_trainer`, `deepspeed`, `walk` (the walk, object stores), `continuity`, `export`,
`cluster` (scan --ray).
"""

from __future__ import annotations

from ckpt_audit.codes import cluster, continuity, deep, deepspeed, export, hf_trainer, megatron, shards, steps, walk
from ckpt_audit.codes.entry import Code
from ckpt_audit.models import Finding

# the families in docs/codes.md's order
FAMILIES = (shards, steps, deep, megatron, hf_trainer, deepspeed, walk, continuity, export, cluster)
CODES: dict[str, Code] = {c.code: c for family in FAMILIES for c in family.TABLE}

# What a code means beyond its severity, each set owned here beside the registry (tests/test_codes_asserted.py
# checks every name in them is registered); `Code.corrupts` is the one flag kept on the entries themselves.
# "this entry was not read", as opposed to "read and bad": a checkpoint holding one is unknown, never disposable
# (a broken link was read: its target is missing)
UNREAD_CODES = frozenset(
    {
        "unreadable",
        "symlink-outside-root",
        "symlink-loop",
        "file-vanished",
        "non-utf8-name",
        "remote-unverified",  # an object store's object judged by its listing alone (ckpt_audit.remote)
        "upload-in-progress",
    }
)
# "resuming from this would run code": a pickle naming a global outside the allowlist, or one whose load would
# exhaust memory or the stack
UNSAFE_CODES = frozenset({"unsafe-pickle", "pickle-over-bounds"})
# what the zip rules (a digest's zip error, CRCs, prefix) and the structure rules can say of a file
ZIP_RULE_CODES = frozenset(
    {
        "bad-zip",
        "truncated",
        "not-a-zip",
        "zip-prefix-mismatch",
        "not-a-torch-archive",
        "bad-pickle",
        "storage-size-mismatch",
        "crc-mismatch",
        "unsafe-pickle",
        "legacy-pickle-format",
        "raw-pickle",
    }
)
# what the scan says of a .distcp's items' pickles (read_item_pickles), which the zip rules never said of one
ITEM_PICKLE_CODES = frozenset({"unsafe-pickle", "pickle-over-bounds"})
# what the scan reports per file and verify again per tensor: both are kept (the scan's finding has no tensor)
NAMED_BY_VERIFY = frozenset({"distcp-crc-mismatch", "distcp-item-invalid"})
FLAG_SETS = {
    "UNREAD_CODES": UNREAD_CODES,
    "UNSAFE_CODES": UNSAFE_CODES,
    "ZIP_RULE_CODES": ZIP_RULE_CODES,
    "ITEM_PICKLE_CODES": ITEM_PICKLE_CODES,
    "NAMED_BY_VERIFY": NAMED_BY_VERIFY,
}


def finding(code: str, path: str, message: str, *, rank: int | None = None, tensor: str | None = None) -> Finding:
    """A Finding with the registered severity of `code` (KeyError for an unregistered code)."""
    return Finding(severity=CODES[code].severity, code=code, path=path, message=message, rank=rank, tensor=tensor)


def explain(code: str) -> str:
    entry = CODES.get(code)
    return entry.explanation if entry is not None else ""
