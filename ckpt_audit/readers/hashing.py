"""One streaming read per file: xxh3-128 of the bytes plus the CRC-32 of every entry of a torch `.pt` zip.

torch.load never checks the CRCs that torch.save records, so a flipped bit in a checkpoint without a manifest goes
unnoticed until training diverges. Checking them costs one more pass over bytes already in cache: each chunk is read
once (readinto a reused per-thread buffer, so a file truncated under us is a short read, not a SIGBUS; large files
unmodified for minutes are mapped instead, saving the copy: see _mappable) and fed first to xxh3 and then to the CRC
of whichever entry payloads the slice covers. Both release the GIL, so two worker threads use both cores. A file
read alone whose next bytes are not cached is asked for ahead of the hashing (_ReadAhead), so the disk does not wait
for the CPU. See docs/readers.md and bench/README.md for the measured figures.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import threading
import zlib
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass

import xxhash

from ckpt_audit.readers.pool import map_unordered
from ckpt_audit.readers.problem import Problem
from ckpt_audit.readers.ptzip import (
    LOCAL_HEADER_LEN,
    SNIFF_BYTES,
    ZIP_MAGIC,
    PtArchive,
    ZipEntry,
    ZipFormatError,
    local_header_mismatch,
    not_a_zip_problem,
    parse_local_header,
    read_archive,
    read_item_chain,
    sniff,
)

try:  # isal's crc32 runs ~4x faster than the system zlib's here (bench/README.md, bench_hash)
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a declared dependency
    _crc32 = zlib.crc32

CHUNK = 1024 * 1024  # read size: 0.5-2 MiB were fastest for read+hash+CRC here (docs/readers.md); 8 MiB is slower
ZIP_SUFFIXES = (".pt", ".pth")  # files expected to be torch zips: anything else is a zip only if it says so

_local = threading.local()


@dataclass(frozen=True, slots=True, kw_only=True)
class FileDigest:
    """What one read of a file found: its xxh3-128, the CRC-32 verdict of its zip entries, the stat at open."""

    hash: str  # xxh3-128, 32 hex digits, of the bytes actually read
    size_bytes: int  # bytes read
    crc_ok: bool | None  # None: not a zip, unreadable zip, or CRCs disabled at save (all zero)
    crc_bad_entries: tuple[str, ...] = ()  # entry names (prefix included) whose CRC-32 does not match
    zip_error: Problem | None = None  # why the zip structure is unusable, as a finding code (the hash is still valid)
    is_zip: bool = False  # the file starts like a zip archive
    kind: str = "other"  # ptzip.sniff of the first bytes: zip, legacy-torch, pickle, empty, other
    prefix: str | None = None  # top-level folder inside the zip (torch: the stem at save time)
    entries_checked: int = 0  # zip entries whose CRC was compared
    crc_disabled: bool = False  # every CRC field is 0: saved with torch.serialization.set_crc32_options(False)
    changed_during_read: bool = False  # size or mtime moved while reading: the digest describes no stable file
    local_header_mismatch: tuple[str, ...] = ()  # "name: field" where a local header disagrees with the directory
    item_pickles: tuple[tuple[str, bytes | None], ...] = ()  # a .distcp's (entry name, data.pkl bytes), this pass
    mtime_ns: int = 0  # from fstat at open, so callers can record the stat the hash belongs to
    inode: int = 0
    stat_size: int = 0  # st_size at open
    # the whole file's checksums as object stores record them ("crc32c" -> base64 of the big-endian value, as S3's
    # x-amz-checksum-* headers give them); empty unless asked for (store_checksums)
    checksums: tuple[tuple[str, str], ...] = ()


def _buffer() -> memoryview:
    # An anonymous mmap is page-aligned. A bytearray's start is wherever malloc puts it, and a read() into a
    # destination that is not 64-byte aligned ran ~4x slower here (1.8 vs 7-8 GB/s warm; docs/readers.md).
    mv = getattr(_local, "mv", None)
    if mv is None or len(mv) != CHUNK:
        buf = mmap.mmap(-1, CHUNK)
        buf.write(b"\0" * CHUNK)  # fault the pages in once, outside any timed read
        mv = _local.mv = memoryview(buf)
    return mv


class _CrcChecker:
    """Checks entry CRCs as the file streams past. Entries are visited in offset order; each local header is parsed
    from the stream itself (its name/extra lengths can differ from the central directory's, and torch.load takes
    them from there too), so no extra reads. Each local header is compared with its directory record as it passes
    (`mismatched`), and with `keep_pickles` the bytes of each `data.pkl` are kept as they pass (`pickles`: a .distcp's
    items, which the scan unpickles restricted without reading them again)."""

    __slots__ = (
        "entries", "idx", "hdr", "hlen", "start", "end", "crc", "bad", "checked", "error", "crcs", "mismatched",
        "keep", "pickles", "kept",
    )  # fmt: skip

    def __init__(self, archive: PtArchive, *, crcs: bool = True, keep_pickles: bool = False) -> None:
        self.entries: list[ZipEntry] = sorted((e for e in archive.entries if e.stored), key=lambda e: e.header_offset)
        self.idx = 0
        self.hdr = bytearray()
        self.hlen = 0  # length of the current entry's local header, name and extra field
        self.start = -1  # payload start of the current entry, -1 while its header is pending
        self.end = -1
        self.crc = 0
        self.bad: list[str] = []
        self.checked = 0
        self.error: Problem | None = None
        self.crcs = crcs  # False: CRCs disabled at save, or not wanted; headers are still compared
        self.mismatched: list[str] = []  # "name: field" where a local header disagrees with the directory
        self.keep = keep_pickles
        self.pickles: list[tuple[str, bytes | None]] = []  # (entry name, data.pkl bytes; None: over the bound)
        self.kept = bytearray()

    def feed(self, pos: int, mv: memoryview) -> None:
        end_of_chunk = pos + len(mv)
        entries = self.entries
        while self.idx < len(entries):
            e = entries[self.idx]
            if self.start < 0:
                have = e.header_offset + len(self.hdr)
                if have >= end_of_chunk:
                    return
                if have < pos:  # header precedes this chunk and was never seen: entries overlap
                    self.error = Problem("bad-zip", f"damaged: entry {e.name} overlaps the previous entry")
                    self.idx = len(entries)
                    return
                have_hdr = len(self.hdr)
                want = LOCAL_HEADER_LEN if have_hdr < LOCAL_HEADER_LEN else self.hlen
                take = min(want - have_hdr, end_of_chunk - have)
                self.hdr += mv[have - pos : have - pos + take]
                if len(self.hdr) < LOCAL_HEADER_LEN:
                    return
                if have_hdr < LOCAL_HEADER_LEN:
                    try:
                        self.hlen = parse_local_header(self.hdr, e.name)
                    except ZipFormatError as exc:
                        self.error = exc.problem
                        self.idx = len(entries)
                        return
                length = self.hlen
                if len(self.hdr) < length:  # the name and extra field: compared with the directory below
                    continue
                if why := local_header_mismatch(self.hdr, e):
                    self.mismatched.append(f"{e.name}: {why}")
                self.start = e.header_offset + length
                self.end = self.start + e.compressed_size
                self.crc = 0
            lo = max(self.start, pos)
            hi = min(self.end, end_of_chunk)
            if lo < hi:
                if self.crcs:
                    self.crc = _crc32(mv[lo - pos : hi - pos], self.crc)
                if self.keep and e.name.endswith("/data.pkl") and e.compressed_size <= MAX_KEPT_PICKLE:
                    self.kept += mv[lo - pos : hi - pos]
            if self.end > end_of_chunk:
                return
            self.checked += 1
            if self.crcs and (self.crc & 0xFFFFFFFF) != e.crc:
                self.bad.append(e.name)
            if self.keep and e.name.endswith("/data.pkl"):
                self.pickles.append((e.name, bytes(self.kept) if e.compressed_size <= MAX_KEPT_PICKLE else None))
                self.kept.clear()
            self.idx += 1
            self.start = self.end = -1
            self.hdr.clear()

    def finish(self) -> None:
        if self.error is None and self.idx < len(self.entries):
            name = self.entries[self.idx].name
            self.error = Problem("truncated", f"truncated: entry {name} ends past the end of the file")


MAX_KEPT_PICKLE = 64 * 1024 * 1024  # a .distcp item's data.pkl kept for the restricted unpickler (DCP's are ~100 B)

ZipCrcChecker = _CrcChecker  # the public name: readers.distcp_items checks each zip inside a .distcp with it


def digest_file(
    path: str | os.PathLike[str],
    *,
    expect_zip: bool | None = None,
    check_crc: bool = True,
    store_checksums: bool | None = None,
) -> FileDigest:
    """Hash `path` in one read and check its zip CRCs. Raises OSError (missing, unreadable, a directory).

    expect_zip: whether a non-zip should be reported as zip_error; default: the name ends in .pt/.pth.
    check_crc: False skips the CRC pass (crc_ok stays None); the zip structure is still parsed.
    store_checksums: also the whole file's CRC-32, CRC-32C and CRC-64/NVME (StoreSums); default: as
    `store_checksums_enabled()` says (scan --store-checksums).
    """
    fspath = os.fspath(path)
    if expect_zip is None:
        expect_zip = str(fspath).endswith(ZIP_SUFFIXES)
    # O_NONBLOCK: opening a FIFO must not wait for a writer (regular-file reads ignore the flag)
    fd = os.open(fspath, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", fspath)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", fspath)
        head = os.pread(fd, SNIFF_BYTES, 0)
        is_zip = head.startswith(ZIP_MAGIC)
        archive: PtArchive | None = None
        zip_error: Problem | None = None
        chain = fspath.endswith(".distcp")
        if is_zip:
            try:
                # a .distcp is many small zips back to back: each item's CRCs, and its data.pkl for the scan
                archive = read_item_chain(fd, st.st_size) if chain else read_archive(fd, st.st_size)
            except ZipFormatError as exc:
                zip_error = exc.problem
        elif expect_zip:
            zip_error = not_a_zip_problem(head, st.st_size)
        crc_wanted = check_crc and archive is not None and not archive.crc_disabled
        checker = _CrcChecker(archive, crcs=crc_wanted, keep_pickles=chain) if archive is not None else None
        sums = StoreSums() if (_STORE_SUMS[0] if store_checksums is None else store_checksums) else None
        _streaming(+1)
        try:
            if _mappable(st):
                digest, nread = _stream_mapped(fd, checker, st.st_size, sums)
            else:
                digest, nread = _stream(fd, checker, st.st_size, sums)
        finally:
            _streaming(-1)
        st_end = os.fstat(fd)
    finally:
        os.close(fd)
    changed = nread != st.st_size or st_end.st_size != st.st_size or st_end.st_mtime_ns != st.st_mtime_ns
    crc_ok: bool | None = None
    bad: tuple[str, ...] = ()
    checked = 0
    mismatched: tuple[str, ...] = ()
    pickles: tuple[tuple[str, bytes | None], ...] = ()
    if checker is not None:
        checker.finish()
        if checker.error is not None:
            zip_error = checker.error
        mismatched, pickles = tuple(checker.mismatched), tuple(checker.pickles)
        if crc_wanted:
            bad = tuple(checker.bad)
            checked = checker.checked
            crc_ok = None if zip_error is not None and not bad else not bad
    return FileDigest(
        hash=digest,
        size_bytes=nread,
        crc_ok=crc_ok,
        crc_bad_entries=bad,
        zip_error=zip_error,
        is_zip=is_zip,
        kind=sniff(head),
        prefix=archive.prefix if archive is not None else None,
        entries_checked=checked,
        crc_disabled=archive.crc_disabled if archive is not None else False,
        changed_during_read=changed,
        local_header_mismatch=mismatched,
        item_pickles=pickles,
        mtime_ns=st.st_mtime_ns,
        inode=st.st_ino,
        stat_size=st.st_size,
        checksums=sums.values() if sums is not None and not changed else (),
    )


_STORE_SUMS = [False]  # scan --store-checksums sets it for the command (the readers run on pool threads)


@contextlib.contextmanager
def store_checksums_on(on: bool = True) -> Iterator[None]:
    """While inside, every digest_file of this process also computes the object stores' checksums (StoreSums)."""
    was, _STORE_SUMS[0] = _STORE_SUMS[0], on
    try:
        yield
    finally:
        _STORE_SUMS[0] = was


def store_checksums_enabled() -> bool:
    return _STORE_SUMS[0]


class StoreSums:
    """The whole-file checksums S3 and GCS record at upload, fed the same chunks as xxh3: CRC-32 (boto3's default),
    CRC-32C (GCS, S3) and CRC-64/NVME (S3's default full-object checksum). awscrt's are imported here, on the first
    file, not at start-up (~45 ms); without awscrt (the `s3` extra) only CRC-32 is kept."""

    __slots__ = ("crc32", "crc32c", "crc64", "_c")

    def __init__(self) -> None:
        try:
            from awscrt import checksums
        except ImportError:
            checksums = None
        self._c = checksums
        self.crc32 = self.crc32c = self.crc64 = 0

    def feed(self, mv: memoryview) -> None:
        self.crc32 = _crc32(mv, self.crc32)
        if self._c is not None:
            self.crc32c = self._c.crc32c(mv, self.crc32c)
            self.crc64 = self._c.crc64nvme(mv, self.crc64)

    def values(self) -> tuple[tuple[str, str], ...]:
        out = [("crc32", _b64(self.crc32, 4))]
        if self._c is not None:
            out += [("crc32c", _b64(self.crc32c, 4)), ("crc64nvme", _b64(self.crc64, 8))]
        return tuple(out)


def _b64(value: int, n: int) -> str:
    import base64

    return base64.b64encode((value & ((1 << (8 * n)) - 1)).to_bytes(n, "big")).decode()


MAP_MIN_BYTES = 64 * 1024 * 1024  # below this a mapping's set-up costs more than the copy it saves
MAP_MIN_AGE_S = 120  # a file written this recently may be rewritten (truncated) under us: read() it instead
MAP_SLICE = 8 * 1024 * 1024
MAP_DROP = 16 * 1024 * 1024  # pages hashed are dropped from this process every this many bytes (its RSS bound)


def _mappable(st: os.stat_result) -> bool:
    """Hash large settled files through a read-only mapping: no copy into a buffer, so xxh3 and CRC-32 together keep
    up with `cat` where the CPU lacks AVX-512 (readinto: 0.83x, mapped: 1.01x on 2 threads; bench/README.md). A file
    truncated while mapped would raise SIGBUS, so only files unmodified for MAP_MIN_AGE_S are mapped."""
    import time

    return st.st_size >= MAP_MIN_BYTES and time.time() - st.st_mtime >= MAP_MIN_AGE_S and hasattr(mmap, "MADV_DONTNEED")


def _stream_mapped(fd: int, checker: _CrcChecker | None, size: int, sums: StoreSums | None) -> tuple[str, int]:
    m = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    try:
        m.madvise(mmap.MADV_SEQUENTIAL)
        mv = memoryview(m)
        h = xxhash.xxh3_128()
        ahead = _ReadAhead(fd, size)
        for pos in range(0, size, MAP_SLICE):
            ahead.at(pos)
            piece = mv[pos : pos + MAP_SLICE]
            h.update(piece)
            if checker is not None:
                checker.feed(pos, piece)
            if sums is not None:
                sums.feed(piece)
            n = len(piece)
            piece.release()
            done = pos + n
            if done % MAP_DROP == 0 or done == size:  # keep the process's RSS flat, in a few calls
                m.madvise(mmap.MADV_DONTNEED, done - ((done - 1) % MAP_DROP + 1), (done - 1) % MAP_DROP + 1)
        mv.release()
    finally:
        m.close()
    return h.hexdigest(), size


_streams = 0  # files being streamed by this process's threads
_streams_lock = threading.Lock()


def _streaming(delta: int) -> None:
    global _streams
    with _streams_lock:
        _streams += delta


AHEAD = 2 * MAP_SLICE  # cold data: how far past the bytes being hashed the kernel is asked to read


class _ReadAhead:
    """Keeps the disk busy while the CPU hashes a cold file: each MAP_SLICE window AHEAD bytes past the hashing is
    asked for with POSIX_FADV_WILLNEED, which starts the reads and returns. The kernel's own readahead left the disk
    idle while xxh3 and the CRC ran (cold, one file at a time: ~2x the speed without it; bench/README.md). Advising
    cached pages costs ~0.12 ms per 8 MiB, ~9 % of hashing them warm, so a window whose last byte reads without
    waiting (RWF_NOWAIT) is taken as cached and left alone."""

    __slots__ = ("fd", "size", "next", "probe", "advised")

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.next = 0  # start of the first window not yet looked at
        self.probe: bytearray | None = bytearray(1) if hasattr(os, "RWF_NOWAIT") else None
        self.advised = 0  # windows asked for (the tests count them)

    def at(self, pos: int) -> None:
        if _streams > 1:  # two streams kept the disk busy already: the extra, smaller requests only slowed them
            return
        while self.next <= pos + AHEAD and self.next < self.size:
            lo, self.next = self.next, min(self.next + MAP_SLICE, self.size)
            if not self._cached(self.next - 1):
                try:
                    os.posix_fadvise(self.fd, lo, self.next - lo, os.POSIX_FADV_WILLNEED)
                    self.advised += 1
                except (AttributeError, OSError):  # a hint only: without it the kernel's readahead still reads
                    self.next = self.size

    def _cached(self, off: int) -> bool:
        if self.probe is None:
            return False
        try:
            return os.preadv(self.fd, [self.probe], off, os.RWF_NOWAIT) >= 0
        except BlockingIOError:
            return False
        except OSError:  # RWF_NOWAIT unsupported here (some network file systems): advise every window
            self.probe = None
            return False


def _stream(fd: int, checker: _CrcChecker | None, size: int, sums: StoreSums | None) -> tuple[str, int]:
    try:  # a hint for the kernel's readahead; harmless where unsupported
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    except (AttributeError, OSError):
        pass
    mv = _buffer()
    h = xxhash.xxh3_128()
    pos = 0
    bufs = [mv]
    ahead = _ReadAhead(fd, size)
    while True:
        ahead.at(pos)
        k = os.readv(fd, bufs)
        if not k:
            break
        piece = mv[:k]
        h.update(piece)
        if checker is not None:
            checker.feed(pos, piece)  # the CRC pass finds the chunk still in cache
        if sums is not None:
            sums.feed(piece)
        pos += k
    return h.hexdigest(), pos


def digest_files(
    paths: Iterable[str | os.PathLike[str]], *, workers: int = 2, check_crc: bool = True
) -> Generator[tuple[str, FileDigest | OSError], None, None]:
    """digest_file over the file thread pool (pool.map_unordered), yielding (path, digest or the OSError) as each
    file completes.

    Largest files go first (one stat each, 2 us): a big shard started last would leave one worker idle while it
    finishes.
    """
    order = sorted((os.fspath(p) for p in paths), key=_size_or_zero, reverse=True)

    def read(path: str) -> FileDigest | OSError:
        try:
            return digest_file(path, check_crc=check_crc)
        except OSError as exc:
            return exc

    yield from map_unordered(read, order, workers=workers, name="ckpt-hash")


def _size_or_zero(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1  # unreadable: last, its error is reported when its turn comes
