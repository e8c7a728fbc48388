"""How far a .safetensors file's header says its data reaches, against the bytes the file holds. No torch.

The format: an 8-byte little-endian header length N, N bytes of JSON ({name: {dtype, shape, data_offsets: [b, e]}}),
then the data. A file cut short (a copy or a save killed mid-write) keeps its header, so the largest `e` names more
data bytes than there are: the scan catches that from one small read. Whether every tensor's offsets agree with its
dtype and shape is verify's check (`ckpt_audit.deep.safetensors_check`).
"""

from __future__ import annotations

import json
import os
import struct

from ckpt_audit.readers.problem import Problem

MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


def check_extent(path: str) -> Problem | None:
    """The problem with `path`'s header or length, or None when its data ends where the header says. Raises
    OSError when the file cannot be read."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            return Problem("safetensors-header-invalid", f"file is {size} bytes, shorter than the header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            return Problem("safetensors-header-invalid", f"header length {n} runs past the end of the {size}-byte file")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return Problem("safetensors-header-invalid", "header is not JSON")
    if not isinstance(header, dict):
        return Problem("safetensors-header-invalid", "header is not a JSON object")
    ends = [
        v["data_offsets"][1]
        for k, v in header.items()
        if k != "__metadata__"
        and isinstance(v, dict)
        and isinstance(v.get("data_offsets"), list)
        and len(v["data_offsets"]) == 2
        and isinstance(v["data_offsets"][1], int)
    ]
    data = size - 8 - n
    end = max(ends, default=0)
    if end > data:
        return Problem(
            "safetensors-offsets", f"tensors end at byte {end} of the data, the file holds {data}: truncated"
        )
    return None
