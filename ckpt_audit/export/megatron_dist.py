"""Plan the export of a megatron-core `dist_checkpointing` directory (verl's `model/dist_ckpt`, or the old layout's
`dist_ckpt/`) to HF safetensors: which bytes of which `.distcp` make each HF tensor. No torch, no megatron-core.

`.metadata` (readers.dcp_metadata) names every saved chunk of every tensor: its global offsets and sizes, and the
byte range of the `.distcp` holding it. Each chunk is one `torch.save` zip there; its `data.pkl` (read by the
restricted unpickler, never run) gives the chunk's dtype, shape, strides and storage offset, and its stored `data/`
entry the bytes. An HF tensor (megatron_names: a megatron tensor at a fixed layer / expert, a set of rows) is then
cut from the chunks by their global offsets alone, so a checkpoint saved with any tensor / pipeline / expert /
data-parallel layout merges the same way: rows stacked where tensor parallelism split the rows (column-parallel
layers), pieces side by side where it split the columns (row-parallel layers). DCP stores each chunk once (replicas
are deduplicated at save), so nothing is read twice. The copy itself is stream_copy's: the same blocks, casts,
hashes and read-back as the FSDP export.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from ckpt_audit.export.megatron_names import Arch, NameMapError, Target, arch_of, problems, targets
from ckpt_audit.export.stream_plan import ITEMSIZE, Piece, Plan, Planned, StreamError, StreamUnsupported, c_strides
from ckpt_audit.readers import ptzip
from ckpt_audit.readers.dcp_metadata import DcpMetadata, read_metadata
from ckpt_audit.readers.pt import TensorInfo, read_zip_structure

KIND = "megatron-dist-ckpt"
_NOT_MODEL = ("optimizer.", "rng_state")  # the old layout keeps optimizer and RNG state in the same dist_ckpt/
_WRITER_RE = re.compile(r"__(\d+)_\d+\.distcp")
_OPEN_FILES = 64


def plan_dist_ckpt(dist: Path, config: dict) -> Plan:
    """The plan of HF tensors for the model in `dist` (a dist_checkpointing directory), named for `config`'s
    architecture. Raises StreamError with a one-line reason."""
    try:
        arch = arch_of(config)
    except NameMapError as exc:
        raise StreamError(str(exc)) from None
    try:
        meta = read_metadata(str(dist / ".metadata"))
    except OSError as exc:
        raise StreamError(f"{dist}/.metadata: cannot read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise StreamError(f"{dist}/.metadata: not DCP metadata ({exc})") from None
    keys = [k for k in meta.tensors if not k.startswith(_NOT_MODEL)]
    _check_tie(dist, keys, arch)
    if why := problems(set(keys), arch):
        raise StreamError(f"{dist}: {why[0]}")
    chunks = _Chunks(dist, meta)
    out: list[Planned] = []
    try:
        for key in sorted(keys, key=_model_order):
            size, _chunks, _dtype = meta.tensors[key]
            try:
                wanted = targets(key, tuple(size), arch)
            except NameMapError as exc:
                raise StreamError(f"{dist}: {exc}") from None
            out.extend(_planned(t, meta, chunks) for t in wanted)  # wanted: all of one key, in a row
    finally:
        chunks.close()
    writers = {int(m[1]) for f, _o, _n in meta.storage.values() if (m := _WRITER_RE.fullmatch(f))}
    planned = sorted(out, key=lambda t: _hf_order(t.name))
    return Plan(kind=KIND, world_size=max(writers) + 1 if writers else None, tensors=tuple(planned))


def _check_tie(dist: Path, keys: list[str], arch: Arch) -> None:
    """The config decides whether lm_head is its own tensor; the checkpoint must agree (megatron-core saves
    output_layer.weight exactly when the model did not share it with the embedding)."""
    has_head = "output_layer.weight" in keys
    if arch.tied and has_head:
        raise StreamError(
            f"{dist}: config.json ties the word embeddings but the checkpoint holds its own output_layer.weight "
            "(trained untied): exporting either way would change the model"
        )
    if not arch.tied and not has_head:
        raise StreamError(
            f"{dist}: config.json does not tie the word embeddings but the checkpoint holds no output_layer.weight "
            "(trained tied): set tie_word_embeddings in the config the export uses"
        )


def _model_order(key: str) -> tuple[int, str]:
    return ({"embedding.word_embeddings.weight": 0, "output_layer.weight": 2}.get(key, 1), key)


def _hf_order(name: str) -> tuple:
    """embed, layers in numeric order (experts too), norm, lm_head: the order HF checkpoints list them."""
    parts = name.split(".")
    key = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts)
    first = {"model.embed_tokens.weight": 0, "model.norm.weight": 2, "lm_head.weight": 3}.get(name, 1)
    return (first, key)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    path: str
    payload: int  # absolute offset of the chunk's storage bytes
    info: TensorInfo
    entry: ptzip.ZipEntry | None  # the storage's zip entry, absolute; None when the item records no CRCs


class _Chunks:
    """Each tensor's chunks, located in their `.distcp` (one zip directory and data.pkl read per chunk)."""

    def __init__(self, dist: Path, meta: DcpMetadata) -> None:
        self.dist, self.meta = dist, meta
        self.fds: dict[str, int] = {}
        self.last: tuple[str, list[_Chunk]] | None = None

    def of(self, key: str) -> list[_Chunk]:
        """Every chunk of `key`, located once: the HF tensors of one megatron tensor are planned one after another."""
        if self.last is not None and self.last[0] == key:
            return self.last[1]
        size, chunks, dtype = self.meta.tensors[key]
        out = []
        for c in chunks:
            where = self.meta.storage.get((key, tuple(c.offsets)))
            if where is None:
                raise StreamError(f"{self.dist}/.metadata: chunk {list(c.offsets)} of {key} has no storage entry")
            out.append(self._locate(key, c.offsets, c.sizes, where, dtype))
        self.last = (key, out)
        return out

    def _locate(self, key, offsets, sizes, where, dtype) -> _Chunk:
        rel, off, length = where
        path = str(self.dist / rel)
        fd = self.fds.pop(path, None)
        if fd is None:
            if len(self.fds) >= _OPEN_FILES:  # thousands of ranks' files: never run out of descriptors
                os.close(self.fds.pop(next(iter(self.fds))))
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise StreamError(f"{path}: cannot read ({exc.strerror or exc})") from None
        self.fds[path] = fd  # most recently used last
        what = f"{path}: the item of {key} at byte {off}"
        try:
            if off < 0 or length <= 0 or off + length > os.fstat(fd).st_size:
                raise StreamError(f"{what} lies outside the file")
            if os.pread(fd, 4, off) != ptzip.ZIP_MAGIC:
                raise StreamUnsupported(f"{what} is not a torch.save zip (a raw DCP serialisation)")
            archive = ptzip.read_archive(fd, length, base=off)
            s = read_zip_structure(fd, path, archive, base=off)
        except ptzip.ZipFormatError as exc:
            raise StreamError(f"{what}: {exc}") from None
        if s.unsafe_globals:  # what torch.load(weights_only=True) refuses too; nothing of it is ever run
            raise StreamError(f"{what} cannot load safely (it asks for {sorted(s.unsafe_globals)[0]})")
        if s.problems or len(s.tensors) != 1 or s.byteorder == "big":
            why = s.problems[0].message if s.problems else "not one little-endian tensor"
            raise StreamError(f"{what} is unreadable ({why})")
        info = s.tensors[0]
        want = str(dtype or "").removeprefix("torch.")
        if info.dtype not in ITEMSIZE or (want and info.dtype != want) or info.shape != tuple(sizes):
            raise StreamError(f"{what} holds a {info.dtype} {list(info.shape)}; .metadata says {want} {list(sizes)}")
        entry = archive.data_entries.get(info.storage_key or "")
        if entry is None or not entry.stored:
            raise StreamError(f"{what}: its storage is not a stored zip entry")
        entry = _absolute(entry, off)
        payload = ptzip.payload_offset(fd, entry)
        if archive.crc_disabled:  # saved with CRCs off: nothing to compare the copy against
            entry = None
        return _Chunk(offsets=tuple(offsets), sizes=tuple(sizes), path=path, payload=payload, info=info, entry=entry)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _absolute(e: ptzip.ZipEntry, base: int) -> ptzip.ZipEntry:
    return replace(e, header_offset=e.header_offset + base)


def _planned(t: Target, meta: DcpMetadata, chunks: _Chunks) -> Planned:
    """The pieces of one HF tensor, cut from the chunks of t.key by their global offsets."""
    size = tuple(meta.tensors[t.key][0])
    lead = len(t.index)
    shape = size[lead:]
    if len(shape) not in (1, 2):
        raise StreamUnsupported(f"{t.key}: a {len(shape)}-d tensor under its layer / expert indices")
    mine = [c for c in chunks.of(t.key) if all(o <= i < o + n for i, o, n in zip(t.index, c.offsets, c.sizes))]
    rows = t.rows if t.rows is not None else ((0, shape[0]),)
    dtype = mine[0].info.dtype if mine else ""
    if any(c.info.dtype != dtype for c in mine):
        raise StreamError(f"{t.key}: chunks of different dtypes")
    out_rows = sum(b - a for a, b in rows)
    out_shape = (out_rows, *shape[1:])
    full_cols = all(len(shape) == 1 or (c.offsets[lead + 1] == 0 and c.sizes[lead + 1] == shape[1]) for c in mine)
    if full_cols:
        pieces = []
        for a, b in rows:
            at = a
            for c in sorted(mine, key=lambda c: c.offsets[lead]):
                r0, n = c.offsets[lead], c.sizes[lead]
                lo, hi = max(at, r0), min(b, r0 + n)
                if hi <= lo:
                    continue
                if lo != at:
                    break
                pieces.append(_piece(c, t.index, lead, lo - r0, hi - lo))
                at = hi
            if at != b:
                raise StreamError(f"{t.key}: rows {at}..{b} of {t.name} are in no chunk of .metadata")
        return Planned(name=t.name, shape=out_shape, dtype=dtype, pieces=tuple(pieces), dim=0)
    whole_rows = rows == ((0, shape[0]),) and all(c.offsets[lead] == 0 and c.sizes[lead] == shape[0] for c in mine)
    if not whole_rows:
        raise StreamUnsupported(f"{t.key}: chunks split both rows and columns")
    pieces, at = [], 0
    for c in sorted(mine, key=lambda c: c.offsets[lead + 1]):
        if c.offsets[lead + 1] != at:
            raise StreamError(f"{t.key}: columns {at}.. of {t.name} are in no chunk of .metadata")
        pieces.append(_piece(c, t.index, lead, 0, shape[0]))
        at += c.sizes[lead + 1]
    if at != shape[1]:
        raise StreamError(f"{t.key}: columns {at}..{shape[1]} of {t.name} are in no chunk of .metadata")
    return Planned(name=t.name, shape=out_shape, dtype=dtype, pieces=tuple(pieces), dim=1)


def _piece(c: _Chunk, index: tuple[int, ...], lead: int, row: int, nrows: int) -> Piece:
    """Rows [row, row + nrows) of chunk `c` at the leading indices `index`, as a strided view of its bytes."""
    st = c.info.stride
    elem = c.info.storage_offset + sum((i - o) * s for i, o, s in zip(index, c.offsets, st)) + row * st[lead]
    shape = (nrows, *c.sizes[lead + 1 :])
    strides = tuple(st[lead:])
    item = ITEMSIZE[c.info.dtype]
    n = 1
    for s in shape:
        n *= s
    whole = c.entry is not None and elem == 0 and n * item == c.entry.size and strides == c_strides(shape)
    return Piece(
        path=c.path, offset=c.payload + elem * item, shape=shape, strides=strides, entry=c.entry if whole else None
    )
