"""The zip structure of a torch `.pt` file, read from its central directory without `zipfile`.

torch.save writes a zip of *stored* (uncompressed) entries, all under one top-level folder named for the file stem
at save time (`model_world_size_4_rank_0/data.pkl`, `.../data/0`, ...). Everything here costs a few small reads at
the file tail (plus one 30-byte local header per entry whose payload is wanted), never a pass over tensor data.
zipfile is avoided because it opens local headers one by one, raises on the first oddity and offers no CRC check
that can share the hashing pass.

No torch import: the scan path uses this module.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field, replace

from ckpt_audit.readers.problem import Problem

ZIP_MAGIC = b"PK\x03\x04"
_EOCD_SIG = b"PK\x05\x06"
_EOCD64_SIG = b"PK\x06\x06"
_EOCD64_LOC_SIG = b"PK\x06\x07"
_CDH_SIG = b"PK\x01\x02"
_EOCD_LEN = 22
_EOCD64_LOC_LEN = 20
_EOCD64_LEN = 56
_CDH_LEN = 46
LOCAL_HEADER_LEN = 30
_MAX_COMMENT = 0xFFFF
_MAX_CD_BYTES = 256 * 1024 * 1024  # a sane bound: a real torch .pt has ~100 bytes of directory per entry

# First bytes of the legacy (pre-1.6, `_use_new_zipfile_serialization=False`) torch format: a pickled magic number.
_LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


class ZipFormatError(ValueError):
    """The file is not a readable zip archive: `problem` is the finding code and its one-line message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.problem = Problem(code, message)


@dataclass(frozen=True, slots=True, kw_only=True)
class ZipEntry:
    """One entry of a zip's central directory: where its local header is, its sizes, CRC-32 and method."""

    name: str  # full name inside the archive, prefix included
    header_offset: int  # offset of the local file header
    compressed_size: int
    size: int  # uncompressed size; equals compressed_size for stored entries
    crc: int  # CRC-32 recorded in the central directory (0 for every entry when torch saved without CRC)
    method: int  # 0 stored, 8 deflate

    @property
    def stored(self) -> bool:
        return self.method == 0


@dataclass(frozen=True, slots=True, kw_only=True)
class PtArchive:
    """The central directory of one .pt zip, plus what torch's layout makes of it."""

    file_size: int
    cd_offset: int
    cd_size: int
    entries: tuple[ZipEntry, ...]
    prefix: str | None  # the common top-level folder (torch: the file stem at save time); None if entries disagree
    problems: tuple[Problem, ...] = ()  # structural oddities that do not stop reading (e.g. mixed prefixes)
    _by_name: dict[str, ZipEntry] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_name = self._by_name
        cut = len(self.prefix) + 1 if self.prefix is not None else 0
        for e in self.entries:
            by_name[e.name[cut:] if self.prefix is not None else e.name] = e

    def get(self, record: str) -> ZipEntry | None:
        """An entry by its name below the prefix, as torch names records: `data.pkl`, `data/0`, `version`."""
        return self._by_name.get(record)

    def has(self, record: str) -> bool:
        return record in self._by_name

    @property
    def records(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    @property
    def data_entries(self) -> dict[str, ZipEntry]:
        """Storage payloads keyed by storage key (`data/3` -> "3"), as the pickle's persistent ids name them."""
        return {name[5:]: e for name, e in self._by_name.items() if name.startswith("data/")}

    @property
    def has_data_pkl(self) -> bool:
        return self.has("data.pkl")

    @property
    def has_byteorder(self) -> bool:
        return self.has("byteorder")

    @property
    def has_version(self) -> bool:
        return self.has("version") or self.has(".data/version")

    @property
    def has_format_version(self) -> bool:
        return self.has(".format_version")

    @property
    def crc_disabled(self) -> bool:
        """True when every non-empty entry records CRC 0: torch saved with set_crc32_options(False)."""
        sized = [e for e in self.entries if e.size > 0]
        return bool(sized) and all(e.crc == 0 for e in sized)

    @property
    def torch_problems(self) -> tuple[Problem, ...]:
        """What a torch zip checkpoint must have and this one lacks (empty for a well-formed file)."""
        out = list(self.problems)
        if not self.has_data_pkl:
            out.append(Problem("not-a-torch-archive", "no data.pkl entry: not a torch.save archive"))
        if not self.has_version:
            out.append(Problem("not-a-torch-archive", "no version entry"))
        for e in self.entries:
            if not e.stored:
                out.append(
                    Problem(
                        "not-a-torch-archive",
                        f"entry {e.name} is compressed (method {e.method}); torch writes stored entries",
                    )
                )
                break
        return tuple(out)


def sniff(head: bytes) -> str:
    """Classify a file by its first bytes: 'zip', 'legacy-torch', 'pickle', 'empty' or 'other'.

    'pickle' is a raw pickle stream (pickle.dump, not torch.save): torch.load unpickles its first object while
    looking for the magic number, so what it names must be checked as any torch pickle is.
    """
    if not head:
        return "empty"
    if head.startswith(ZIP_MAGIC):
        return "zip"
    if head.startswith(_LEGACY_TORCH_MAGIC[: len(head)]) and len(head) >= 3:
        return "legacy-torch"
    if _PICKLE_HEAD_RE.match(head):
        return "pickle"
    return "other"


# PROTO 2-5 (what pickle.dump writes), or a protocol 0/1 stream opening on a GLOBAL `c<module>\n<name>\n`
_PICKLE_HEAD_RE = re.compile(rb"\x80[\x02-\x05]|c[A-Za-z_][\w.]{0,40}\n[A-Za-z_]")
SNIFF_BYTES = 64  # enough of the head for sniff() to tell a protocol 0 GLOBAL from garbage


def not_a_zip_problem(head: bytes, file_size: int) -> Problem:
    """Why a file expected to be a torch zip is not one, by what its first bytes are."""
    kind = sniff(head)
    if kind == "empty" or file_size == 0:
        return Problem("zero-byte", "empty file (0 bytes), not a zip archive")
    if kind == "legacy-torch":
        return Problem(
            "legacy-pickle-format",
            "legacy torch pickle format (not a zip archive); saved with _use_new_zipfile_serialization=False",
        )
    if kind == "pickle":
        return Problem(
            "raw-pickle",
            "raw pickle stream, not a torch.save file: torch.load unpickles it looking for a magic number",
        )
    return Problem("not-a-zip", f"not a zip archive (starts with {head[:4].hex() or 'nothing'})")


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.pread(fd, n - len(out), offset + len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def read_archive(fd: int, file_size: int | None = None, *, base: int = 0) -> PtArchive:
    """Parse the central directory of the zip open at `fd`. Raises ZipFormatError (one-line reason) or OSError.

    With `base`, the zip is the `file_size` bytes from there (one item of a .distcp: torch.save blobs back to back);
    every offset in the result is relative to `base`."""
    if file_size is None:
        file_size = os.fstat(fd).st_size - base
    head = _pread_exact(fd, 4, base)
    if not head.startswith(ZIP_MAGIC):
        problem = not_a_zip_problem(head, file_size)
        raise ZipFormatError(problem.code, problem.message)
    if file_size < _EOCD_LEN + LOCAL_HEADER_LEN:
        raise ZipFormatError("truncated", f"truncated: {file_size} bytes is too short for a zip archive")
    tail_len = min(file_size, _EOCD_LEN + _MAX_COMMENT + _EOCD64_LOC_LEN)
    tail_at = file_size - tail_len
    tail = _pread_exact(fd, tail_len, base + tail_at)
    if len(tail) < tail_len:
        raise ZipFormatError("truncated", "truncated: file shrank while its tail was read")
    eocd = _find_eocd(tail)
    if eocd < 0:
        raise ZipFormatError("truncated", "truncated or damaged: no end-of-central-directory record at the file tail")
    (_, disk, cd_disk, n_here, n_total, cd_size, cd_offset, _clen) = struct.unpack_from("<4sHHHHIIH", tail, eocd)
    if disk != 0 or cd_disk != 0 or n_here != n_total:
        raise ZipFormatError("bad-zip", "multi-disk zip archives are not torch checkpoints")
    n_entries = n_total
    eocd_abs = tail_at + eocd
    if n_total == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:
        n_entries, cd_size, cd_offset = _read_zip64_eocd(fd, tail, eocd, tail_at, file_size, base)
    if cd_offset + cd_size > file_size or cd_offset < 0:
        raise ZipFormatError(
            "truncated",
            f"truncated: central directory claims bytes {cd_offset}..{cd_offset + cd_size} of a {file_size}-byte file",
        )
    if cd_size > _MAX_CD_BYTES:
        raise ZipFormatError("bad-zip", f"implausible central directory of {cd_size} bytes")
    if cd_offset + cd_size > eocd_abs:
        raise ZipFormatError("bad-zip", "damaged: central directory overlaps its end record")
    cd = _pread_exact(fd, cd_size, base + cd_offset)
    if len(cd) < cd_size:
        raise ZipFormatError("truncated", "truncated: central directory cut short")
    entries = _parse_central_directory(cd, n_entries, cd_offset)
    problems: list[Problem] = []
    _check_extents(entries, cd_offset)
    prefix = _common_prefix(entries)
    if prefix is None and entries:
        # bad-pickle, as the scan has always reported it (torch.load takes the first entry's folder)
        problems.append(Problem("bad-pickle", "entries do not share one top-level folder"))
    names = [e.name for e in entries]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        # torch.save never repeats a name; which copy a reader takes is its own choice, so what the scan read
        # (the last) need not be what torch.load runs
        problems.append(
            Problem(
                "bad-zip", f"damaged: entry {dupes[0]} appears more than once (readers may disagree on which is read)"
            )
        )
    return PtArchive(
        file_size=file_size,
        cd_offset=cd_offset,
        cd_size=cd_size,
        entries=entries,
        prefix=prefix,
        problems=tuple(problems),
    )


MAX_CHAIN_ITEMS = 1 << 22


def read_item_chain(fd: int, file_size: int) -> PtArchive:
    """The zips of a file of torch.save blobs written back to back (a DCP `.distcp`), walked back from its end through
    each zip's end records (torch writes no comment, and zip64 records always), as one PtArchive whose entries carry
    file offsets and their item's start in the name (`@<offset>/archive/data/0`). Each item must be what torch.load
    accepts (directory, extents, one folder, data.pkl and version), as DCP's load reads every item with torch.load.

    Call it for a file that starts like a zip (DCP's raw serialisation does not): a chain that does not lead exactly
    back to byte 0 raises ZipFormatError `distcp-item-invalid` naming where it broke."""
    entries: list[ZipEntry] = []
    end = file_size
    for _ in range(MAX_CHAIN_ITEMS):
        if end == 0:
            entries.sort(key=lambda e: e.header_offset)
            return PtArchive(file_size=file_size, cd_offset=file_size, cd_size=0, entries=tuple(entries), prefix=None)
        tail_len = _EOCD_LEN + _EOCD64_LOC_LEN + _EOCD64_LEN
        if end < tail_len + LOCAL_HEADER_LEN:
            raise _item_error(end, "no torch.save end records before it")
        tail = _pread_exact(fd, tail_len, end - tail_len)
        rec, loc, eocd = 0, _EOCD64_LEN, _EOCD64_LEN + _EOCD64_LOC_LEN
        if tail[eocd : eocd + 4] != _EOCD_SIG or tail[loc : loc + 4] != _EOCD64_LOC_SIG or tail[:4] != _EOCD64_SIG:
            raise _item_error(end, "no torch.save end records before it (truncated or damaged)")
        if struct.unpack_from("<H", tail, eocd + 20)[0] != 0:
            raise _item_error(end, "a zip comment, which torch.save never writes")
        (_, _sz, _vm, _vn, _d, _cd_d, n_here, n_total, cd_size, cd_offset) = struct.unpack_from(
            "<4sQHHIIQQQQ", tail, rec
        )
        base = end - tail_len - cd_size - cd_offset  # the directory sits right before the zip64 end record
        if n_here != n_total or base < 0 or cd_size > _MAX_CD_BYTES:
            raise _item_error(end, "its end record points outside the file")
        cd = _pread_exact(fd, cd_size, base + cd_offset)
        try:
            found = _parse_central_directory(cd, n_total, cd_offset)
            _check_extents(found, cd_offset)
        except ZipFormatError as exc:
            raise _item_error(end, exc.problem.message) from None
        prefix = _common_prefix(found)
        if prefix is None:  # torch.load: "file in archive is not in a subdirectory"
            raise _item_error(end, "entries do not share one top-level folder")
        names = {e.name for e in found}
        for record in ("data.pkl", "version"):  # torch.load refuses an archive without them
            if f"{prefix}/{record}" not in names and f"{prefix}/.data/{record}" not in names:
                raise _item_error(end, f"no {record} record: not a torch.save archive")
        for e in found:
            entries.append(replace(e, name=f"@{base}/{e.name}", header_offset=base + e.header_offset))
        end = base
    raise _item_error(end, f"more than {MAX_CHAIN_ITEMS} items")


def _item_error(end: int, why: str) -> ZipFormatError:
    return ZipFormatError("distcp-item-invalid", f"the torch.save item ending at byte {end}: {why}")


def open_archive(path: str | os.PathLike[str]) -> PtArchive:
    """read_archive for a path. Raises ZipFormatError or OSError."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_archive(fd)
    finally:
        os.close(fd)


def payload_offset(fd: int, entry: ZipEntry) -> int:
    """Where the entry's bytes start: after its local header, whose name/extra lengths may differ from the CD's."""
    hdr = _pread_exact(fd, LOCAL_HEADER_LEN, entry.header_offset)
    return entry.header_offset + parse_local_header(hdr, entry.name)


def parse_local_header(hdr: bytes | bytearray | memoryview, name: str) -> int:
    """Length of a local header (fixed part + name + extra) from its first 30 bytes; ZipFormatError if not one."""
    if len(hdr) < LOCAL_HEADER_LEN:
        raise ZipFormatError("truncated", f"truncated: local header of {name} cut short")
    if bytes(hdr[:4]) != ZIP_MAGIC:
        raise ZipFormatError("bad-zip", f"damaged: no local header where the directory puts {name}")
    name_len, extra_len = struct.unpack_from("<HH", hdr, 26)
    return LOCAL_HEADER_LEN + name_len + extra_len


def local_header_mismatch(hdr: bytes | bytearray, entry: ZipEntry) -> str | None:
    """What a whole local header says differently from the entry's directory record (None: they agree). torch.load
    reads the directory and takes only the name and extra lengths from here; zip tools (Python's zipfile) refuse a
    name that differs. A size of 0xFFFFFFFF defers to the zip64 extra field, and flag bit 3 (sizes and CRC in a
    trailing descriptor) leaves them 0: neither is compared."""
    (_, _ver, flags, method, _t, _d, crc, csize, usize, nlen, _xlen) = struct.unpack_from("<4sHHHHHIIIHH", hdr, 0)
    name = bytes(hdr[LOCAL_HEADER_LEN : LOCAL_HEADER_LEN + nlen]).decode(
        "utf-8" if flags & 0x800 else "cp437", "replace"
    )
    expected = entry.name.partition("/")[2] if entry.name.startswith("@") else entry.name  # a chain's "@<item>/"
    if name != expected:
        return f"local header names it {name!r}"
    if method != entry.method:
        return f"method {method} (directory: {entry.method})"
    if flags & 0x8:
        return None
    if crc != entry.crc:
        return f"CRC-32 {crc:08x} (directory: {entry.crc:08x})"
    for what, local, central in (("stored size", csize, entry.compressed_size), ("size", usize, entry.size)):
        if local != 0xFFFFFFFF and local != central:
            return f"{what} {local} (directory: {central})"
    return None


def read_entry(fd: int, entry: ZipEntry, *, limit: int = 1 << 30) -> bytes:
    """The stored bytes of one entry (used for data.pkl and other small records). Raises ZipFormatError."""
    if not entry.stored:
        raise ZipFormatError(
            "not-a-torch-archive", f"entry {entry.name} is compressed (method {entry.method}); not a torch archive"
        )
    if entry.compressed_size > limit:
        raise ZipFormatError(
            "bad-pickle", f"entry {entry.name} is {entry.compressed_size} bytes, over the {limit}-byte limit"
        )
    at = payload_offset(fd, entry)
    data = _pread_exact(fd, entry.compressed_size, at)
    if len(data) < entry.compressed_size:
        raise ZipFormatError("truncated", f"truncated: entry {entry.name} cut short")
    return data


def _find_eocd(tail: bytes) -> int:
    # The last signature whose comment length reaches exactly to the end (a comment may contain the signature).
    pos = len(tail) - _EOCD_LEN
    while pos >= 0:
        pos = tail.rfind(_EOCD_SIG, 0, pos + 4)
        if pos < 0:
            return -1
        (clen,) = struct.unpack_from("<H", tail, pos + 20)
        if pos + _EOCD_LEN + clen == len(tail):
            return pos
        pos -= 1
    return -1


def _read_zip64_eocd(
    fd: int, tail: bytes, eocd: int, tail_at: int, file_size: int, base: int = 0
) -> tuple[int, int, int]:
    loc = eocd - _EOCD64_LOC_LEN
    if loc < 0 or tail[loc : loc + 4] != _EOCD64_LOC_SIG:
        raise ZipFormatError("bad-zip", "damaged: zip64 end record locator missing")
    (_, _disk, rec_off, _ndisks) = struct.unpack_from("<4sIQI", tail, loc)
    if rec_off + _EOCD64_LEN > file_size:
        raise ZipFormatError("truncated", "truncated: zip64 end record beyond the end of the file")
    rec = _pread_exact(fd, _EOCD64_LEN, base + rec_off)
    if len(rec) < _EOCD64_LEN or rec[:4] != _EOCD64_SIG:
        raise ZipFormatError("bad-zip", "damaged: zip64 end record missing")
    (_, _sz, _vm, _vn, _d, _cd_d, _n_here, n_total, cd_size, cd_offset) = struct.unpack_from("<4sQHHIIQQQQ", rec, 0)
    return n_total, cd_size, cd_offset


def _check_extents(entries: tuple[ZipEntry, ...], cd_offset: int) -> None:
    """Every entry (its local header, name and bytes) lies before the directory and clear of the next entry. torch's
    reader (miniz) refuses an entry that reaches past the archive; one overlapping another reads foreign bytes."""
    ordered = sorted(entries, key=lambda e: e.header_offset)
    for e, nxt in zip(ordered, [*ordered[1:], None]):
        end = e.header_offset + LOCAL_HEADER_LEN + len(e.name) + e.compressed_size  # len(name) <= its bytes
        if end > cd_offset:
            raise ZipFormatError("bad-zip", f"damaged: entry {e.name} extends into the central directory")
        if nxt is not None and end > nxt.header_offset:
            raise ZipFormatError("bad-zip", f"damaged: entry {e.name} overlaps entry {nxt.name}")


def _parse_central_directory(cd: bytes, n_entries: int, cd_offset: int) -> tuple[ZipEntry, ...]:
    entries = []
    pos = 0
    for i in range(n_entries):
        if pos + _CDH_LEN > len(cd) or cd[pos : pos + 4] != _CDH_SIG:
            raise ZipFormatError(
                "bad-zip", f"damaged: central directory entry {i} of {n_entries} is not where expected"
            )
        (_, _vm, _vn, flags, method, _t, _d, crc, csize, usize, nlen, xlen, clen, _dsk, _ia, _ea, hoff) = (
            struct.unpack_from("<4sHHHHHHIIIHHHHHII", cd, pos)
        )
        raw_name = cd[pos + _CDH_LEN : pos + _CDH_LEN + nlen]
        extra = cd[pos + _CDH_LEN + nlen : pos + _CDH_LEN + nlen + xlen]
        if pos + _CDH_LEN + nlen + xlen + clen > len(cd):
            raise ZipFormatError("bad-zip", f"damaged: central directory entry {i} runs past the directory")
        name = raw_name.decode("utf-8" if flags & 0x800 else "cp437", errors="replace")
        if csize == 0xFFFFFFFF or usize == 0xFFFFFFFF or hoff == 0xFFFFFFFF:
            usize, csize, hoff = _zip64_extra(extra, usize, csize, hoff, name)
        if method == 0 and csize != usize:  # miniz (torch.load) refuses the whole archive: "invalid header"
            raise ZipFormatError(
                "bad-zip", f"damaged: stored entry {name} records {csize} bytes stored but {usize} uncompressed"
            )
        if flags & 0x1:
            raise ZipFormatError("bad-zip", f"damaged: entry {name} is marked encrypted; torch.load refuses it")
        entries.append(
            ZipEntry(name=name, header_offset=hoff, compressed_size=csize, size=usize, crc=crc, method=method)
        )
        pos += _CDH_LEN + nlen + xlen + clen
    return tuple(entries)


def _zip64_extra(extra: bytes, usize: int, csize: int, hoff: int, name: str) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, ln = struct.unpack_from("<HH", extra, pos)
        if tag == 0x0001:
            body = extra[pos + 4 : pos + 4 + ln]
            vals = [v[0] for v in struct.iter_unpack("<Q", body[: len(body) // 8 * 8])]
            it = iter(vals)
            try:
                if usize == 0xFFFFFFFF:
                    usize = next(it)
                if csize == 0xFFFFFFFF:
                    csize = next(it)
                if hoff == 0xFFFFFFFF:
                    hoff = next(it)
            except StopIteration:
                raise ZipFormatError("bad-zip", f"damaged: zip64 extra field of {name} too short") from None
            return usize, csize, hoff
        pos += 4 + ln
    raise ZipFormatError("bad-zip", f"damaged: entry {name} needs a zip64 extra field and has none")


def _common_prefix(entries: tuple[ZipEntry, ...]) -> str | None:
    prefix = None
    for e in entries:
        top, sep, _ = e.name.partition("/")
        if not sep:
            return None
        if prefix is None:
            prefix = top
        elif top != prefix:
            return None
    return prefix
