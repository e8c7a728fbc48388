"""The three containers torch.load accepts, each read without torch: a torch.save zip (its `data.pkl`), the legacy
non-zip format (five pickles, then raw storages) and a raw pickle stream. Each pickle goes through the restricted
unpickler; its tensors are walked (`walk`) and its storages checked against the bytes the file holds.
"""

from __future__ import annotations

import dataclasses
import io
import os
import struct
from collections.abc import Iterator
from typing import Any

from ckpt_audit.readers.problem import Problem
from ckpt_audit.readers.pt.structure import PtStructure, StorageRef
from ckpt_audit.readers.pt.walk import Walker
from ckpt_audit.readers.ptzip import (
    SNIFF_BYTES,
    PtArchive,
    ZipFormatError,
    _pread_exact,
    payload_offset,
    read_archive,
    read_entry,
    sniff,
)
from ckpt_audit.readers.torch_globals import STORAGE_DTYPES
from ckpt_audit.readers.unpickler import PersistentRef, global_name, too_deep, unpickle, unpickle_problem

MAX_PICKLE_BYTES = 512 * 1024 * 1024  # data.pkl of a real shard is KiBs to a few MiB


def read_pt_structure(path: str | os.PathLike[str]) -> PtStructure:
    """Structure of a torch file without torch and without running its pickle: a torch.save zip, the legacy
    (non-zip) torch.save format, or a raw pickle stream. Raises OSError only; a broken container or pickle becomes
    `problems` (the first one says why nothing else could be read)."""
    fspath = os.fspath(path)
    fd = os.open(fspath, os.O_RDONLY)
    try:
        kind = sniff(os.pread(fd, SNIFF_BYTES, 0))
        if kind == "legacy-torch":
            return _read_legacy(fd, fspath)
        if kind == "pickle":
            return _read_raw_pickle(fd, fspath)
        try:
            archive = read_archive(fd)
        except ZipFormatError as exc:
            return PtStructure(path=fspath, prefix=None, problems=(exc.problem,))
        return _read_structure(fd, fspath, archive)
    finally:
        os.close(fd)


class _Storages(dict):
    """Storage key -> StorageRef, filled by the unpickler's persistent_load as torch's persistent ids come by."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__()
        self.problems = problems

    def persistent(self, pid: Any) -> Any:
        ref = _storage_ref(pid)
        if ref is None:
            return PersistentRef(pid)
        prior = self.setdefault(ref.key, ref)
        if prior.numel != ref.numel or prior.storage_type != ref.storage_type:
            self.problems.append(
                Problem("storage-size-mismatch", f"storage {ref.key} is referenced with two different types or sizes")
            )
        return ref


def _read_structure(fd: int, path: str, archive: PtArchive) -> PtStructure:
    problems = list(archive.torch_problems)
    base: dict[str, Any] = dict(path=path, prefix=archive.prefix, entries=archive.entries)
    byteorder = None
    if (bo := archive.get("byteorder")) is not None:
        try:
            byteorder = read_entry(fd, bo, limit=64).decode("ascii", "replace").strip()
        except ZipFormatError as exc:
            problems.append(exc.problem)
    if byteorder not in (None, "little", "big"):
        problems.append(Problem("bad-pickle", f"byteorder record says {byteorder!r}"))
    pkl = archive.get("data.pkl")
    if pkl is None:
        return PtStructure(**base, problems=tuple(problems), byteorder=byteorder)
    try:
        raw = read_entry(fd, pkl, limit=MAX_PICKLE_BYTES)
    except ZipFormatError as exc:
        return PtStructure(**base, problems=(*problems, exc.problem), byteorder=byteorder)
    storages = _Storages(problems)
    root, seen, error = unpickle(raw, storages.persistent)
    if error is not None:
        return PtStructure(
            **base,
            problems=(*problems, unpickle_problem("data.pkl", error)),
            byteorder=byteorder,
            globals_seen=seen,
        )

    def locate(key: str) -> tuple[int, int] | None:
        entry = archive.data_entries.get(key)
        return (payload_offset(fd, entry), entry.size) if entry is not None and entry.stored else None

    walker = Walker(fd, locate, big_endian=byteorder == "big")
    tree = walker.convert(root, ())
    problems.extend(walker.problems)
    notes = list(walker.notes)
    _check_storages(archive, storages, problems, notes)
    keys = _keys(root)
    return PtStructure(
        **base,
        keys=keys,
        tensors=tuple(walker.tensors),
        globals_seen=seen,
        problems=tuple(problems),
        notes=tuple(notes),
        byteorder=byteorder,
        storage_count=len(storages),
        tree=tree,
    )


# torch/serialization.py: MAGIC_NUMBER and PROTOCOL_VERSION of the legacy format
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001


class _Window(io.RawIOBase):
    """The first `limit` bytes of an open file, read by pread: the pickles of a legacy file are parsed from it
    (through a BufferedReader, whose tell() then gives where the raw storage bytes start)."""

    def __init__(self, fd: int, limit: int) -> None:
        super().__init__()
        self.fd, self.limit, self.pos = fd, limit, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        n = min(len(buf), self.limit - self.pos)
        if n <= 0:
            return 0
        data = os.pread(self.fd, n, self.pos)
        buf[: len(data)] = data
        self.pos += len(data)
        return len(data)

    def tell(self) -> int:
        return self.pos

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else (self.pos + pos if whence == 1 else self.limit + pos)
        return self.pos


def _read_legacy(fd: int, path: str) -> PtStructure:
    """torch's legacy format (torch/serialization.py `_legacy_save`): pickles of the magic number, the protocol
    version and a sys-info dict; the data pickle, whose persistent ids name storages; a pickle of the storage keys;
    then per key an 8-byte little-endian element count and the storage's raw bytes. Every pickle goes through the
    restricted unpickler (torch's own loader unpickles all five), and the raw bytes are located, never read."""
    size = os.fstat(fd).st_size
    reader = io.BufferedReader(_Window(fd, min(size, MAX_PICKLE_BYTES)), 1 << 20)
    problems: list[Problem] = []
    notes: list[str] = []
    storages = _Storages(problems)
    seen: set[str] = set()
    base: dict[str, Any] = dict(path=path, prefix=None, container="legacy")
    values = []
    for what in ("magic number", "protocol version", "sys info", "data", "storage keys"):
        start = reader.tell()
        # its opcodes walked first: hashing a tuple nested 1M deep kills the process
        error: Exception | None = too_deep(reader)
        reader.seek(start)
        value, names, error = (
            unpickle(reader, storages.persistent if what == "data" else None)
            if error is None
            else (None, frozenset(), error)
        )
        seen |= names
        if error is not None:
            return PtStructure(
                **base,
                problems=(*problems, unpickle_problem(f"{what} pickle", error)),
                globals_seen=frozenset(seen),
            )
        values.append(value)
    magic, protocol, sys_info, root, keys = values
    if magic != _LEGACY_MAGIC or protocol != _LEGACY_PROTOCOL:
        problems.append(
            Problem("bad-pickle", f"legacy header holds magic {magic!r}, protocol {protocol!r}: not what torch writes")
        )
    little = sys_info.get("little_endian", True) if isinstance(sys_info, dict) else True
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        problems.append(Problem("bad-pickle", "the storage-keys pickle is not a list of keys"))
        keys = []
    spans = dict(_legacy_spans(fd, reader.tell(), size, keys, storages, problems, notes))
    walker = Walker(fd, spans.get, big_endian=not little)
    tree = walker.convert(root, ())
    problems.extend(walker.problems)
    notes.extend(walker.notes)
    return PtStructure(
        **base,
        keys=_keys(root),
        tensors=tuple(walker.tensors),
        globals_seen=frozenset(seen),
        problems=tuple(problems),
        notes=tuple(notes),
        byteorder="little" if little else "big",
        storage_count=len(storages),
        tree=tree,
    )


def _legacy_spans(
    fd: int,
    offset: int,
    size: int,
    keys: list[str],
    storages: dict[str, StorageRef],
    problems: list[Problem],
    notes: list[str],
) -> Iterator[tuple[str, tuple[int, int]]]:
    """(key, (offset, nbytes)) of each storage's raw bytes, checked against the counts the data pickle gives."""
    for key in keys:
        ref = storages.get(key)
        head = os.pread(fd, 8, offset) if offset + 8 <= size else b""
        if len(head) < 8:
            problems.append(Problem("truncated", f"truncated: storage {key} starts past the end of the file"))
            return
        (numel,) = struct.unpack("<q", head)
        itemsize = ref.itemsize if ref is not None else 1
        start, nbytes = offset + 8, max(numel, 0) * itemsize
        if start + nbytes > size:
            problems.append(
                Problem("truncated", f"truncated: storage {key} ({nbytes} bytes) ends past the end of the file")
            )
            return
        if ref is None:
            notes.append(f"legacy storage {key} is referenced by no tensor in the data pickle")
        elif numel != ref.numel:
            problems.append(
                Problem(
                    "storage-size-mismatch",
                    f"storage {key} holds {numel} elements but the data pickle says {ref.numel}",
                )
            )
        yield key, (start, nbytes)
        offset = start + nbytes
    for key in sorted(set(storages) - set(keys), key=_natural):
        problems.append(
            Problem("storage-size-mismatch", f"storage {key} is named by a tensor but has no bytes in the file")
        )


def _read_raw_pickle(fd: int, path: str) -> PtStructure:
    """A raw pickle stream where a torch file belongs: torch.load unpickles its first object while looking for the
    legacy magic number, so that object is read as any torch pickle is (restricted, its globals recorded)."""
    size = os.fstat(fd).st_size
    # read whole (it is the file), so that its depth is bounded before the C unpickler hashes anything
    root, seen, error = unpickle(_pread_exact(fd, min(size, MAX_PICKLE_BYTES), 0), None)
    base: dict[str, Any] = dict(path=path, prefix=None, container="pickle", globals_seen=seen)
    if error is not None:
        return PtStructure(**base, problems=(unpickle_problem("pickle", error),))
    return PtStructure(**base, keys=_keys(root))


def _keys(root: Any) -> tuple[str, ...]:
    """The saved dict's top-level keys as text; a key nested too deep to print is named by its type."""
    if not isinstance(root, dict):
        return ()
    out = []
    for k in root:
        try:
            out.append(str(k))
        except RecursionError:
            out.append(f"<{type(k).__name__} nested too deep to print>")
    return tuple(out)


def _storage_ref(pid: Any) -> StorageRef | None:
    """torch's persistent id for a storage: ('storage', type, key, location, numel), plus a view record (always
    None since torch 1.0) in the legacy format."""
    if not (isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] == "storage"):
        return None
    _, stype, key, location, numel = pid[:5]
    sname = global_name(stype) or ""
    short = sname.rpartition(".")[2]
    dtype, itemsize = STORAGE_DTYPES.get(short, (None, 1))
    if short == "UntypedStorage":
        dtype = None
    if not isinstance(numel, int) or numel < 0:
        numel = 0
    return StorageRef(
        storage_type=short, dtype=dtype, itemsize=itemsize, key=str(key), location=str(location), numel=numel
    )


def _check_storages(
    archive: PtArchive, storages: dict[str, StorageRef], problems: list[Problem], notes: list[str]
) -> None:
    data = archive.data_entries
    for key, ref in sorted(storages.items(), key=lambda kv: _natural(kv[0])):
        entry = data.get(key)
        if entry is None:
            msg = f"storage {key} ({ref.numel} x {ref.storage_type}) has no zip entry data/{key}"
            problems.append(Problem("storage-size-mismatch", msg))
        elif ref.nbytes > entry.size:
            need = f"{ref.nbytes} bytes ({ref.numel} x {ref.itemsize})"
            msg = f"storage {key} needs {need} but data/{key} holds {entry.size}"
            problems.append(Problem("storage-size-mismatch", msg))
    for key in sorted(set(data) - set(storages), key=_natural):
        notes.append(f"zip entry data/{key} is referenced by no tensor in data.pkl")


def _natural(key: str) -> tuple[int, str]:
    return (int(key), "") if key.isdigit() else (1 << 62, key)


def read_zip_structure(fd: int, path: str, archive: PtArchive, *, base: int = 0) -> PtStructure:
    """read_pt_structure of a zip already opened at `fd` (`archive`), one that starts `base` bytes into the file (a
    `.distcp` item: `read_archive(fd, length, base=base)`); the result's entries carry absolute offsets."""
    if base:
        shifted = tuple(dataclasses.replace(e, header_offset=e.header_offset + base) for e in archive.entries)
        archive = PtArchive(  # built anew, not dataclasses.replace: that would copy its name index of the old entries
            file_size=archive.file_size,
            cd_offset=archive.cd_offset,
            cd_size=archive.cd_size,
            entries=shifted,
            prefix=archive.prefix,
            problems=archive.problems,
        )
    return _read_structure(fd, path, archive)
