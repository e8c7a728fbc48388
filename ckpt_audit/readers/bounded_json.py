"""JSON from a scanned tree or a metrics log, parsed with bounded work: the one place that calls json.loads on them.

A hostile file must cost one finding on that file, never the whole command: Python's parser recurses once per
nesting level (a document 100k levels deep raises RecursionError), and a few bytes per array or object become
~60 bytes of Python each (100 MB of `[[],[],...` is ~2 GB). So a document is refused, with a one-line ValueError,
when it is larger than the caller's byte limit, nested deeper than its depth limit, or holds more arrays and
objects than MAX_CONTAINERS. No trainer writes anything near these limits.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

MAX_DEPTH = 64  # nesting levels; the deepest JSON a trainer writes (a config, trainer_state.json) is under 10
MAX_CONTAINERS = 2_000_000  # arrays + objects: a 100k-tensor safetensors header holds ~300k
MAX_FILE = 16 << 20  # a config or marker file: HF config.json, fsdp_config.json, integrity.json are kilobytes
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # brackets inside strings do not nest
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class JsonLimitError(ValueError):
    """A document past a bound: too large, too deep, too many containers (its message is one line)."""


def loads(data: str | bytes, *, max_bytes: int, max_depth: int | None = MAX_DEPTH) -> Any:
    """json.loads(data) within the bounds; ValueError (JsonLimitError for a bound, JSONDecodeError or
    UnicodeDecodeError for bad bytes) otherwise.

    Cost: two C-speed counts, plus a depth pass (about as long as the parse) for documents with more containers
    than `max_depth`. `max_depth` None: only the parser's own recursion bound (about 1000 levels, refused here as
    too deep), for a caller that checks the document's shape itself (a safetensors header is 3 levels)."""
    if len(data) > max_bytes:
        raise JsonLimitError(f"{len(data)} bytes of JSON, over the {max_bytes}-byte limit")
    text = data.decode("utf-8") if isinstance(data, bytes) else data
    containers = text.count("[") + text.count("{")
    if containers > MAX_CONTAINERS:
        raise JsonLimitError(f"{containers} JSON arrays/objects, over the limit of {MAX_CONTAINERS}")
    if max_depth is not None and containers > max_depth and (d := depth(text)) > max_depth:
        raise JsonLimitError(f"JSON nested {d} levels deep, over the limit of {max_depth}")
    try:
        return json.loads(text)
    except RecursionError:
        raise JsonLimitError("JSON nested deeper than the parser's recursion limit") from None


def load_file(path: str, *, max_bytes: int = MAX_FILE, max_depth: int | None = MAX_DEPTH) -> Any:
    """`loads` of a file's content, reading at most `max_bytes` + 1 bytes; OSError when it cannot be read."""
    with open(path, "rb") as f:
        raw = f.read(max_bytes + 1)
    return loads(raw, max_bytes=max_bytes, max_depth=max_depth)


def depth(text: str) -> int:
    """How deep the arrays and objects of `text` nest (brackets inside strings not counted)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)
