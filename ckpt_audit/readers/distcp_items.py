"""The CRC-32 of every item in a `.distcp`, from the byte ranges `.metadata` gives. No torch.

DCP's FileSystemWriter (and megatron-core's FileSystemWriterAsync) write each tensor chunk with `torch.save` and
each object as the bytes of a `torch.save`, back to back in one file: every item is a small zip of stored entries
with its CRC-32 in its own central directory. torch.load checks none of them, so a flipped bit inside an item loads
as a changed weight. Here each item's directory is read at the end of its range (`ptzip.read_archive(base=)`), and
its entries' CRCs are computed as the item's bytes stream past (hashing's checker). Items that are not zips (DCP's
raw or safetensors serialisation formats) carry no CRC and are skipped.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from ckpt_audit.readers import ptzip, unpickler
from ckpt_audit.readers.hashing import CHUNK, ZipCrcChecker
from ckpt_audit.readers.problem import Problem
from ckpt_audit.readers.torch_globals import KNOWN_SAFE_GLOBALS


@dataclass(frozen=True, slots=True, kw_only=True)
class ItemProblem:
    key: str  # the item's fully qualified name in .metadata
    offset: int  # where its bytes start in the file
    problem: Problem


@dataclass(frozen=True, slots=True, kw_only=True)
class ItemsReport:
    checked: int  # items whose CRCs were compared
    skipped: int  # items that are no zip (raw serialisation), or saved with CRCs off
    problems: tuple[ItemProblem, ...]


def check_items(path: str, items: Sequence[tuple[str, int, int]]) -> ItemsReport:
    """Check every (key, offset, length) item of the file at `path`. Items reaching past the end are left to the
    byte-range check (dcp-range-outside-file). Raises OSError when the file cannot be opened."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        checked = skipped = 0
        out = []
        for key, off, length in sorted(items, key=lambda it: it[1]):
            if off < 0 or length <= 0 or off + length > size:
                continue
            if os.pread(fd, 4, off) != ptzip.ZIP_MAGIC:
                skipped += 1
                continue
            problem = _check_one(fd, off, length)
            if problem is _CRC_OFF:
                skipped += 1
                continue
            checked += 1
            if problem is not None:
                out.append(ItemProblem(key=key, offset=off, problem=problem))
        return ItemsReport(checked=checked, skipped=skipped, problems=tuple(out))
    finally:
        os.close(fd)


_CRC_OFF = Problem("distcp-item-invalid", "saved with CRC-32 off")  # a sentinel: nothing to compare, no finding


def _check_one(fd: int, off: int, length: int) -> Problem | None:
    try:
        archive = ptzip.read_archive(fd, length, base=off)
    except ptzip.ZipFormatError as exc:
        return Problem("distcp-item-invalid", f"item at byte {off}: {exc.problem.message}")
    if archive.crc_disabled:
        return _CRC_OFF
    checker = ZipCrcChecker(archive)
    pos = 0
    while pos < length:
        chunk = os.pread(fd, min(CHUNK, length - pos), off + pos)
        if not chunk:
            break
        checker.feed(pos, memoryview(chunk))
        pos += len(chunk)
    checker.finish()
    if checker.error is not None:
        return Problem("distcp-item-invalid", f"item at byte {off}: {checker.error.message}")
    if checker.bad:
        return Problem(
            "distcp-crc-mismatch",
            f"item at byte {off}: CRC-32 mismatch in {', '.join(checker.bad)} (torch.load would return changed values)",
        )
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class ItemPickles:
    globals_seen: frozenset[str]  # every global the items' pickles name (judged against the one allowlist)
    problems: tuple[Problem, ...]  # items whose pickle cannot be read, or asks past the bounds

    @property
    def unsafe_globals(self) -> frozenset[str]:
        return frozenset(g for g in self.globals_seen if g not in KNOWN_SAFE_GLOBALS)


def read_item_pickles(pickles: Sequence[tuple[str, bytes | None]]) -> ItemPickles:
    """Every item's `data.pkl` through the restricted unpickler, as `hashing.digest_file` kept them while hashing
    (`FileDigest.item_pickles`: no extra read). DCP's load runs torch.load, weights-only off, on each bytes item
    (DefaultLoadPlanner.load_bytes), so a global outside the allowlist in any item is code a resume would run."""
    seen: set[str] = set()
    problems: list[Problem] = []
    done: dict[bytes, tuple[frozenset[str], Exception | None]] = {}  # items of one shape pickle alike: read once
    for name, raw in pickles:
        item = name.partition("/")[0].lstrip("@")
        if raw is None:
            problems.append(
                Problem("pickle-over-bounds", f"item at byte {item}: data.pkl is larger than any DCP item's")
            )
            continue
        if raw not in done:
            done[raw] = unpickler.unpickle(raw, None)[1:]
        names, error = done[raw]
        seen |= names
        if error is not None:
            p = unpickler.unpickle_problem("data.pkl", error)
            code = p.code if p.code == "pickle-over-bounds" else "distcp-item-invalid"
            problems.append(Problem(code, f"item at byte {item}: {p.message}"))
    return ItemPickles(globals_seen=frozenset(seen), problems=tuple(problems))
