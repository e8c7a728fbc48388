"""Per-file findings from what the readers saw: one streaming digest plus the zip directory and data.pkl."""

from __future__ import annotations

import os
from collections.abc import Iterable

from ckpt_audit.codes import ITEM_PICKLE_CODES, ZIP_RULE_CODES, finding
from ckpt_audit.models import FileKind, Finding
from ckpt_audit.readers.problem import Problem

ZIP_SUFFIXES = (".pt", ".pth")
NONEMPTY_SUFFIXES = (".pt", ".pth", ".safetensors", ".bin", ".distcp", ".json")
# containers (ptzip.sniff) whose pickles torch.load would run: their structure and globals are read like a zip's
PICKLE_KINDS = frozenset({"legacy-torch", "pickle"})


# files torch.load is pointed at: .pt/.pth, and the .bin of HF (pytorch_model*.bin, training_args.bin), which
# transformers loads with torch.load too
PICKLE_SUFFIXES = (*ZIP_SUFFIXES, ".bin")


def reads_structure(path: str, *, kind: str, is_zip: bool, zip_error: Problem | None) -> bool:
    """Whether the scan reads a file's pickle: every .pt/.pth/.bin that torch.load would unpickle (an intact zip,
    the legacy format, a raw pickle), so a global outside the allowlist is found in any container and file kind."""
    return path.endswith(PICKLE_SUFFIXES) and (kind in PICKLE_KINDS or (is_zip and zip_error is None))


# Kinds the layouts name that are never torch.save zips though their bytes may start like one: a .distcp is
# torch.save blobs back to back (verify checks its byte ranges against .metadata). The zip rules skip them.
NOT_TORCH_ZIP = frozenset({FileKind.DISTCP})


def judged_as(kind: FileKind, findings: Iterable[Finding]) -> bool:
    """Whether cached findings are what the rules say of a file of this kind now: a row recorded before the zip
    rules knew a .distcp is no zip holds zip findings for it, so the file is read again rather than reused."""
    return kind not in NOT_TORCH_ZIP or not any(f.code in ZIP_RULE_CODES - ITEM_PICKLE_CODES for f in findings)


def stem(path: str) -> str:
    name = os.path.basename(path)
    return name.rsplit(".", 1)[0] if "." in name else name


def digest_findings(
    path: str,
    *,
    kind: FileKind,
    size: int,
    zip_error: Problem | None,
    crc_bad: tuple[str, ...],
    prefix: str | None,
    changed: bool,
    local_mismatch: tuple[str, ...] = (),
) -> tuple[Finding, ...]:
    """Findings from one FileDigest (passed as plain values so this stays a pure function), for a file of `kind`
    (what the layouts call it, from its name): the zip rules apply to every kind but NOT_TORCH_ZIP."""
    out: list[Finding] = []
    if changed:
        out.append(finding("file-changed-during-scan", path, "size or mtime changed while the file was read"))
    if size == 0:
        if path.endswith(NONEMPTY_SUFFIXES):
            out.append(finding("zero-byte", path, "empty file (0 bytes)"))
        return tuple(out)
    if local_mismatch:  # torch.load reads the directory, so this loads; the headers were damaged or rewritten
        more = f" and {len(local_mismatch) - 1} more" if len(local_mismatch) > 1 else ""
        out.append(finding("zip-local-header-mismatch", path, f"{local_mismatch[0]}{more}"))
    if kind in NOT_TORCH_ZIP:
        if zip_error is not None:  # DCP's load torch.loads every item at the range .metadata gives: it refuses this
            out.append(finding("distcp-item-invalid", path, zip_error.message))
        if crc_bad:  # the items' own CRCs (hashing walks a .distcp's chain of zips): torch.load checks none
            items = sorted({int(name[1:].split("/", 1)[0]) for name in crc_bad if name.startswith("@")})
            out.append(
                finding(
                    "distcp-crc-mismatch",
                    path,
                    f"CRC-32 mismatch in {len(crc_bad)} entr{'y' if len(crc_bad) == 1 else 'ies'} of the item(s) at"
                    f" byte {', '.join(map(str, items[:3]))}: loads silently with changed values",
                )
            )
        return tuple(out)
    if zip_error is not None:
        out.append(zip_finding(path, zip_error))
    if crc_bad:
        shown = ", ".join(crc_bad[:3]) + (f" and {len(crc_bad) - 3} more" if len(crc_bad) > 3 else "")
        out.append(
            finding(
                "crc-mismatch",
                path,
                f"CRC-32 mismatch in {len(crc_bad)} zip entr{'y' if len(crc_bad) == 1 else 'ies'}: {shown}",
            )
        )
    if prefix is not None and path.endswith(ZIP_SUFFIXES) and prefix != stem(path):
        out.append(finding("zip-prefix-mismatch", path, f"archive folder is {prefix!r}, file stem is {stem(path)!r}"))
    return tuple(out)


def zip_finding(path: str, zip_error: Problem) -> Finding:
    """The finding of a zip the readers could not use: the code is the one the reader named."""
    return finding(zip_error.code, path, zip_error.message)


# pickles that hold one configuration object by design and that no resume loads: transformers' Trainer saves
# training_args.bin with torch.save(self.args). The classes of that object (these module families) are reported as
# what they are (training-args-pickle, info); any other global in the file is still unsafe-pickle.
OBJECT_PICKLES: dict[str, tuple[str, ...]] = {"training_args.bin": ("transformers.", "accelerate.", "trl.", "peft.")}


def structure_findings(
    path: str, *, problems: tuple[Problem, ...], unsafe_globals: frozenset[str]
) -> tuple[Finding, ...]:
    """Findings from read_pt_structure: its problems (each with the code the reader named; its notes are no defect)
    and globals outside the allowlist (KNOWN_SAFE_GLOBALS, which verify uses too): such a pickle would run code
    when loaded the way verl loads extra_state and data.pt, so it is an error and the checkpoint is unsafe."""
    out = [finding(p.code, path, p.message) for p in problems]
    if (families := OBJECT_PICKLES.get(os.path.basename(path))) and unsafe_globals:
        own = frozenset(g for g in unsafe_globals if g.startswith(families))
        if own:
            main = sorted(own, key=lambda g: (not g.endswith("Arguments"), g))[0]
            out.append(
                finding(
                    "training-args-pickle",
                    path,
                    f"a pickled {main} ({len(own)} class(es) of {', '.join(sorted({g.split('.')[0] for g in own}))}):"
                    " never unpickled here; Trainer does not load it on resume",
                )
            )
        unsafe_globals = unsafe_globals - own
    if unsafe_globals:
        names = sorted(unsafe_globals)
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        out.append(finding("unsafe-pickle", path, f"references {shown}: loading it would run code"))
    return tuple(out)
