"""The walk of an unpickled torch tree: tensor records (`_rebuild_tensor_v2`, DTensor's `_rebuild_from_type_v2`,
parameters, meta tensors) become `TensorInfo` leaves with dtype, shape, stride, storage and DTensor placement, checked
against the stored bytes where they are plain. Bounded in objects and depth against hostile pickles.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from typing import Any

from ckpt_audit.readers.problem import Problem
from ckpt_audit.readers.pt.structure import StorageRef, TensorInfo
from ckpt_audit.readers.ptzip import ZipFormatError
from ckpt_audit.readers.torch_globals import (
    DTENSOR_TYPES,
    DTYPE_ALIASES,
    DTYPE_ITEMSIZE,
    OTHER_REBUILDS,
    REBUILD_FROM_TYPE,
    REBUILD_META,
    REBUILD_PARAM,
    REBUILD_V2,
    REBUILD_V3,
)
from ckpt_audit.readers.unpickler import Stub, global_name, stub_class

_MAX_NODES = 5_000_000  # bound the walk of a hostile DAG (shared references) so it cannot blow up
_MAX_DEPTH = 200  # real state dicts nest < 10 deep; deeper is cut off rather than hitting Python's recursion limit


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


class Walker:
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
                known = [d for d in dims if d is not None]
                if len(known) == len(dims):
                    shape = tuple(known)
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
