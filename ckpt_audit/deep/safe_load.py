"""The one place verify calls torch.load: weights_only, on the CPU, after a look at what the file asks for.

Before any load the file's pickles are read by the restricted unpickler (`readers.pt.read_pt_structure`, which
resolves no globals; zip, legacy and raw containers alike). A file that names any global outside
`torch_globals.KNOWN_SAFE_GLOBALS` (the allowlist the scan judges by, too) becomes an `unsafe-pickle` finding and is
never passed to torch at all. The rest is loaded with `weights_only=True`, the allowlist's non-torch names (numpy's RNG
state in verl's extra_state, plain builtins) admitted through torch's `safe_globals` for the duration of one load
and nothing broader. Zip files are mapped (`mmap=True`); the legacy format cannot be, so it is read whole.
torch is imported lazily (verify only).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
import warnings
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from ckpt_audit.codes import finding
from ckpt_audit.models import Finding
from ckpt_audit.readers import pt
from ckpt_audit.readers.torch_globals import KNOWN_SAFE_GLOBALS, RECORD_GLOBALS


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadResult:
    path: str
    value: Any = None  # the loaded object; None when refused or failed
    structure: pt.PtStructure | None = None  # what the restricted unpickler saw (storage keys, CRCs)
    findings: tuple[Finding, ...] = ()
    loaded: bool = False
    entry_crc: dict[str, int] = field(default_factory=dict, repr=False)  # storage key -> CRC-32 of data/<key>


def load(path: str | os.PathLike[str]) -> LoadResult:
    """Load one torch file safely; never raises for a bad or hostile file (the reason becomes a finding)."""
    p = os.fspath(path)
    try:
        s = pt.read_pt_structure(p)
    except OSError as exc:
        return LoadResult(path=p, findings=(finding("unreadable", p, f"cannot read: {exc.strerror or exc}"),))
    refused = sorted(s.unsafe_globals)
    if refused:
        shown = ", ".join(refused[:5]) + (f" and {len(refused) - 5} more" if len(refused) > 5 else "")
        return LoadResult(
            path=p,
            structure=s,
            findings=(finding("unsafe-pickle", p, f"references {shown}: loading it would run code; not loaded"),),
        )
    if bombs := [q for q in s.problems if q.code == "pickle-over-bounds"]:  # torch.load would exhaust memory or
        # the stack on it (a tuple 1M deep segfaults its unpickler): never handed over
        return LoadResult(path=p, structure=s, findings=(finding(bombs[0].code, p, f"{bombs[0].message}; not loaded"),))
    if s.container == "pickle":  # torch.load would take its first object for a magic number and refuse the file
        return LoadResult(
            path=p,
            structure=s,
            findings=(finding("not-loadable", p, "a raw pickle stream, not a torch.save file; not loaded"),),
        )
    crcs = {}
    prefix = (s.prefix + "/") if s.prefix else ""
    for e in s.entries:
        rec = e.name[len(prefix) :] if e.name.startswith(prefix) else e.name
        if rec.startswith("data/"):
            crcs[rec[5:]] = e.crc
    try:
        value = _torch_load(p, mmap=s.container == "zip")
    except Exception as exc:  # noqa: BLE001 - a damaged file must become a finding, never a traceback
        reason = _reason(exc)
        return LoadResult(
            path=p,
            structure=s,
            findings=(finding("not-loadable", p, f"torch.load(weights_only=True) fails: {reason}"),),
            entry_crc=crcs,
        )
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


def _torch_load(path: str, *, mmap: bool = True) -> Any:
    """torch.load with weights_only=True and the allowlist's non-torch names admitted; mmap needs the zip format."""
    import torch

    _import_dtensor()
    with _LOAD_LOCK, warnings.catch_warnings(), _quiet_mesh_logger():
        warnings.simplefilter("ignore")
        with torch.serialization.safe_globals(_allowlisted_globals()):
            return torch.load(path, weights_only=True, mmap=mmap, map_location="cpu")


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
def _allowlisted_globals() -> list:
    """The non-torch names of KNOWN_SAFE_GLOBALS as torch's safe_globals takes them: (object, pickled name).

    torch knows its own tensor and DTensor globals; these are the plain builtins, collections types and numpy RNG
    reconstructors the allowlist admits. Each is looked up in an installed, trusted module (never the file's say).
    """
    out: list = []
    for name in sorted(KNOWN_SAFE_GLOBALS):
        if name.startswith("torch."):
            continue
        obj = _stand_in(name) if name in RECORD_GLOBALS else _resolve(name)
        if obj is not None:
            out.append((obj, name))
    try:  # numpy's RNG state carries its dtype class along with np.dtype
        import numpy as np

        out.append(type(np.dtype(np.uint32)))
    except ImportError:
        pass
    return out


class Record:
    """What verify loads in place of a `RECORD_GLOBALS` class (DeepSpeed's LossScaler, ZeroStageEnum, ...): the call
    arguments and the pickled state, kept as data. The real class is never imported, so no code of its runs."""

    __slots__ = ("args", "state")
    args: tuple[Any, ...]
    state: Any
    qualname = ""

    def __new__(cls, *args: Any) -> Record:  # NEWOBJ calls __new__ alone, REDUCE the class: both land here
        self = super().__new__(cls)
        self.args = args
        self.state = None
        return self

    def __init__(self, *args: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"{self.qualname}(args={self.args!r}, state={self.state!r})"


def _stand_in(name: str) -> type[Record]:
    # one subclass per name: torch's weights-only unpickler admits a NEWOBJ/BUILD by the object's exact type
    return type(name.rpartition(".")[2], (Record,), {"__slots__": (), "qualname": name})


def _resolve(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    spellings = [module]
    if module.startswith(("numpy.core.", "numpy._core.")):  # numpy 1.x and 2.x name the same module differently
        rest = module.split(".", 2)[2]
        spellings = [f"numpy._core.{rest}", f"numpy.core.{rest}"]
    if module == "__builtin__":
        spellings = ["builtins"]
    for mod in spellings:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # numpy 2 warns on numpy.core
                return getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError):
            continue
    return None
