"""A .safetensors file's header against the file, as the safetensors library checks it before loading. No torch.

The format: an 8-byte little-endian header length N, N bytes of JSON ({name: {dtype, shape, data_offsets: [b, e]}},
optional "__metadata__": {str: str}), then the data. safetensors (0.4 to 0.8, `load_file` and `safe_open`) refuses
the file unless every tensor's e - b equals dtype size x prod(shape), the ranges tile the data from byte 0 without
gap or overlap, and the last one ends exactly at the end of the file ("incomplete metadata, file not fully covered").
One small read (the header), on top of the scan's hash read; the only module that parses safetensors headers
(the scan, verify and export all read them here).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from math import prod
from typing import Any

from ckpt_audit.readers import bounded_json
from ckpt_audit.readers.problem import Problem

MAX_HEADER = 100_000_000  # the safetensors library's own limit (MAX_HEADER_SIZE)
DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Header:
    """What a safetensors file's header says, and what is wrong with it against the file."""

    length: int = 0  # N: the tensor data starts at byte 8 + N
    tensors: Mapping[str, Any] = field(default_factory=dict)  # name -> {dtype, shape, data_offsets}, as written
    problems: tuple[Problem, ...] = ()  # empty: safetensors loads the file

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.tensors))


def read(path: str) -> Header:
    """The header of `path` checked against the file's length. Raises OSError when the file cannot be read;
    never raises for bad content."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            return _bad(f"file is {size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            return _bad(f"header length {n} runs past the end of the {size}-byte file")
        raw = f.read(n)
    try:
        header = bounded_json.loads(raw, max_bytes=MAX_HEADER, max_depth=None)  # check_header checks its shape
    except ValueError as exc:
        return _bad(f"header is not JSON: {exc}")
    if not isinstance(header, dict):
        return _bad("header is not a JSON object")
    problems = check_header(header, data_size=size - 8 - n)
    header.pop("__metadata__", None)  # what is left is the tensors (no copy: a MoE shard has tens of thousands)
    return Header(length=n, tensors=header, problems=problems)


def check_header(header: Mapping[str, Any], *, data_size: int) -> tuple[Problem, ...]:
    """What safetensors refuses in a parsed header whose data section holds `data_size` bytes (empty: it loads)."""
    out: list[Problem] = []
    bad = lambda message, tensor=None: Problem("safetensors-header-invalid", message, tensor=tensor)  # noqa: E731
    off = lambda message, tensor=None: Problem("safetensors-offsets", message, tensor=tensor)  # noqa: E731
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        out.append(bad("__metadata__ is not an object of strings"))
    spans = []
    for name, info in header.items():  # once per tensor: kept to plain checks (a MoE shard has tens of thousands)
        if name == "__metadata__":
            continue
        if type(info) is not dict:
            out.append(bad(f"{name}: entry is not an object", name))
            continue
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        bits = DTYPE_BITS.get(dtype) if type(dtype) is str else None
        if bits is None:
            out.append(bad(f"{name}: unknown dtype {dtype!r}", name))
            continue
        if type(shape) is not list or not all(map(_count, shape)):
            out.append(bad(f"{name}: malformed shape {shape!r}", name))
            continue
        if type(offsets) is not list or len(offsets) != 2 or not all(map(_count, offsets)) or offsets[0] > offsets[1]:
            out.append(bad(f"{name}: malformed data_offsets {offsets!r}", name))
            continue
        want = (prod(shape) * bits + 7) // 8
        if offsets[1] - offsets[0] != want:
            span = offsets[1] - offsets[0]
            out.append(off(f"{name}: {dtype} x {shape} needs {want} bytes, data_offsets {offsets} span {span}", name))
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    at = 0
    for b, e, name in spans:
        if b != at:
            kind = "a gap" if b > at else "an overlap"
            out.append(off(f"{name}: starts at {b}, leaving {kind} after byte {at}", name))
        at = max(at, e)
    if at != data_size:
        cut = "truncated" if at > data_size else "trailing bytes"
        out.append(off(f"tensors end at byte {at} of the data, the file holds {data_size}: {cut}"))
    return tuple(out)


def _count(v: object) -> bool:
    return type(v) is int and v >= 0  # not a bool, not a float


def _bad(message: str) -> Header:
    return Header(problems=(Problem("safetensors-header-invalid", message),))
