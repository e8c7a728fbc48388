"""`data.pt` against the StatefulDataLoader state it claims to be (torchdata 0.11, `stateful_dataloader.py`).

verl's resume does `train_dataloader.load_state_dict(torch.load("data.pt"))`, which only stores the dict (`{}` means
"no state": the epoch silently restarts); the next `iter()` reads it. A multi-worker loader (verl's default) reads
`_snapshot` (its `_snapshot_step`, `_last_yielded_worker_id`, `_main_snapshot` with `_num_workers` and the sampler
fields, and `_worker_snapshots` keyed `worker_0..worker_{n-1}`), `_steps_since_snapshot` and `_iterator_finished`;
a single-process one reads `_num_yielded`, `_sampler_iter_yielded`, the sampler states, `fetcher_state`,
`dataset_state` and `_iterator_finished`. A missing key or a value of the wrong kind raises (KeyError,
AssertionError, TypeError) at the first batch after the resume. Pure: the key names are torchdata's, written out
here (verify must not need torchdata installed).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckpt_audit.codes import finding
from ckpt_audit.models import Finding

_INT, _BOOL, _ANY, _DICT = "int", "bool", "any", "dict or None"
MULTI = {"_snapshot": "snapshot", "_steps_since_snapshot": _INT, "_iterator_finished": _BOOL}
SNAPSHOT = {"_snapshot_step": _INT, "_last_yielded_worker_id": _INT, "_main_snapshot": "main", "_worker_snapshots": "w"}
MAIN = {
    "_num_workers": _INT,
    "_sampler_iter_state": _DICT,
    "_index_sampler_state": _DICT,
    "_sampler_iter_yielded": _INT,
    "_IterableDataset_len_called": _ANY,
    "_shared_seed": _ANY,
    "_base_seed": _ANY,
}
SINGLE = {
    "_num_yielded": _INT,
    "_sampler_iter_yielded": _INT,
    "_sampler_iter_state": _DICT,
    "_index_sampler_state": _DICT,
    "_IterableDataset_len_called": _ANY,
    "_shared_seed": _ANY,
    "fetcher_state": _DICT,
    "dataset_state": _ANY,
    "_iterator_finished": _BOOL,
}


def check_dataloader(path: str, value: Any) -> tuple[Finding, ...]:
    problem = dataloader_problem(value)
    if problem is None:
        return ()
    return (finding("dataloader-state-invalid", path, problem),)


def dataloader_problem(value: Any) -> str | None:
    """Why StatefulDataLoader would fail on (or silently ignore) `value`, or None when it is a state it reads."""
    if not isinstance(value, Mapping) or not value:
        what = "an empty dict" if isinstance(value, Mapping) else f"a {type(value).__name__}"
        return f"{what}, not a StatefulDataLoader state_dict: a resume restarts the epoch"
    if "_snapshot" in value:
        return (
            _fields(value, MULTI, "")
            or _fields(value["_snapshot"], SNAPSHOT, "_snapshot.")
            or _fields(value["_snapshot"]["_main_snapshot"], MAIN, "_snapshot._main_snapshot.")
            or _workers(value["_snapshot"])
        )
    if "_num_yielded" in value:
        return _fields(value, SINGLE, "")
    shown = sorted(map(str, value))[:5]
    return f"keys {shown} are not a StatefulDataLoader state_dict's: a resume restarts the epoch"


def _fields(d: Any, spec: Mapping[str, str], where: str) -> str | None:
    if not isinstance(d, Mapping):
        return f"{where.rstrip('.') or 'the state'} is a {type(d).__name__}, not a dict: the resumed loader raises"
    for key, kind in spec.items():
        if key not in d:
            return f"no {where}{key}: the resumed loader raises KeyError at its first batch"
        v = d[key]
        ok = {
            _INT: isinstance(v, int) and not isinstance(v, bool) and v >= -1,
            _BOOL: isinstance(v, bool),
            _DICT: v is None or isinstance(v, Mapping),
            _ANY: True,
        }.get(kind, isinstance(v, Mapping))
        if not ok:
            want = kind if kind in (_INT, _BOOL, _DICT) else "dict"
            return f"{where}{key} is {type(v).__name__} {_short(v)}, not {want}: the resumed loader raises"
    return None


def _workers(snapshot: Mapping) -> str | None:
    workers, n = snapshot["_worker_snapshots"], snapshot["_main_snapshot"]["_num_workers"]
    want = {f"worker_{i}" for i in range(n)}
    if set(map(str, workers)) != want:
        return (
            f"_snapshot._worker_snapshots holds {sorted(map(str, workers))[:5]}, _num_workers is {n}: the resumed "
            "loader's worker check fails"
        )
    odd = [k for k, w in workers.items() if not isinstance(w, Mapping)]
    if odd:
        return f"_snapshot._worker_snapshots[{odd[0]!r}] is not a dict: the resumed loader raises"
    return None


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."
