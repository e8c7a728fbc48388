"""The one place ckpt-audit calls torch.load: weights_only, mmap, on the CPU, after a look at what the file asks for.

verl's extra_state files hold `np.random.get_state()`, which `weights_only=True` refuses; we allow exactly the
numpy globals that state needs (array reconstructor, ndarray, dtype, the uint32 dtype class) through torch's
`safe_globals` context manager, for the duration of one load, and nothing broader. Before any load the pickle is read
by the restricted unpickler (`pickles.read_pt_structure`, which resolves no globals): a file that names any global
outside torch's own weights-only allowlist plus that numpy set becomes an `unsafe-pickle` finding and is never
passed to torch at all. torch is imported lazily (verify only).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from ckpt_audit import pickles
from ckpt_audit.codes import finding
from ckpt_audit.models import Finding

# module-qualified names numpy RNG state is pickled with (numpy 1.x and 2.x spellings)
NUMPY_RNG_GLOBALS: frozenset[str] = frozenset({
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.dtype",
})


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadResult:
    path: str
    value: Any = None  # the loaded object; None when refused or failed
    structure: pickles.PtStructure | None = None  # what the restricted unpickler saw (storage keys, CRCs)
    findings: tuple[Finding, ...] = ()
    loaded: bool = False
    entry_crc: dict[str, int] = field(default_factory=dict, repr=False)  # storage key -> CRC-32 of data/<key>


def load(path: str | os.PathLike[str]) -> LoadResult:
    """Load one torch file safely; never raises for a bad or hostile file (the reason becomes a finding)."""
    p = os.fspath(path)
    try:
        s = pickles.read_pt_structure(p)
    except OSError as exc:
        return LoadResult(path=p, findings=(finding("unreadable", p, f"cannot read: {exc.strerror or exc}"),))
    refused = sorted(g for g in s.globals_seen if g not in allowed_names())
    if refused:
        shown = ", ".join(refused[:5]) + (f" and {len(refused) - 5} more" if len(refused) > 5 else "")
        return LoadResult(path=p, structure=s, findings=(
            finding("unsafe-pickle", p, f"references {shown}; not loaded"),))
    crcs = {}
    prefix = (s.prefix + "/") if s.prefix else ""
    for e in s.entries:
        rec = e.name[len(prefix):] if e.name.startswith(prefix) else e.name
        if rec.startswith("data/"):
            crcs[rec[5:]] = e.crc
    try:
        value = _torch_load(p)
    except Exception as exc:  # noqa: BLE001 - a damaged file must become a finding, never a traceback
        reason = _reason(exc)
        return LoadResult(path=p, structure=s, findings=(
            finding("not-loadable", p, f"torch.load(weights_only=True) fails: {reason}"),), entry_crc=crcs)
    return LoadResult(path=p, value=value, structure=s, loaded=True, entry_crc=crcs)


def _reason(exc: BaseException) -> str:
    """One line from torch's many-line refusal: the sentence that names what was refused."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith(("Unsupported global", "Can only", "Trying to", "Unsupported operand")):
            return ln[:300]
    return (lines[0] if lines else type(exc).__name__)[:300]


# torch's safe_globals context swaps process-wide state: two overlapping loads on two threads would undo each
# other's allowlist, so loads take turns (each is a few ms with mmap)
_LOAD_LOCK = threading.Lock()


def _torch_load(path: str) -> Any:
    import torch

    _import_dtensor()
    with _LOAD_LOCK, warnings.catch_warnings(), _quiet_mesh_logger():
        warnings.simplefilter("ignore")
        with torch.serialization.safe_globals(_numpy_rng_globals()):
            return torch.load(path, weights_only=True, mmap=True, map_location="cpu")


@contextlib.contextmanager
def _quiet_mesh_logger():
    """DeviceMesh logs a warning per unpickle without process groups; harmless when only reading metadata."""
    log = logging.getLogger("torch.distributed.device_mesh")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@cache
def _import_dtensor() -> bool:
    """torch registers DTensor's weights-only globals when torch.distributed.tensor is imported."""
    try:
        import torch.distributed.tensor  # noqa: F401
    except Exception:  # noqa: BLE001 - a torch built without distributed still loads plain tensors
        return False
    return True


@cache
def _numpy_rng_globals() -> list:
    try:
        import numpy as np
    except ImportError:
        return []
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct
    uint32_dtype = type(np.dtype(np.uint32))
    return [
        (_reconstruct, "numpy.core.multiarray._reconstruct"),
        (_reconstruct, "numpy._core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
        uint32_dtype,
    ]


@cache
def allowed_names() -> frozenset[str]:
    """Globals a file may name to be loaded: torch's weights-only allowlist (DTensor's included) + numpy RNG."""
    from torch import _weights_only_unpickler as wo
    import torch.serialization

    _import_dtensor()
    names = set(wo._get_allowed_globals())
    for g in torch.serialization.get_safe_globals():
        if isinstance(g, tuple):
            names.add(g[1])
        else:
            names.add(f"{g.__module__}.{g.__qualname__}")
    if _numpy_rng_globals():
        names |= NUMPY_RNG_GLOBALS
    # torch resolves DTensor and placement types under their public names too
    names |= {g for g in pickles.KNOWN_SAFE_GLOBALS if g.startswith("torch.distributed.")}
    return frozenset(names)
