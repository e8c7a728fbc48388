"""The plain views verify's FSDP checks compare: what each rank's loaded files hold, with no torch in them.

`deep/fsdp.py` loads each rank's files (through `safe_load`, the only torch.load) and boils them down to these
frozen views; the rules (`model_rules`, `optim_rules`, `identity`, `values`) are pure functions over them, so every
rule is testable on literal views too. Also here: where a rank sits on a DeviceMesh and what local shape DTensor
gives it there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorView:
    dtype: str
    local_shape: tuple[int, ...]
    is_dtensor: bool = False
    global_shape: tuple[int, ...] | None = None
    placements: tuple[str, ...] = ()  # "Shard(0)", "Replicate()", ...
    mesh_shape: tuple[int, ...] | None = None
    mesh_ranks: tuple[int, ...] | None = None  # row-major
    mesh_names: tuple[str, ...] | None = None
    device: str = "cpu"  # storage location as saved
    storage: str | None = None  # storage key in the zip (tied tensors share one)
    storage_offset: int = 0
    crc: int | None = None  # CRC-32 of the storage's zip entry (None/0: unknown)
    writer_rank: int | None = None  # the global rank the pickled DeviceMesh says saved it (None: not recorded)
    nonfinite: int = 0  # NaN and Inf elements of the local tensor (deep/values.py counts them while loading)
    nan: int = 0
    zero: bool | None = None  # every element of the local tensor is 0; None: not judged (not a float tensor)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.global_shape if self.is_dtensor and self.global_shape is not None else self.local_shape


@dataclass(frozen=True, slots=True, kw_only=True)
class RankView:
    rank: int
    model_path: str | None = None
    model: Mapping[str, TensorView] | None = None  # None: not loaded
    optim_path: str | None = None
    optim_state: Mapping[int, Mapping[str, Any]] | None = None  # idx -> {"step": float, "exp_avg": TensorView}
    param_groups: Sequence[Mapping[str, Any]] | None = None
    extra_path: str | None = None
    extra_keys: frozenset[str] | None = None  # top-level keys of extra_state
    lr_scheduler: Mapping[str, Any] | None = None
    rng_keys: frozenset[str] | None = None  # None: no "rng" entry
    equal_to: Mapping[tuple[int, str], bool] = field(default_factory=dict)  # exact compare results (HSDP fallback)


@dataclass(frozen=True, slots=True, kw_only=True)
class ComponentView:
    path: str
    step: int
    world_size: int | None
    config_world_size: int | None  # fsdp_config.json
    tie_word_embeddings: bool | None  # huggingface/config.json
    ranks: tuple[RankView, ...]


def chunk_size(length: int, parts: int, index: int) -> int:
    """torch.chunk-style split (what DTensor Shard and FSDP use): ceil-sized chunks, trailing ones short or empty."""
    if parts <= 0:
        return length
    size = math.ceil(length / parts) if length else 0
    return max(0, min(size, length - index * size))


def mesh_coords(t: TensorView, rank: int) -> tuple[int, ...] | None:
    """`rank`'s coordinate on the tensor's mesh (row-major), or None when the mesh does not list it."""
    if t.mesh_shape is None or t.mesh_ranks is None or rank not in t.mesh_ranks:
        return None
    flat, out = t.mesh_ranks.index(rank), []
    for n in reversed(t.mesh_shape):
        out.append(flat % n)
        flat //= n
    return tuple(reversed(out))


def expected_local_shape(t: TensorView, rank: int) -> tuple[int, ...] | None:
    """The local shape DTensor gives `rank`, or None when the mesh does not say where the rank sits."""
    coords = mesh_coords(t, rank)
    if t.global_shape is None or t.mesh_shape is None or coords is None:
        return None
    shape = list(t.global_shape)
    for p, n, c in zip(t.placements, t.mesh_shape, coords):
        if p.startswith("Shard("):
            d = int(p[6:-1])
            if d >= len(shape):
                return None
            shape[d] = chunk_size(shape[d], n, c)
        elif p.startswith("_StridedShard") or p.startswith("Partial"):
            return None  # not what verl saves; its layout is not modelled here
    return tuple(shape)


def unique_params(model: Mapping[str, TensorView]) -> list[str]:
    """Floating-point model keys in state-dict order, tied duplicates (one storage) counted once: the order
    `model.parameters()` gave the optimizer."""
    seen: set[tuple[str, int]] = set()
    out = []
    for k, v in model.items():
        if not (v.dtype.startswith("float") or v.dtype.startswith("bfloat")):
            continue
        ident = (v.storage, v.storage_offset) if v.storage is not None else None
        if ident is not None and ident in seen:
            continue
        if ident is not None:
            seen.add(ident)
        out.append(k)
    return out
