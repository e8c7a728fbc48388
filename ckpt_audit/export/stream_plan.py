"""What the stream engine copies: a Plan names, for each output tensor, the pieces of source files its bytes lie in.

torch.save writes every storage as a stored (uncompressed) zip entry, and readers.pt reads each tensor's storage key,
offset, shape, stride and DTensor placement without torch or running the pickle: a piece is an array laid out in a
stored zip entry (`Locator`), or in a safetensors file. The planners: fsdp_shards (FSDP and HSDP rank files), zero
(DeepSpeed ZeRO), megatron_dist (a Megatron dist_ckpt's chunks: pieces of stored zip entries inside `.distcp` items)
and `plan_hf` here (HF safetensors, one piece per tensor). export.check compares an HF directory with a plan through
stream_copy.tensor_bytes.

torch stays the oracle (torch_engine): tests export every trainer tree both ways and compare the files byte for byte.
What the stream engine cannot do exactly (legacy containers, big-endian files, float8 or float64 casts to half types,
tensor kinds the reader does not inspect) raises StreamUnsupported before anything is written, and the caller falls
back to torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ckpt_audit.readers import safetensors_header
from ckpt_audit.readers.pt import PtStructure, TensorInfo, read_pt_structure
from ckpt_audit.readers.ptzip import ZipEntry, ZipFormatError, payload_offset

FLOATS = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})
ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
SAFETENSORS_DTYPE = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
_FROM_SAFETENSORS = {v: k for k, v in SAFETENSORS_DTYPE.items()}
# casts numpy does bit-exactly as torch does (via float32, which holds every half value exactly)
EXACT_CASTS = {(a, b) for a in ("float32", "float16", "bfloat16") for b in ("float32", "float16", "bfloat16")} | {
    ("float64", "float32")
}


class StreamUnsupported(Exception):
    """This checkpoint needs the torch engine; the message says why in one line."""


class StreamError(Exception):
    """A one-line reason the export cannot go on (the caller turns it into ExportError)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Piece:
    """One rank's part of a tensor: an array laid out at `offset` in `path`."""

    path: str
    offset: int  # byte offset of element [0, ..., 0]
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    entry: ZipEntry | None = None  # set when the piece is exactly its storage entry: CRC-checked as it is copied


@dataclass(frozen=True, slots=True, kw_only=True)
class Planned:
    name: str
    shape: tuple[int, ...]
    dtype: str  # source dtype name, torch's spelling
    pieces: tuple[Piece, ...]
    dim: int | None = None  # concatenation dim; None: a single piece
    to: str | None = None  # its own cast when no target is asked (zero_to_fp32 makes floating buffers float32)

    def out_dtype(self, target: str | None) -> str:
        if target is not None and self.dtype in FLOATS:
            return target
        return self.to or self.dtype

    def nbytes(self, target: str | None) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * ITEMSIZE[self.out_dtype(target)]


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    kind: str  # "fsdp-shards" | "hf-weights"
    world_size: int | None
    tensors: tuple[Planned, ...]
    warnings: tuple[str, ...] = ()


def plan_hf(paths: list[Path]) -> Plan:
    """HF safetensors already in huggingface/: each tensor one piece, in the order safetensors lists keys."""
    out: list[Planned] = []
    for p in paths:
        try:
            header = safetensors_header.read(str(p))
        except OSError as exc:
            raise StreamError(f"{p}: not a readable safetensors file ({exc.strerror or exc})") from None
        if header.problems:  # what safetensors itself refuses to load
            raise StreamError(f"{p}: not a readable safetensors file ({header.problems[0]})")
        for key in sorted(header.tensors):
            v = header.tensors[key]
            dtype = _FROM_SAFETENSORS.get(v["dtype"])
            if dtype is None:
                raise StreamUnsupported(f"{p}: {key} has dtype {v['dtype']}")
            shape = tuple(v["shape"])
            start = v["data_offsets"][0]
            piece = Piece(path=str(p), offset=8 + header.length + start, shape=shape, strides=c_strides(shape))
            out.append(Planned(name=key, shape=shape, dtype=dtype, pieces=(piece,)))
    return Plan(kind="hf-weights", world_size=None, tensors=tuple(out))


def streamable_structure(path: Path) -> PtStructure:
    """The file's structure (readers.pt), or StreamError / StreamUnsupported when the stream engine cannot copy it."""
    try:
        s = read_pt_structure(path)
    except OSError as exc:
        raise StreamError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if s.unsafe_globals:  # what torch.load(weights_only=True) refuses too; nothing of it is ever run
        raise StreamError(f"{path}: cannot load safely (it asks for {sorted(s.unsafe_globals)[0]})")
    if s.container != "zip":
        raise StreamUnsupported(f"{path}: {s.container} container")
    if s.problems or s.notes:  # notes: tensors the reader left unread (quantized, subclasses)
        raise StreamUnsupported(f"{path}: {(*s.problems, *s.notes)[0]}")
    if s.byteorder == "big":
        raise StreamUnsupported(f"{path}: big-endian storages")
    return s


class Locator:
    """Storage key -> (entry, payload offset) of one rank file; one local-header read per storage used."""

    def __init__(self, path: Path, s: PtStructure) -> None:
        self.path = str(path)
        cut = len(s.prefix) + 1 if s.prefix is not None else 0
        self.entries = {e.name[cut + 5 :]: e for e in s.entries if e.name[cut:].startswith("data/")}
        self.fd = os.open(self.path, os.O_RDONLY)

    def piece(self, t: TensorInfo) -> Piece:
        entry = self.entries.get(t.storage_key or "")
        if entry is None or not entry.stored:
            raise StreamUnsupported(f"{self.path}: storage {t.storage_key} of {t.key} is not a stored entry")
        try:
            start = payload_offset(self.fd, entry)
        except ZipFormatError as exc:
            raise StreamError(f"{self.path}: {exc}") from None
        item = ITEMSIZE[t.dtype]
        nbytes = numel(t.shape) * item
        whole = t.storage_offset == 0 and nbytes == entry.size and contiguous(t.shape, t.stride)
        return Piece(
            path=self.path,
            offset=start + t.storage_offset * item,
            shape=t.shape,
            strides=t.stride,
            entry=entry if whole and nbytes else None,
        )

    def close(self) -> None:
        os.close(self.fd)


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


def contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    acc = 1
    for n, s in zip(reversed(shape), reversed(stride)):
        if n != 1 and s != acc:
            return False
        acc *= n
    return True
