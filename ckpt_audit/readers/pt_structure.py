"""The structure of a torch file, read without torch and without running its pickles.

`read_pt_structure` reads a torch file in any container torch.load accepts: a torch.save zip (the pickle in
`data.pkl`), the legacy non-zip format (five pickles, then raw storages) or a raw pickle stream, each pickle through
the restricted unpickler (`unpickler`). The pickle gives the key tree, and each tensor record
(`torch._utils._rebuild_tensor_v2`, DTensor's `_rebuild_from_type_v2`) gives dtype, shape, stride, storage key, numel
and location, checked against the stored bytes. Every global any of its pickles names is recorded and judged against
`torch_globals.KNOWN_SAFE_GLOBALS`, the one allowlist, by the scan and by verify. No torch import (the scan path uses
this).
"""

from __future__ import annotations

import dataclasses
import io
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ckpt_audit.readers.problem import Problem
from ckpt_audit.readers.ptzip import (
    SNIFF_BYTES,
    PtArchive,
    ZipEntry,
    ZipFormatError,
    _pread_exact,
    payload_offset,
    read_archive,
    read_entry,
    sniff,
)
from ckpt_audit.readers.torch_globals import (
    DTENSOR_TYPES,
    DTYPE_ALIASES,
    DTYPE_ITEMSIZE,
    KNOWN_SAFE_GLOBALS,
    OTHER_REBUILDS,
    REBUILD_FROM_TYPE,
    REBUILD_META,
    REBUILD_PARAM,
    REBUILD_V2,
    REBUILD_V3,
    STORAGE_DTYPES,
)
from ckpt_audit.readers.unpickler import (
    PersistentRef,
    Stub,
    global_name,
    stub_class,
    too_deep,
    unpickle,
    unpickle_problem,
)

MAX_PICKLE_BYTES = 512 * 1024 * 1024  # data.pkl of a real shard is KiBs to a few MiB
_MAX_NODES = 5_000_000  # bound the walk of a hostile DAG (shared references) so it cannot blow up
_MAX_DEPTH = 200  # real state dicts nest < 10 deep; deeper is cut off rather than hitting Python's recursion limit


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageRef:
    """torch's persistent id for a storage: ('storage', <storage class>, key, location, numel)."""

    storage_type: str  # e.g. "FloatStorage", "UntypedStorage"
    dtype: str | None  # from the storage class; None when untyped
    itemsize: int
    key: str  # zip entry data/<key>
    location: str  # "cpu", "cuda:0", ...
    numel: int  # elements of `dtype` (bytes when untyped)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorInfo:
    key: str  # dotted path of keys: "model.layers.0.weight", "state.0.exp_avg"
    key_path: tuple[Any, ...]  # the same path as the real keys (ints stay ints), for keys that contain dots
    dtype: str  # "float32", "bfloat16", ...
    shape: tuple[int, ...]  # local shape (for a DTensor: this rank's chunk)
    stride: tuple[int, ...]
    storage_offset: int = 0
    storage_key: str | None = None  # None for meta tensors (no storage)
    storage_numel: int = 0
    storage_nbytes: int = 0
    device: str = "cpu"  # storage location string as saved ("cpu", "cuda:0")
    requires_grad: bool = False
    is_parameter: bool = False
    is_dtensor: bool = False
    global_shape: tuple[int, ...] | None = None  # DTensor only
    placements: tuple[str, ...] = ()  # "Shard(0)", "Replicate()", "Partial(sum)", "_StridedShard(0, sf=2)"
    mesh_shape: tuple[int, ...] | None = None
    mesh_dim_names: tuple[str, ...] | None = None
    mesh_device_type: str | None = None
    mesh_ranks: tuple[int, ...] | None = None  # the mesh's ranks in row-major order, when its storage is readable

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_ITEMSIZE.get(self.dtype, 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class PtStructure:
    path: str
    prefix: str | None  # the zip's top-level folder: the file stem at save time
    entries: tuple[ZipEntry, ...] = ()
    keys: tuple[str, ...] = ()  # top-level keys of the saved dict (str() of each)
    tensors: tuple[TensorInfo, ...] = ()
    globals_seen: frozenset[str] = frozenset()
    problems: tuple[Problem, ...] = ()  # each a finding code and its line; empty for a well-formed file
    notes: tuple[str, ...] = ()  # what was not read, and why, that is no defect (a tensor kind not inspected)
    byteorder: str | None = None  # "little" / "big" / None when the record is absent
    storage_count: int = 0
    tree: Any = field(default=None, repr=False, compare=False)  # restricted object tree, tensors as TensorInfo
    container: str = "zip"  # "zip" (torch.save), "legacy" (_use_new_zipfile_serialization=False), "pickle" (raw)

    @property
    def unsafe_globals(self) -> frozenset[str]:
        """Globals outside what torch.save emits for tensors and training state: the file asks for code."""
        return frozenset(g for g in self.globals_seen if g not in KNOWN_SAFE_GLOBALS)

    @property
    def has_dtensors(self) -> bool:
        return any(t.is_dtensor for t in self.tensors)

    def tensor(self, key: str) -> TensorInfo | None:
        for t in self.tensors:
            if t.key == key:
                return t
        return None


def read_pt_structure(path: str | os.PathLike[str]) -> PtStructure:
    """Structure of a torch file without torch and without running its pickle: a torch.save zip, the legacy
    (non-zip) torch.save format, or a raw pickle stream. Raises OSError only; a broken container or pickle becomes
    `problems` (the first one says why nothing else could be read)."""
    fspath = os.fspath(path)
    fd = os.open(fspath, os.O_RDONLY)
    try:
        kind = sniff(os.pread(fd, SNIFF_BYTES, 0))
        if kind == "legacy-torch":
            return _read_legacy(fd, fspath)
        if kind == "pickle":
            return _read_raw_pickle(fd, fspath)
        try:
            archive = read_archive(fd)
        except ZipFormatError as exc:
            return PtStructure(path=fspath, prefix=None, problems=(exc.problem,))
        return _read_structure(fd, fspath, archive)
    finally:
        os.close(fd)


class _Storages(dict):
    """Storage key -> StorageRef, filled by the unpickler's persistent_load as torch's persistent ids come by."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__()
        self.problems = problems

    def persistent(self, pid: Any) -> Any:
        ref = _storage_ref(pid)
        if ref is None:
            return PersistentRef(pid)
        prior = self.setdefault(ref.key, ref)
        if prior.numel != ref.numel or prior.storage_type != ref.storage_type:
            self.problems.append(
                Problem("storage-size-mismatch", f"storage {ref.key} is referenced with two different types or sizes")
            )
        return ref


def _read_structure(fd: int, path: str, archive: PtArchive) -> PtStructure:
    problems = list(archive.torch_problems)
    base = dict(path=path, prefix=archive.prefix, entries=archive.entries)
    byteorder = None
    if (bo := archive.get("byteorder")) is not None:
        try:
            byteorder = read_entry(fd, bo, limit=64).decode("ascii", "replace").strip()
        except ZipFormatError as exc:
            problems.append(exc.problem)
    if byteorder not in (None, "little", "big"):
        problems.append(Problem("bad-pickle", f"byteorder record says {byteorder!r}"))
    pkl = archive.get("data.pkl")
    if pkl is None:
        return PtStructure(**base, problems=tuple(problems), byteorder=byteorder)
    try:
        raw = read_entry(fd, pkl, limit=MAX_PICKLE_BYTES)
    except ZipFormatError as exc:
        return PtStructure(**base, problems=(*problems, exc.problem), byteorder=byteorder)
    storages = _Storages(problems)
    root, seen, error = unpickle(raw, storages.persistent)
    if error is not None:
        return PtStructure(
            **base,
            problems=(*problems, unpickle_problem("data.pkl", error)),
            byteorder=byteorder,
            globals_seen=seen,
        )

    def locate(key: str) -> tuple[int, int] | None:
        entry = archive.data_entries.get(key)
        return (payload_offset(fd, entry), entry.size) if entry is not None and entry.stored else None

    walker = _Walker(fd, locate, big_endian=byteorder == "big")
    tree = walker.convert(root, ())
    problems.extend(walker.problems)
    notes = list(walker.notes)
    _check_storages(archive, storages, problems, notes)
    keys = _keys(root)
    return PtStructure(
        **base,
        keys=keys,
        tensors=tuple(walker.tensors),
        globals_seen=seen,
        problems=tuple(problems),
        notes=tuple(notes),
        byteorder=byteorder,
        storage_count=len(storages),
        tree=tree,
    )


# torch/serialization.py: MAGIC_NUMBER and PROTOCOL_VERSION of the legacy format
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001


class _Window(io.RawIOBase):
    """The first `limit` bytes of an open file, read by pread: the pickles of a legacy file are parsed from it
    (through a BufferedReader, whose tell() then gives where the raw storage bytes start)."""

    def __init__(self, fd: int, limit: int) -> None:
        super().__init__()
        self.fd, self.limit, self.pos = fd, limit, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        n = min(len(buf), self.limit - self.pos)
        if n <= 0:
            return 0
        data = os.pread(self.fd, n, self.pos)
        buf[: len(data)] = data
        self.pos += len(data)
        return len(data)

    def tell(self) -> int:
        return self.pos

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else (self.pos + pos if whence == 1 else self.limit + pos)
        return self.pos


def _read_legacy(fd: int, path: str) -> PtStructure:
    """torch's legacy format (torch/serialization.py `_legacy_save`): pickles of the magic number, the protocol
    version and a sys-info dict; the data pickle, whose persistent ids name storages; a pickle of the storage keys;
    then per key an 8-byte little-endian element count and the storage's raw bytes. Every pickle goes through the
    restricted unpickler (torch's own loader unpickles all five), and the raw bytes are located, never read."""
    size = os.fstat(fd).st_size
    reader = io.BufferedReader(_Window(fd, min(size, MAX_PICKLE_BYTES)), 1 << 20)
    problems: list[Problem] = []
    notes: list[str] = []
    storages = _Storages(problems)
    seen: set[str] = set()
    base = dict(path=path, prefix=None, container="legacy")
    values = []
    for what in ("magic number", "protocol version", "sys info", "data", "storage keys"):
        start = reader.tell()
        error = too_deep(reader)  # its opcodes walked first: hashing a tuple nested 1M deep kills the process
        reader.seek(start)
        value, names, error = (
            unpickle(reader, storages.persistent if what == "data" else None)
            if error is None
            else (None, frozenset(), error)
        )
        seen |= names
        if error is not None:
            return PtStructure(
                **base,
                problems=(*problems, unpickle_problem(f"{what} pickle", error)),
                globals_seen=frozenset(seen),
            )
        values.append(value)
    magic, protocol, sys_info, root, keys = values
    if magic != _LEGACY_MAGIC or protocol != _LEGACY_PROTOCOL:
        problems.append(
            Problem("bad-pickle", f"legacy header holds magic {magic!r}, protocol {protocol!r}: not what torch writes")
        )
    little = sys_info.get("little_endian", True) if isinstance(sys_info, dict) else True
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        problems.append(Problem("bad-pickle", "the storage-keys pickle is not a list of keys"))
        keys = []
    spans = dict(_legacy_spans(fd, reader.tell(), size, keys, storages, problems, notes))
    walker = _Walker(fd, spans.get, big_endian=not little)
    tree = walker.convert(root, ())
    problems.extend(walker.problems)
    notes.extend(walker.notes)
    return PtStructure(
        **base,
        keys=_keys(root),
        tensors=tuple(walker.tensors),
        globals_seen=frozenset(seen),
        problems=tuple(problems),
        notes=tuple(notes),
        byteorder="little" if little else "big",
        storage_count=len(storages),
        tree=tree,
    )


def _legacy_spans(
    fd: int,
    offset: int,
    size: int,
    keys: list[str],
    storages: dict[str, StorageRef],
    problems: list[Problem],
    notes: list[str],
) -> Iterator[tuple[str, tuple[int, int]]]:
    """(key, (offset, nbytes)) of each storage's raw bytes, checked against the counts the data pickle gives."""
    for key in keys:
        ref = storages.get(key)
        head = os.pread(fd, 8, offset) if offset + 8 <= size else b""
        if len(head) < 8:
            problems.append(Problem("truncated", f"truncated: storage {key} starts past the end of the file"))
            return
        (numel,) = struct.unpack("<q", head)
        itemsize = ref.itemsize if ref is not None else 1
        start, nbytes = offset + 8, max(numel, 0) * itemsize
        if start + nbytes > size:
            problems.append(
                Problem("truncated", f"truncated: storage {key} ({nbytes} bytes) ends past the end of the file")
            )
            return
        if ref is None:
            notes.append(f"legacy storage {key} is referenced by no tensor in the data pickle")
        elif numel != ref.numel:
            problems.append(
                Problem(
                    "storage-size-mismatch",
                    f"storage {key} holds {numel} elements but the data pickle says {ref.numel}",
                )
            )
        yield key, (start, nbytes)
        offset = start + nbytes
    for key in sorted(set(storages) - set(keys), key=_natural):
        problems.append(
            Problem("storage-size-mismatch", f"storage {key} is named by a tensor but has no bytes in the file")
        )


def _read_raw_pickle(fd: int, path: str) -> PtStructure:
    """A raw pickle stream where a torch file belongs: torch.load unpickles its first object while looking for the
    legacy magic number, so that object is read as any torch pickle is (restricted, its globals recorded)."""
    size = os.fstat(fd).st_size
    # read whole (it is the file), so that its depth is bounded before the C unpickler hashes anything
    root, seen, error = unpickle(_pread_exact(fd, min(size, MAX_PICKLE_BYTES), 0), None)
    base = dict(path=path, prefix=None, container="pickle", globals_seen=seen)
    if error is not None:
        return PtStructure(**base, problems=(unpickle_problem("pickle", error),))
    return PtStructure(**base, keys=_keys(root))


def _keys(root: Any) -> tuple[str, ...]:
    """The saved dict's top-level keys as text; a key nested too deep to print is named by its type."""
    if not isinstance(root, dict):
        return ()
    out = []
    for k in root:
        try:
            out.append(str(k))
        except RecursionError:
            out.append(f"<{type(k).__name__} nested too deep to print>")
    return tuple(out)


def _storage_ref(pid: Any) -> StorageRef | None:
    """torch's persistent id for a storage: ('storage', type, key, location, numel), plus a view record (always
    None since torch 1.0) in the legacy format."""
    if not (isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] == "storage"):
        return None
    _, stype, key, location, numel = pid[:5]
    sname = global_name(stype) or ""
    short = sname.rpartition(".")[2]
    dtype, itemsize = STORAGE_DTYPES.get(short, (None, 1))
    if short == "UntypedStorage":
        dtype = None
    if not isinstance(numel, int) or numel < 0:
        numel = 0
    return StorageRef(
        storage_type=short, dtype=dtype, itemsize=itemsize, key=str(key), location=str(location), numel=numel
    )


def _check_storages(
    archive: PtArchive, storages: dict[str, StorageRef], problems: list[Problem], notes: list[str]
) -> None:
    data = archive.data_entries
    for key, ref in sorted(storages.items(), key=lambda kv: _natural(kv[0])):
        entry = data.get(key)
        if entry is None:
            msg = f"storage {key} ({ref.numel} x {ref.storage_type}) has no zip entry data/{key}"
            problems.append(Problem("storage-size-mismatch", msg))
        elif ref.nbytes > entry.size:
            need = f"{ref.nbytes} bytes ({ref.numel} x {ref.itemsize})"
            msg = f"storage {key} needs {need} but data/{key} holds {entry.size}"
            problems.append(Problem("storage-size-mismatch", msg))
    for key in sorted(set(data) - set(storages), key=_natural):
        notes.append(f"zip entry data/{key} is referenced by no tensor in data.pkl")


def _natural(key: str) -> tuple[int, str]:
    return (int(key), "") if key.isdigit() else (1 << 62, key)


def _dtype_name(obj: Any) -> str | None:
    name = global_name(obj)
    if name is None or not name.startswith("torch."):
        return None
    short = name[6:]
    return DTYPE_ALIASES.get(short, short)


def _int_tuple(v: Any) -> tuple[int, ...] | None:
    if isinstance(v, (tuple, list)) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return tuple(v)
    return None


def _placement_str(p: Any) -> str:
    if not isinstance(p, Stub):
        return repr(p)
    short = p.qualname.rpartition(".")[2]
    f = p.fields
    if short == "Shard":
        return f"Shard({f.get('dim', p.args[0] if p.args else '?')})"
    if short == "_StridedShard":
        return f"_StridedShard({f.get('dim', '?')}, sf={f.get('split_factor', '?')})"
    if short == "Replicate":
        return "Replicate()"
    if short in ("Partial", "_Partial"):
        op = f.get("reduce_op", p.args[0] if p.args else "sum")
        return f"Partial({op})"
    return short + "()"


class _Walker:
    """Turns the restricted tree into plain values with TensorInfo leaves, collecting tensors and problems."""

    def __init__(self, fd: int, locate: Callable[[str], tuple[int, int] | None], *, big_endian: bool) -> None:
        self.fd = fd
        self.locate = locate  # storage key -> (offset, nbytes) of its raw bytes in the file, None if not plain
        self.big_endian = big_endian
        self.tensors: list[TensorInfo] = []
        self.problems: list[Problem] = []
        self.notes: list[str] = []  # what the walk left unread: no defect
        self._nodes = 0
        self._too_deep = False
        self._on_path: set[int] = set()
        self._mesh_ranks: dict[str, tuple[int, ...] | None] = {}

    def convert(self, obj: Any, path: tuple[Any, ...]) -> Any:
        self._nodes += 1
        if self._nodes > _MAX_NODES:
            if self._nodes == _MAX_NODES + 1:
                self.notes.append(f"data.pkl has over {_MAX_NODES} objects; structure read stopped")
            return None
        if isinstance(obj, (str, bytes, int, float, bool, type(None), complex)):
            return obj
        if len(path) > _MAX_DEPTH:
            if not self._too_deep:
                self._too_deep = True
                self.notes.append(f"data.pkl nests deeper than {_MAX_DEPTH} levels; structure read stopped there")
            return None
        oid = id(obj)
        if oid in self._on_path:
            return None  # a reference cycle: keep the tree finite
        self._on_path.add(oid)
        try:
            return self._convert(obj, path)
        finally:
            self._on_path.discard(oid)

    def _convert(self, obj: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(obj, dict):
            return {k: self.convert(v, (*path, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            out = [self.convert(v, (*path, i)) for i, v in enumerate(obj)]
            return out if isinstance(obj, list) else tuple(out)
        if isinstance(obj, Stub):
            info = self._tensor(obj, path)
            if info is not None:
                self.tensors.append(info)
                return info
            return obj
        return obj

    # -- tensors -----------------------------------------------------------------------------------------------

    def _tensor(self, rec: Stub, path: tuple[Any, ...], *, is_parameter: bool = False) -> TensorInfo | None:
        q = rec.qualname
        a = rec.args
        if q in REBUILD_V2 or q == REBUILD_V3:
            return self._plain_tensor(rec, path, is_parameter=is_parameter)
        if q in REBUILD_PARAM and a and isinstance(a[0], Stub):
            rg = bool(a[1]) if len(a) > 1 and isinstance(a[1], bool) else False
            inner = self._tensor(a[0], path, is_parameter=True)
            return _replace(inner, requires_grad=rg) if inner is not None else None
        if q == REBUILD_FROM_TYPE:
            return self._from_type(rec, path)
        if q == REBUILD_META and len(a) >= 3:
            shape, stride = _int_tuple(a[1]), _int_tuple(a[2])
            return TensorInfo(
                key=_dotted(path),
                key_path=path,
                dtype=_dtype_name(a[0]) or "?",
                shape=shape or (),
                stride=stride or (),
                device="meta",
            )
        if q in OTHER_REBUILDS:
            self.notes.append(f"{_dotted(path)}: tensor kind {q.rpartition('.')[2]} is not inspected")
        return None

    def _plain_tensor(self, rec: Stub, path: tuple[Any, ...], *, is_parameter: bool = False) -> TensorInfo | None:
        a = rec.args
        key = _dotted(path)
        if len(a) < 4 or not isinstance(a[0], StorageRef):
            self.problems.append(Problem("storage-size-mismatch", f"{key}: tensor record without a storage"))
            return None
        st: StorageRef = a[0]
        offset = a[1] if isinstance(a[1], int) else 0
        shape, stride = _int_tuple(a[2]), _int_tuple(a[3])
        if shape is None or stride is None or len(shape) != len(stride):
            self.problems.append(Problem("bad-pickle", f"{key}: tensor record with a malformed shape or stride"))
            return None
        rg = bool(a[4]) if len(a) > 4 and isinstance(a[4], bool) else False
        if rec.qualname == REBUILD_V3:
            dtype = _dtype_name(a[6]) if len(a) > 6 else None
        else:
            dtype = st.dtype
        dtype = dtype or "?"
        info = TensorInfo(
            key=key,
            key_path=path,
            dtype=dtype,
            shape=shape,
            stride=stride,
            storage_offset=offset,
            storage_key=st.key,
            storage_numel=st.numel,
            storage_nbytes=st.nbytes,
            device=st.location,
            requires_grad=rg,
            is_parameter=is_parameter,
        )
        self._check_extent(info, st)
        return info

    def _check_extent(self, t: TensorInfo, st: StorageRef) -> None:
        if any(s < 0 for s in t.shape) or any(s < 0 for s in t.stride) or t.storage_offset < 0:
            self.problems.append(Problem("bad-pickle", f"{t.key}: negative size, stride or offset"))
            return
        if t.numel == 0:
            return
        last = t.storage_offset + sum((n - 1) * s for n, s in zip(t.shape, t.stride))
        item = DTYPE_ITEMSIZE.get(t.dtype, 1)
        # typed storage: numel in elements of the storage dtype; untyped (v3): numel in bytes
        need_bytes = (last + 1) * item
        have_bytes = st.nbytes
        if need_bytes > have_bytes:
            self.problems.append(
                Problem(
                    "storage-size-mismatch",
                    f"{t.key}: shape {list(t.shape)} stride {list(t.stride)} offset {t.storage_offset} needs "
                    f"{need_bytes} bytes of storage {st.key}, which holds {have_bytes}",
                )
            )

    def _from_type(self, rec: Stub, path: tuple[Any, ...]) -> TensorInfo | None:
        a = rec.args
        if len(a) < 3:
            return None
        func, new_type, fargs = a[0], a[1], a[2]
        state = a[3] if len(a) > 3 else None
        fname, tname = global_name(func), global_name(new_type)
        if tname in DTENSOR_TYPES:
            return self._dtensor(fargs, state, path)
        if fname in REBUILD_V2 or fname == REBUILD_V3:
            # A Tensor subclass around a plain tensor (e.g. nn.Parameter subclasses): read the plain part.
            inner = stub_class(*fname.rsplit(".", 1))(*fargs) if isinstance(fargs, tuple) else None
            return self._plain_tensor(inner, path) if isinstance(inner, Stub) else None
        if tname:
            self.notes.append(f"{_dotted(path)}: tensor subclass {tname} is not inspected")
        return None

    def _dtensor(self, wargs: Any, state: Any, path: tuple[Any, ...]) -> TensorInfo | None:
        key = _dotted(path)
        holder = stub_class("<state>", "")()
        holder.state = state
        f = holder.fields
        local = f.get("_local_tensor")
        spec = f.get("_spec")
        linfo = self._tensor(local, path) if isinstance(local, Stub) else None
        if linfo is None:
            self.problems.append(Problem("bad-pickle", f"{key}: DTensor without a readable local tensor"))
            return None
        global_shape = None
        if isinstance(wargs, tuple) and len(wargs) >= 3:
            global_shape = _int_tuple(wargs[2])
        placements: tuple[str, ...] = ()
        mesh_shape = mesh_names = mesh_dev = mesh_ranks = None
        if isinstance(spec, Stub):
            sf = spec.fields
            pl = sf.get("placements")
            if isinstance(pl, (tuple, list)):
                placements = tuple(_placement_str(p) for p in pl)
            meta = sf.get("tensor_meta")
            if global_shape is None and isinstance(meta, Stub) and meta.args:
                global_shape = _int_tuple(meta.args[0])
            mesh = sf.get("mesh")
            if isinstance(mesh, Stub):
                mesh_shape, mesh_names, mesh_dev, mesh_ranks = self._mesh(mesh)
        else:
            self.problems.append(Problem("bad-pickle", f"{key}: DTensor without a readable spec"))
        return _replace(
            linfo,
            is_dtensor=True,
            global_shape=global_shape,
            placements=placements,
            mesh_shape=mesh_shape,
            mesh_dim_names=mesh_names,
            mesh_device_type=mesh_dev,
            mesh_ranks=mesh_ranks,
        )

    def _mesh(self, mesh: Stub) -> tuple[Any, Any, Any, Any]:
        f = mesh.fields
        dev = f.get("device_type", f.get("_device_type"))
        names = f.get("mesh_dim_names", f.get("_mesh_dim_names"))
        names = tuple(str(n) for n in names) if isinstance(names, (tuple, list)) else None
        shape: tuple[int, ...] | None = None
        ranks: tuple[int, ...] | None = None
        layout = f.get("_layout")
        if isinstance(layout, Stub):  # torch >= 2.9: a CuTe-style layout, one _FlatLayout per mesh dim
            axes = layout.fields.get("axes")
            if isinstance(axes, (tuple, list)):
                dims = []
                for ax in axes:
                    ashape = ax.fields.get("shape") if isinstance(ax, Stub) else None
                    dims.append(_prod(ashape) if isinstance(ashape, (tuple, list, int)) else None)
                if all(d is not None for d in dims):
                    shape = tuple(dims)
        rank_rec = f.get("_rank_map", f.get("mesh"))  # _rank_map (new) or mesh (older torch): an int tensor
        if isinstance(rank_rec, Stub) and rank_rec.qualname in REBUILD_V2:
            rt = self._plain_tensor(rank_rec, ("<mesh>",))
            if rt is not None:
                if shape is None and f.get("mesh") is rank_rec:
                    shape = rt.shape
                ranks = self._read_ranks(rt)
        return shape, names, str(dev) if dev is not None else None, ranks

    def _read_ranks(self, t: TensorInfo) -> tuple[int, ...] | None:
        if t.storage_key is None or t.dtype not in ("int32", "int64") or t.numel > 65536:
            return None
        cache_key = f"{t.storage_key}:{t.storage_offset}:{t.shape}:{t.stride}"
        if cache_key in self._mesh_ranks:
            return self._mesh_ranks[cache_key]
        ranks = None
        try:
            span = self.locate(t.storage_key)
        except (ZipFormatError, OSError):
            span = None
        if span is not None and span[1] <= 8 * 65536 * 4:
            try:
                raw = os.pread(self.fd, span[1], span[0])
                fmt = ("<" if not self.big_endian else ">") + ("i" if t.dtype == "int32" else "q")
                vals = [
                    v[0]
                    for v in struct.iter_unpack(fmt, raw[: len(raw) // struct.calcsize(fmt) * struct.calcsize(fmt)])
                ]
                ranks = tuple(vals[idx] for idx in _strided_indices(t.shape, t.stride, t.storage_offset))
            except (ZipFormatError, OSError, IndexError):
                ranks = None
        self._mesh_ranks[cache_key] = ranks
        return ranks


def _strided_indices(shape: tuple[int, ...], stride: tuple[int, ...], offset: int) -> Iterator[int]:
    if not shape:
        yield offset
        return
    idx = [0] * len(shape)
    total = _prod(shape)
    for _ in range(total):
        yield offset + sum(i * s for i, s in zip(idx, stride))
        for d in range(len(shape) - 1, -1, -1):
            idx[d] += 1
            if idx[d] < shape[d]:
                break
            idx[d] = 0


def _prod(v: Any) -> int:
    if isinstance(v, int):
        return v
    n = 1
    for x in v:
        n *= _prod(x)
    return n


def _replace(t: TensorInfo, **changes: Any) -> TensorInfo:
    from dataclasses import replace

    return replace(t, **changes)


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


def read_zip_structure(fd: int, path: str, archive: PtArchive, *, base: int = 0) -> PtStructure:
    """read_pt_structure of a zip already opened at `fd` (`archive`), one that starts `base` bytes into the file (a
    `.distcp` item: `read_archive(fd, length, base=base)`); the result's entries carry absolute offsets."""
    if base:
        shifted = tuple(dataclasses.replace(e, header_offset=e.header_offset + base) for e in archive.entries)
        archive = PtArchive(
            file_size=archive.file_size,
            cd_offset=archive.cd_offset,
            cd_size=archive.cd_size,
            entries=shifted,
            prefix=archive.prefix,
            problems=archive.problems,
        )
    return _read_structure(fd, path, archive)
