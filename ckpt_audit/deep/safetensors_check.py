"""Structural check of a .safetensors file in pure Python: header only, no torch, no tensor bytes read.

Format: an 8-byte little-endian header length N, N bytes of JSON ({name: {dtype, shape, data_offsets: [b, e]}},
optional "__metadata__"), then the data buffer. Valid when every tensor's (e - b) equals dtype size x prod(shape),
the ranges are contiguous from 0 without overlap, and the last one ends exactly at the end of the file.
Torch-free, so the shallow scan can call `check_safetensors` too.
"""

from __future__ import annotations

import json
import os
import struct

from ckpt_audit.codes import finding
from ckpt_audit.models import Finding

MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit
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


def check_safetensors(path: str) -> tuple[Finding, ...]:
    """Findings for one safetensors file (empty when well-formed). Never raises for a bad file."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                return (_bad(path, f"file is {size} bytes, shorter than the 8-byte header length"),)
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                return (_bad(path, f"header length {n} runs past the end of the {size}-byte file"),)
            raw = f.read(n)
    except OSError as exc:
        return (finding("unreadable", path, f"cannot read: {exc.strerror or exc}"),)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        return (_bad(path, f"header is not JSON: {exc}"),)
    if not isinstance(header, dict):
        return (_bad(path, "header is not a JSON object"),)
    return check_header(path, header, data_size=size - 8 - n)


def check_header(path: str, header: dict, *, data_size: int) -> tuple[Finding, ...]:
    out: list[Finding] = []
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            out.append(_bad(path, f"{name}: entry is not an object", tensor=name))
            continue
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPE_BITS:
            out.append(_bad(path, f"{name}: unknown dtype {dtype!r}", tensor=name))
            continue
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            out.append(_bad(path, f"{name}: malformed shape {shape!r}", tensor=name))
            continue
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            out.append(_bad(path, f"{name}: malformed data_offsets {offsets!r}", tensor=name))
            continue
        numel = 1
        for d in shape:
            numel *= d
        want = (numel * DTYPE_BITS[dtype] + 7) // 8
        if offsets[1] - offsets[0] != want:
            out.append(
                finding(
                    "safetensors-offsets",
                    path,
                    f"{name}: {dtype} x {shape} needs {want} bytes, "
                    f"data_offsets {offsets} span {offsets[1] - offsets[0]}",
                    tensor=name,
                )
            )
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    at = 0
    for b, e, name in spans:
        if b != at:
            kind = "a gap" if b > at else "an overlap"
            out.append(
                finding(
                    "safetensors-offsets", path, f"{name}: starts at {b}, leaving {kind} after byte {at}", tensor=name
                )
            )
        at = max(at, e)
    if at != data_size:
        out.append(
            finding(
                "safetensors-offsets",
                path,
                f"tensors end at byte {at} of the data, the file holds "
                f"{data_size}: {'truncated' if at > data_size else 'trailing bytes'}",
            )
        )
    return tuple(out)


def _bad(path: str, message: str, *, tensor: str | None = None) -> Finding:
    return finding("safetensors-header-invalid", path, message, tensor=tensor)
