"""What the structure reader reports of one torch file: its storages, its tensors and the file as a whole."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckpt_audit.readers.problem import Problem
from ckpt_audit.readers.ptzip import ZipEntry
from ckpt_audit.readers.torch_globals import DTYPE_ITEMSIZE, KNOWN_SAFE_GLOBALS


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
