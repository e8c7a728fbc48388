"""The stream engine's copy: a planned tensor's bytes as written (`tensor_bytes`), read from the sources a block at a
time, without torch.

A merged tensor is a byte copy: Shard(0) pieces follow one another, Shard(d>0) pieces are interleaved a block of rows
at a time, and a cast (bf16/fp16/fp32) is done by numpy on the same blocks. Where no cast is needed (every tensor of
an FSDP2 or Megatron checkpoint saved in the dtype exported) the pieces' bytes are read with preadv into one reused
1 MiB buffer, rows of a Shard(d>0) piece scattered to their places by the kernel, and numpy is never imported. A cast
reads each block with preadv too, into a fresh array (never a file mapping: a file cut under a mapping kills the
process with SIGBUS, a short read is one line). Memory is a fixed block budget whatever the model's size.

On the way, every storage entry copied whole is checked against the CRC-32 torch recorded for it (so the bytes
exported are the bytes the source check read).
"""

from __future__ import annotations

import mmap
import os
import sys
from collections.abc import Iterator

from ckpt_audit.export.stream_plan import ITEMSIZE, Piece, Planned, StreamError, contiguous, numel

try:  # isal's crc32 runs ~4x faster than the system zlib's (bench/README.md, bench_hash)
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a declared dependency
    from zlib import crc32 as _crc32


# bytes per block: the memory budget is a few of these, never a tensor. 1 MiB: writes of 2 MiB and more into the page
# cache ran 2-5x slower here at random (ext4 large folios: bench/README.md), and a block stays in the CPU's cache
# from the read through the CRC, both hashes and the write
BLOCK = 1024 * 1024
_IOV_MAX = 1024  # iovecs one preadv takes (Linux's UIO_MAXIOV)
# numpy has no bfloat16 or float8: their bits travel as unsigned ints of the same width
_NUMPY = {
    "float64": "<f8",
    "float32": "<f4",
    "float16": "<f2",
    "bfloat16": "<u2",
    "int64": "<i8",
    "int32": "<i4",
    "int16": "<i2",
    "int8": "i1",
    "uint8": "u1",
    "bool": "?",
    "float8_e4m3fn": "u1",
    "float8_e5m2": "u1",
}


def _numpy():
    """numpy, imported on first use. Export uses it for casts and row gathers only, never BLAS, so OpenBLAS is asked
    for one thread unless the user chose: its per-core thread pool made `import numpy` 0.4 s wall, 0.22 s CPU
    instead of 0.21 and 0.16 here (bench/README.md, issue 16, fourth round). Once numpy is loaded this changes
    nothing."""
    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import numpy

    return numpy


def tensor_bytes(t: Planned, dst: str, maps: Maps, crcs: dict[int, int] | None = None) -> Iterator[memoryview]:
    """The bytes of tensor `t` as written in dtype `dst`, a block at a time; each block is valid until the next is
    asked for. `crcs` (piece index -> running CRC-32): the pieces whose storage CRC is computed on the way."""
    crcs = {} if crcs is None else crcs
    if (runs := _runs(t, dst)) is not None:  # the output is runs of the pieces' bytes: no numpy (~0.2 s to import)
        yield from _gather(t, *runs, maps, crcs)
        return
    np = _numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        for block, sources in _blocks(t, maps):
            for i, src in sources:
                if i in crcs:
                    crcs[i] = _crc32(_bytes(src), crcs[i])
            yield _bytes(np.ascontiguousarray(_cast(block, t.dtype, dst)))


class Maps:
    """The source files, each opened once: a descriptor for preadv, and one buffer for _gather."""

    def __init__(self) -> None:
        self.crc_off: dict[str, bool] = {}
        self.fds: dict[str, int] = {}
        self.sizes: dict[str, int] = {}
        self.buf: memoryview | None = None

    def __enter__(self) -> Maps:
        return self

    def __exit__(self, *exc) -> None:
        for fd in self.fds.values():
            os.close(fd)

    def buffer(self) -> memoryview:
        """The one BLOCK-sized buffer _gather reads into (anonymous memory, made once)."""
        if self.buf is None:
            self.buf = memoryview(mmap.mmap(-1, BLOCK))
        return self.buf

    def fd(self, p: Piece, nbytes: int) -> int:
        """A read descriptor of p.path (opened once), after checking that `nbytes` from p.offset lie in the file."""
        fd = self.fds.get(p.path)
        if fd is None:
            fd = self.fds[p.path] = os.open(p.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            self.sizes[p.path] = os.fstat(fd).st_size
        if p.offset < 0 or p.offset + nbytes > self.sizes[p.path]:
            raise StreamError(f"{p.path}: a tensor's bytes lie outside the file")
        return fd

    def read(self, p: Piece, fd: int, views: list[memoryview], pos: int) -> None:
        """Fill `views` with the file's bytes from `pos` on, in order (preadv, IOV_MAX views a call). The range was
        inside the file when it was opened: a short read is a file cut under the export."""
        for c in range(0, len(views), _IOV_MAX):
            part = views[c : c + _IOV_MAX]
            want = sum(len(v) for v in part)
            if os.preadv(fd, part, pos) != want:
                raise StreamError(f"{p.path}: ends early (truncated while it was exported?)")
            pos += want

    def crc_recorded(self, path: str) -> bool:
        """False when torch saved this file with CRCs disabled (every entry's CRC is 0). A `.distcp` is many zips:
        its planner (export_megatron) gives a piece its entry only when that piece's own zip records CRCs."""
        if path.endswith(".distcp"):
            return True
        if path not in self.crc_off:
            from ckpt_audit.readers.ptzip import open_archive

            self.crc_off[path] = not open_archive(path).crc_disabled
        return self.crc_off[path]

    def rows(self, p: Piece, dtype: str, shape: tuple[int, ...], strides: tuple[int, ...], r0: int, r1: int):
        """Rows [r0, r1) of p seen as `shape`/`strides` (elements; p's own, or flattened), read into a new array."""
        np = _numpy()

        item = ITEMSIZE[dtype]
        strides = tuple(s * item for s in strides)
        part = (r1 - r0, *shape[1:])
        buf = np.empty(_extent(part, strides, item), np.uint8)
        fd = self.fd(p, _extent(shape, strides, item))
        if buf.size:
            self.read(p, fd, [memoryview(buf)], p.offset + r0 * strides[0])
        return np.ndarray(part, dtype=np.dtype(_NUMPY[dtype]), buffer=buf, strides=strides)


def _extent(shape: tuple[int, ...], strides: tuple[int, ...], item: int) -> int:
    """Bytes from an array's first element to the end of its last (strides in bytes)."""
    if 0 in shape:
        return 0
    return item + sum((n - 1) * s for n, s in zip(shape, strides))


def _runs(t: Planned, dst: str) -> tuple[int, list[int]] | None:
    """(outer, run bytes of each piece) when the output is, for each of `outer` indices before the join dim, each
    piece's next `run` bytes in turn: no cast and every piece in C order. Dim 0 (FSDP2 shards every parameter on
    it) and one piece: outer 1, each piece whole. Dim 1 (Megatron's row-parallel layers): a row of each piece in
    turn. None: numpy's path."""
    if dst != t.dtype or not all(contiguous(p.shape, p.strides) for p in t.pieces):
        return None
    d = t.dim or 0
    outer = numel(t.shape[:d])
    if any(numel(p.shape[:d]) != outer for p in t.pieces):
        return None
    return outer, [numel(p.shape[d:]) * ITEMSIZE[t.dtype] for p in t.pieces]


def _gather(t: Planned, outer: int, runs: list[int], maps: Maps, crcs: dict[int, int]) -> Iterator[memoryview]:
    """tensor_bytes for a tensor `_runs` describes: read with preadv into one reused buffer, a piece's runs of a block
    scattered into their places in one call, then CRC'd, hashed and written from there. No mapping of the source
    (its page faults and MADV_DONTNEED cost more than the copy pread makes) and the same bytes for all three."""
    row = sum(runs)
    buf = maps.buffer()
    fds = [maps.fd(p, outer * n) for p, n in zip(t.pieces, runs)]
    if outer > 1 and row <= len(buf):  # several outer indices a block: each piece's rows scattered in one call
        step = len(buf) // row
        for o in range(0, outer, step):
            k = min(step, outer - o)
            at = 0
            for i, (p, n) in enumerate(zip(t.pieces, runs)):
                if n:
                    iov = [buf[j * row + at : j * row + at + n] for j in range(k)]
                    maps.read(p, fds[i], iov, p.offset + o * n)
                    if i in crcs:
                        for v in iov:
                            crcs[i] = _crc32(v, crcs[i])
                at += n
            yield buf[: k * row]
        return
    for o in range(outer):  # a run at a time, a buffer at a time
        for i, (p, n) in enumerate(zip(t.pieces, runs)):
            for s in range(0, n, len(buf)):
                view = buf[: min(len(buf), n - s)]
                maps.read(p, fds[i], [view], p.offset + o * n + s)
                if i in crcs:
                    crcs[i] = _crc32(view, crcs[i])
                yield view


def _rows(p: Piece, dtype: str, maps: Maps) -> Iterator[object]:
    """p's elements in C order, blocks of about BLOCK bytes: a C-contiguous piece cut anywhere (flattened first),
    another along dim 0."""
    shape, strides = p.shape, p.strides
    if not shape or contiguous(shape, strides):
        shape, strides = (numel(shape),), (1,)
    step = max(1, BLOCK // max(1, numel(shape[1:]) * ITEMSIZE[dtype]))
    for r in range(0, shape[0], step):
        yield maps.rows(p, dtype, shape, strides, r, min(r + step, shape[0]))


def _blocks(t: Planned, maps: Maps) -> Iterator[tuple[object, list[tuple[int, object]]]]:
    """(block in the source dtype, [(piece index, the source rows it came from)]) in output byte order."""
    np = _numpy()

    if t.dim is None or t.dim == 0:
        for i, p in enumerate(t.pieces):
            for b in _rows(p, t.dtype, maps):
                yield b, [(i, b)]
        return
    live = [(i, p) for i, p in enumerate(t.pieces) if numel(p.shape)]
    if not live:
        return
    rows = live[0][1].shape[0]
    row_bytes = sum(numel(p.shape[1:]) for _i, p in live) * ITEMSIZE[t.dtype] or 1
    step = max(1, BLOCK // row_bytes)
    for r in range(0, rows, step):
        parts = [(i, maps.rows(p, t.dtype, p.shape, p.strides, r, min(r + step, rows))) for i, p in live]
        yield np.concatenate([b for _i, b in parts], axis=t.dim), parts


def _bytes(a) -> memoryview:
    np = _numpy()

    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def _cast(a, src: str, dst: str):
    """torch's `.to(dst)` on `a` (bfloat16 as uint16 bits), bit for bit: round to nearest even through float32."""
    np = _numpy()

    if src == dst:
        return a
    if src == "bfloat16":
        f = (a.astype(np.uint32) << 16).view(np.float32)
    else:
        f = a.astype(np.float32)
    if dst == "float32":
        return f
    nan = np.isnan(f)
    if dst == "float16":
        h = f.astype(np.float16).view(np.uint16)
        h[nan] |= 0x200  # torch quiets a NaN; numpy keeps a signalling payload
        return h
    u = f.view(np.uint32)
    b = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    b[nan] = 0xFFFF  # torch's vectorised CPU cast writes all-ones for NaN
    return b


def same_bytes(a: Piece, b: Piece, dtype: str, maps: Maps | None = None) -> bool:
    """Bit for bit (NaN equals itself, -0.0 differs from 0.0), a block at a time."""
    np = _numpy()

    if maps is None:
        with Maps() as own:
            return same_bytes(a, b, dtype, own)
    if a.shape != b.shape:
        return False
    for x, y in zip(_rows(a, dtype, maps), _rows(b, dtype, maps)):
        if not np.array_equal(np.frombuffer(_bytes(x), np.uint8), np.frombuffer(_bytes(y), np.uint8)):
            return False
    return True


def same_tensor(a: Planned, b: Planned, maps: Maps) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.dim != b.dim or len(a.pieces) != len(b.pieces):
        return False
    return all(same_bytes(pa, pb, a.dtype, maps) for pa, pb in zip(a.pieces, b.pieces))
