"""DCP's `.metadata`, read without torch: the one parser of it (the scan's byte-range facts, verify's deep checks).

`.metadata` is the pickled `Metadata` torch.distributed.checkpoint's coordinator writes last (to `.metadata.tmp`,
then renamed): which tensor chunks and byte objects exist, and for each one the file and byte range holding it. It
is read by the restricted unpickler, so no torch class is resolved: the dataclasses come back as records.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ckpt_audit.models import DcpFacts
from ckpt_audit.readers import unpickler

MAX_METADATA_BYTES = 1 << 30


@dataclass(frozen=True, slots=True, kw_only=True)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class DcpMetadata:
    tensors: Mapping[str, tuple[tuple[int, ...], tuple[Chunk, ...], str | None]]  # fqn -> (size, chunks, dtype)
    byte_items: frozenset[str]
    storage: Mapping[tuple[str, tuple[int, ...] | None], tuple[str, int, int]]  # (fqn, offset) -> (file, off, len)


def read_metadata(path: str) -> DcpMetadata:
    """Parse `.metadata`; raises ValueError with a one-line reason for anything that is not DCP metadata."""
    with open(path, "rb") as f:
        raw = f.read(MAX_METADATA_BYTES + 1)
    if len(raw) > MAX_METADATA_BYTES:
        raise ValueError("larger than 1 GiB")
    return parse_metadata(raw)


def parse_metadata(raw: bytes) -> DcpMetadata:
    sdm, sd = _load(raw)
    tensors: dict[str, Any] = {}
    byte_items: set[str] = set()
    for fqn, item in sdm.items():
        q = item.qualname if unpickler.is_record(item) else ""
        if q.endswith("TensorStorageMetadata"):
            size = tuple(_field(item, "size") or ())
            chunks = tuple(
                Chunk(offsets=tuple(_field(c, "offsets")), sizes=tuple(_field(c, "sizes")))
                for c in _field(item, "chunks") or ()
            )
            props = _field(item, "properties")
            dtype = None
            if unpickler.is_record(props) and isinstance(props.state, tuple) and props.state:
                dtype = unpickler.global_name(props.state[0])
            tensors[str(fqn)] = (size, chunks, dtype)
        elif q.endswith("BytesStorageMetadata"):
            byte_items.add(str(fqn))
        else:
            raise ValueError(f"{fqn}: unknown storage metadata {q or type(item).__name__}")
    storage = {}
    for idx, info in sd.items():
        fqn = _field(idx, "fqn")
        off = _field(idx, "offset")
        storage[(str(fqn), tuple(off) if off is not None else None)] = _where(info)
    return DcpMetadata(tensors=tensors, byte_items=frozenset(byte_items), storage=storage)


def _load(raw: bytes) -> tuple[dict, dict]:
    """(state_dict_metadata, storage_data) of a pickled DCP Metadata."""
    try:
        meta = unpickler.restricted_load(raw)
    except Exception as exc:  # noqa: BLE001 - garbage in, one line out
        raise ValueError(f"does not unpickle: {exc}") from None
    if not unpickler.is_record(meta) or not meta.qualname.endswith(".Metadata"):
        raise ValueError(f"not a DCP Metadata record ({type(meta).__name__})")
    sdm = _field(meta, "state_dict_metadata")
    sd = _field(meta, "storage_data")
    if not isinstance(sdm, dict) or not isinstance(sd, dict):
        raise ValueError("Metadata without state_dict_metadata / storage_data")
    return sdm, sd


def _where(info: Any) -> tuple[str, int, int]:
    """(file, offset, length) of one storage entry."""
    return str(_field(info, "relative_path")), int(_field(info, "offset")), int(_field(info, "length"))


def _field(rec: Any, name: str) -> Any:
    if unpickler.is_record(rec):
        st = rec.state
        if type(st) is dict and name in st:  # a dataclass's BUILD state: the common case, read without a copy
            return st[name]
        f = rec.fields
        if name in f:
            return f[name]
        names = {"fqn": 0, "offset": 1, "index": 2, "relative_path": 0, "length": 2}
        if rec.args and name in names and len(rec.args) > names[name]:
            return rec.args[names[name]]  # a NamedTuple-style record
        return None
    return getattr(rec, name, None)


def facts(sdm_keys: Iterable[str], storage: Iterable[tuple[str, int, int]]) -> DcpFacts:
    """What the shallow scan keeps of `.metadata`: the bytes each data file must hold, and the state's top keys."""
    ends: dict[str, int] = {}
    for rel, start, length in storage:
        ends[rel] = max(ends.get(rel, 0), start + length)
    roots = {str(fqn).split(".", 1)[0] for fqn in sdm_keys}
    return DcpFacts(file_ends=tuple(sorted(ends.items())), key_roots=tuple(sorted(roots)))


def read_facts(path: str) -> DcpFacts:
    """`facts` of the `.metadata` at `path`, without building its chunk lists (the scan's cost); raises OSError,
    or ValueError with a one-line reason."""
    with open(path, "rb") as f:
        raw = f.read(MAX_METADATA_BYTES + 1)
    if len(raw) > MAX_METADATA_BYTES:
        raise ValueError("larger than 1 GiB")
    sdm, sd = _load(raw)
    try:
        return facts(sdm, (_where(info) for info in sd.values()))
    except (TypeError, ValueError, AttributeError) as exc:  # a record of the right name with fields of the wrong types
        raise ValueError(f"malformed: {unpickler.first_line(exc)}") from None
