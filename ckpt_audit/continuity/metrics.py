"""Reading training metrics logs into one shape: a `MetricLog` of `Record(step, values, time)` in file order.

Formats: JSON lines (our harness's flat {"step", "loss", ...}; verl's file logger {"step": N, "data": {...}};
nested dicts flattened with "/"), verl's console lines ("step:3 - actor/loss:0.1 - ..."), CSV exports with a step
column (TensorBoard/W&B downloads), and TensorBoard event files when the optional `tensorboard` package is installed.
Order is kept as written: repeated or reset step counters are evidence of a resume, never sorted away.
"""

from __future__ import annotations

import csv
import os
import re
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TextIO

from ckpt_audit.readers import bounded_json

STEP_KEYS = ("step", "global_step", "training/global_step", "_step", "iteration", "iter", "Step")
TIME_KEYS = ("time", "timestamp", "_timestamp", "wall_time", "Wall time")
DEFAULT_METRICS = ("loss", "train/loss", "actor/loss", "actor/pg_loss", "critic/vf_loss", "train_loss")
_CONSOLE = re.compile(r"(?:^|\s-\s|\s)step:(\d+)\s+-\s+(.*)$")
MAX_LINE = 1 << 20  # characters: a record is a few hundred; a longer line is skipped as bad, never held whole


class MetricsError(Exception):
    """A metrics file that cannot be read at all (one line for the CLI)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Record:
    step: int
    values: dict[str, float]
    time: float | None = None  # seconds since the epoch, when the logger wrote one
    source: str = ""  # file it came from
    line: int = 0  # 1-based line (or event index) in that file


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricLog:
    paths: tuple[str, ...]
    records: tuple[Record, ...]
    file_starts: tuple[int, ...] = (0,)  # index into records where each file begins
    bad_lines: tuple[tuple[str, int, str], ...] = ()  # (path, line, why) for lines that could not be parsed

    @property
    def metric_names(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for r in self.records:
            seen.update(dict.fromkeys(r.values))
        return tuple(seen)

    def choose_metric(self, name: str | None) -> str:
        """`name` if logged, else the first default loss name present; MetricsError when there is none."""
        names = self.metric_names
        if name is not None:
            if name not in names:
                raise MetricsError(
                    f"metric {name!r} is not in {', '.join(self.paths)} (logged: {', '.join(names[:12]) or 'nothing'})"
                )
            return name
        for cand in DEFAULT_METRICS:
            if cand in names:
                return cand
        losses = [n for n in names if n.endswith("loss")]
        if losses:
            return losses[0]
        raise MetricsError(
            f"no loss metric in {', '.join(self.paths)}; choose one with --metric "
            f"(logged: {', '.join(names[:12]) or 'nothing'})"
        )

    def series(self, metric: str) -> Series:
        pts = [(i, r.step, r.values[metric], r.time) for i, r in enumerate(self.records) if metric in r.values]
        return Series(
            metric=metric,
            steps=tuple(p[1] for p in pts),
            values=tuple(p[2] for p in pts),
            times=tuple(p[3] for p in pts),
            positions=tuple(p[0] for p in pts),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Series:
    """One metric's values in log order. `positions` index the MetricLog's records."""

    metric: str
    steps: tuple[int, ...]
    values: tuple[float, ...]
    times: tuple[float | None, ...] = ()
    positions: tuple[int, ...] = ()

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[int, float]], *, metric: str = "loss") -> Series:
        pts = list(pairs)
        return cls(
            metric=metric,
            steps=tuple(int(s) for s, _ in pts),
            values=tuple(float(v) for _, v in pts),
            times=(None,) * len(pts),
            positions=tuple(range(len(pts))),
        )

    def __len__(self) -> int:
        return len(self.steps)

    def by_step(self) -> dict[int, float]:
        """One value per step, the last logged winning: a resumed run logs a step again, and the later attempt
        is the one whose checkpoint sits on disk (retention ranks checkpoints by this)."""
        return dict(zip(self.steps, self.values, strict=True))


def read_metrics(paths: Sequence[str | os.PathLike[str]]) -> MetricLog:
    """Read each file in the order given (one file per attempt is a common layout) into one MetricLog.

    A directory stands for its TensorBoard event files, oldest writer first (verl's tensorboard_log/P/E holds one
    per attempt)."""
    files = [f for p in paths for f in (_event_files(os.fspath(p)) if os.path.isdir(p) else [os.fspath(p)])]
    records: list[Record] = []
    starts: list[int] = []
    bad: list[tuple[str, int, str]] = []
    for path in files:
        starts.append(len(records))
        recs, errs = _read_one(path)
        records.extend(_merge_split_steps(recs))
        bad.extend(errs)
    if not records:
        raise MetricsError(f"no step-numbered records in {', '.join(files)}")
    return MetricLog(paths=tuple(files), records=tuple(records), file_starts=tuple(starts), bad_lines=tuple(bad))


def _event_files(directory: str) -> list[str]:
    """The event files directly in `directory`, in the order their writers started: the name carries the start
    time (events.out.tfevents.<unix seconds>.<host>.<pid>.<n>)."""
    try:
        names = [n for n in os.listdir(directory) if "tfevents" in n and os.path.isfile(os.path.join(directory, n))]
    except OSError as exc:
        raise MetricsError(f"cannot list {directory}: {exc.strerror or exc}") from None
    if not names:
        raise MetricsError(f"{directory} holds no TensorBoard event files (events.out.tfevents.*)")

    def started(name: str) -> tuple[int, str]:
        field = name.split("tfevents.", 1)[-1].split(".", 1)[0]
        return (int(field) if field.isdigit() else 0, name)

    return [os.path.join(directory, n) for n in sorted(names, key=started)]


def _merge_split_steps(records: list[Record]) -> list[Record]:
    """Join adjacent records of one step with disjoint metric names (TensorBoard writes one event per tag;
    loggers often log several dicts per step). The same metric twice stays two records: a real duplicate."""
    out: list[Record] = []
    for r in records:
        prev = out[-1] if out else None
        if prev is not None and prev.step == r.step and not (prev.values.keys() & r.values.keys()):
            out[-1] = Record(
                step=prev.step,
                values={**prev.values, **r.values},
                time=prev.time or r.time,
                source=prev.source,
                line=prev.line,
            )
        else:
            out.append(r)
    return out


def _read_one(path: str) -> tuple[list[Record], list[tuple[str, int, str]]]:
    name = os.path.basename(path)
    if "tfevents" in name:
        return _read_tfevents(path)
    try:
        if name.lower().endswith(".csv"):
            with open(path, newline="", encoding="utf-8") as fh:
                return _read_csv(fh, path)
        with open(path, encoding="utf-8", errors="replace") as fh:
            return _read_lines(_lines(fh), path)
    except OSError as exc:
        raise MetricsError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (csv.Error, UnicodeDecodeError) as exc:
        raise MetricsError(f"{path} is not a readable CSV: {exc}") from None


def _lines(fh: TextIO) -> Iterator[str | None]:
    """The file's lines, None for one longer than MAX_LINE (read past in pieces)."""
    while line := fh.readline(MAX_LINE):
        if len(line) == MAX_LINE and not line.endswith("\n"):
            while (rest := fh.readline(MAX_LINE)) and not rest.endswith("\n"):
                pass
            yield None
        else:
            yield line


def _number(v) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return None


def _flatten(obj: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in obj.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def _record(flat: dict[str, object], path: str, line: int) -> Record | str:
    step = None
    for k in STEP_KEYS:
        if k in flat:
            n = _number(flat[k])
            if n is None or not n.is_integer():
                return f"step {flat[k]!r} is not an integer"
            step = int(n)
            break
    if step is None:
        return "no step field"
    t = None
    for k in TIME_KEYS:
        if k in flat and (n := _number(flat[k])) is not None:
            t = n
            break
    values: dict[str, float] = {}
    for k, v in flat.items():
        if k in STEP_KEYS or k in TIME_KEYS:
            continue
        n = _number(v)
        if n is not None:
            values[k] = n
    return Record(step=step, values=values, time=t, source=path, line=line)


def _read_lines(lines: Iterable[str | None], path: str) -> tuple[list[Record], list[tuple[str, int, str]]]:
    records: list[Record] = []
    bad: list[tuple[str, int, str]] = []
    for i, text in enumerate(lines, 1):
        if text is None:
            bad.append((path, i, f"longer than {MAX_LINE} characters"))
            continue
        text = text.strip()
        if not text:
            continue
        if text.startswith("{"):
            try:
                obj = bounded_json.loads(text, max_bytes=MAX_LINE)
            except ValueError as exc:  # e.g. the last line cut by a crash, or nested past the bound
                bad.append((path, i, f"not JSON: {getattr(exc, 'msg', exc)}"))
                continue
            if not isinstance(obj, dict):
                bad.append((path, i, "not a JSON object"))
                continue
            data = obj.get("data")
            if isinstance(data, dict):  # verl file logger: {"step": N, "data": {...}}
                flat = _flatten(data)
                flat.update({k: v for k, v in obj.items() if k != "data" and not isinstance(v, dict)})
            else:
                flat = _flatten(obj)
        elif m := _CONSOLE.search(text):  # verl console logger: "step:N - key:value - key:value"
            flat = {"step": m.group(1)}
            for part in m.group(2).split(" - "):
                key, sep, val = part.rpartition(":")
                if sep:
                    flat[key.strip()] = val.strip()
        else:
            continue  # other console chatter in a captured stdout log
        rec = _record(flat, path, i)
        if isinstance(rec, str):
            bad.append((path, i, rec))
        else:
            records.append(rec)
    return records, bad


def _read_csv(fh, path: str) -> tuple[list[Record], list[tuple[str, int, str]]]:
    reader = csv.DictReader(fh)
    if not reader.fieldnames or not any(k in reader.fieldnames for k in STEP_KEYS):
        raise MetricsError(f"{path}: CSV has no step column (one of {', '.join(STEP_KEYS[:4])})")
    wide = "Value" in reader.fieldnames and "Step" in reader.fieldnames  # TensorBoard's per-tag export
    tag = os.path.splitext(os.path.basename(path))[0]
    records: list[Record] = []
    bad: list[tuple[str, int, str]] = []
    for i, row in enumerate(reader, 2):
        flat: dict[str, object] = {k: v for k, v in row.items() if k is not None and v not in (None, "")}
        if wide:
            flat = {"step": row.get("Step"), "time": row.get("Wall time"), tag: row.get("Value")}
        rec = _record(flat, path, i)
        if isinstance(rec, str):
            bad.append((path, i, rec))
        else:
            records.append(rec)
    return records, bad


def _read_tfevents(path: str) -> tuple[list[Record], list[tuple[str, int, str]]]:
    try:
        from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
        from tensorboard.compat.proto.event_pb2 import Event
    except ImportError:
        raise MetricsError(
            f"{path}: reading TensorBoard event files needs the optional 'tensorboard' package "
            "(pip install 'ckpt-audit[tensorboard]')"
        ) from None
    records: list[Record] = []
    events = whole = 0
    try:
        size = os.path.getsize(path)
        # raw records (CRC-checked by the loader) parsed here: 3x faster than EventFileLoader, which also
        # migrates every event to the tensor form only TensorBoard's own plugins need
        for events, raw in enumerate(RawEventFileLoader(path).Load(), 1):
            whole += len(raw) + FRAME_OVERHEAD
            event = Event.FromString(raw)
            values = {v.tag: x for v in event.summary.value if (x := _scalar(v)) is not None}
            if values:
                records.append(
                    Record(step=int(event.step), values=values, time=float(event.wall_time), source=path, line=events)
                )
    except Exception as exc:  # a damaged event file: one line, not a protobuf traceback
        raise MetricsError(f"{path}: unreadable TensorBoard event file: {exc}") from None
    # TensorBoard's loader stops quietly at a cut (or damaged) record: what it did not reach is worth a finding,
    # like a cut line
    bad = (
        [
            (
                path,
                events + 1,
                f"event file cut after {whole} of {size} bytes (a crash mid-write, a writer still "
                "writing, or a damaged record); the rest is not read",
            )
        ]
        if whole < size
        else []
    )
    return records, bad


_TENSOR_FORMATS = {1: "<f", 2: "<d"}  # DataType DT_FLOAT, DT_DOUBLE
FRAME_OVERHEAD = 16  # a TFRecord frame: u64 payload length, u32 CRC of it, the payload, u32 CRC of the payload


def _scalar(value) -> float | None:
    """One summary value as a float: torch's and TF1's simple_value, or TF2's scalar tensor."""
    kind = value.WhichOneof("value")
    if kind == "simple_value":
        return float(value.simple_value)
    if kind != "tensor":
        return None
    t = value.tensor
    if t.tensor_shape.dim:  # histograms and other non-scalar tensors are not a metric's value
        return None
    if t.float_val:
        return float(t.float_val[0])
    if t.double_val:
        return float(t.double_val[0])
    fmt = _TENSOR_FORMATS.get(t.dtype)
    if fmt and len(t.tensor_content) == struct.calcsize(fmt):
        return struct.unpack(fmt, t.tensor_content)[0]
    return None
