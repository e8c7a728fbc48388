"""The stream engine's output: a Plan's tensors written as safetensors files under the work directory
(`export_tensors`), in this process or by one worker per file (export --jobs, or the executor export --ray hands in),
each read back once written.

Each output file is hashed as written (xxh3-128, what the marker and catalog record; the read-back re-reads the file
and compares it) and each tensor gets an xxh3-64 that names the tensor when a file reads back different.
`output_shards` names the output files of both engines, as save_pretrained does.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol, TypeVar

import xxhash

from ckpt_audit.export.stream_copy import BLOCK, Maps, same_tensor, tensor_bytes
from ckpt_audit.export.stream_plan import (
    EXACT_CASTS,
    FLOATS,
    SAFETENSORS_DTYPE,
    Plan,
    Planned,
    StreamError,
    StreamUnsupported,
)
from ckpt_audit.rules.hf_trainer import TIED_EMBEDDINGS


class _Named(Protocol):  # an output tensor of either engine (stream_plan.Planned, torch_engine._Tensor)
    @property
    def name(self) -> str: ...


T = TypeVar("T", bound=_Named)


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """What was written under the work directory: tensor count and bytes, dtype, hashes of the weight files."""

    dtype: str
    tensors: int
    total_bytes: int
    hashes: dict[str, tuple[int, str]] = field(default_factory=dict)  # relative path -> (size, xxh3-128)
    lora: bool = False
    warnings: tuple[str, ...] = ()
    read_back: bool = False


def export_tensors(
    plan: Plan,
    tmp: Path,
    *,
    target: str | None,
    max_shard_size: int,
    verify: bool,
    tie: bool,
    check_crc: bool = True,
    tick: Callable[[str], None],
    read_tick: Callable[[], None],
    jobs: int = 1,
    run_files: Callable[..., list[tuple[int, str]]] | None = None,
) -> Outcome:
    """Write the plan's tensors under `tmp` (model*.safetensors, lora_adapter/adapter_model.safetensors). `jobs` > 1:
    each output file is written and read back by one of that many worker processes (_in_workers). `run_files`: an
    executor with _in_workers' signature to use instead (export --ray: cluster.ray_export)."""
    for t in plan.tensors:
        if (dst := t.out_dtype(target)) != t.dtype and (t.dtype, dst) not in EXACT_CASTS:
            raise StreamUnsupported(f"{t.name}: a {t.dtype} to {dst} cast")
    warnings = list(plan.warnings)
    tensors = list(plan.tensors)
    with Maps() as maps:
        names = {t.name for t in tensors}
        if tie and set(TIED_EMBEDDINGS) <= names:
            lm, emb = (next(t for t in tensors if t.name == n) for n in TIED_EMBEDDINGS)
            if same_tensor(lm, emb, maps):
                tensors = [t for t in tensors if t.name != TIED_EMBEDDINGS[0]]
            else:
                warnings.append("tie_word_embeddings is true but lm_head.weight differs from embed_tokens; kept both")
        base = [t for t in tensors if "lora_" not in t.name]
        lora = [t for t in tensors if "lora_" in t.name]
        if lora:
            base = [
                replace(t, name=t.name.removeprefix("base_model.model.").replace(".base_layer.", ".")) for t in base
            ]
            warnings.append(
                f"LoRA adapter ({len(lora)} tensors) exported to lora_adapter/ beside the model; it is "
                "NOT fused into the base weights"
            )
        shards = output_shards(base, lambda t: t.nbytes(target), max_shard_size, tmp)
        files = [(tmp / rel, group) for rel, group in shards]
        if lora:
            (tmp / "lora_adapter").mkdir()
            files.append((tmp / "lora_adapter" / "adapter_model.safetensors", lora))
        parallel = run_files is not None or (jobs > 1 and len(files) > 1)
        if parallel:
            done = (run_files or _in_workers)(files, jobs, target, check_crc, verify, tick, read_tick)
        else:
            written = [_write_file(path, group, target, maps, tick, check_crc) for path, group in files]
    if not parallel:
        syncing = _Syncing([path for path, _group in files])  # the disk's wait beside the read-back's CPU
        try:
            done = [
                (w.size, _read_back(path, group, w, read_tick) if verify else w.file_hash)
                for (path, group), w in zip(files, written)
            ]
        finally:
            syncing.join(raise_error=sys.exc_info()[0] is None)
    hashes = {str(path.relative_to(tmp)): got for (path, _group), got in zip(files, done)}
    return Outcome(
        dtype=target or _dominant_float(base),
        tensors=len(base) + len(lora),
        total_bytes=sum(t.nbytes(target) for t in base + lora),
        hashes=hashes,
        lora=bool(lora),
        warnings=tuple(warnings),
        read_back=verify,
    )


def output_shards(
    tensors: Sequence[T], nbytes: Callable[[T], int], max_shard_size: int, tmp: Path
) -> Iterator[tuple[str, list[T]]]:
    """The output files of both engines, as save_pretrained names them: model.safetensors, or model-i-of-n files
    (a new one begun before a tensor that would take the current one past `max_shard_size`) and, once every file
    has been yielded, their index in `tmp`."""
    groups: list[list[T]] = [[]]
    size = 0
    for t in tensors:
        n = nbytes(t)
        if groups[-1] and size + n > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += n
    if len(groups) == 1:
        yield "model.safetensors", groups[0]
        return
    weight_map = {}
    for i, group in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        yield name, group
        weight_map.update({t.name: name for t in group})
    index = {
        "metadata": {"total_size": sum(nbytes(t) for t in tensors)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _in_workers(files, jobs: int, target, check_crc: bool, verify: bool, tick, read_tick) -> list[tuple[int, str]]:
    """Each output file written and read back by a worker process (`export --jobs`): the files are independent
    once planned, so N processes copy N shards at once. Progress ticks when a file is done. The first failure is
    raised as the worker raised it; the others are cancelled and the running ones awaited, so nothing writes
    under the work directory after this returns or raises."""
    import concurrent.futures as cf
    import multiprocessing as mp
    from concurrent.futures.process import BrokenProcessPool

    from ckpt_audit.export.children import answer_sigint, sigint_held

    # never fork: the caller's source check runs on a thread beside this
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    done: dict[int, tuple[int, str]] = {}
    pool = cf.ProcessPoolExecutor(
        max_workers=min(jobs, len(files)), mp_context=mp.get_context(method), initializer=answer_sigint
    )
    try:
        with sigint_held():  # the forkserver and the workers start here; each printed a traceback at a Ctrl-C
            running = {
                pool.submit(write_and_read_back, path, group, target, check_crc, verify): i
                for i, (path, group) in enumerate(files)
            }
        for fut in cf.as_completed(running):
            i = running[fut]
            done[i] = fut.result()
            for t in files[i][1]:
                tick(t.name)
                if verify:
                    read_tick()
    except BrokenProcessPool:  # killed (SIGBUS on a source truncated under its map, out of memory)
        raise StreamError("an export worker process died (a source file truncated or out of memory?)") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return [done[i] for i in range(len(files))]


def write_and_read_back(path: Path, group: list[Planned], target, check_crc: bool, verify: bool) -> tuple[int, str]:
    """A worker's share of `export --jobs`: one output file, as export_tensors writes and reads back each."""
    with Maps() as maps:
        w = _write_file(path, group, target, maps, _no_tick, check_crc)
    syncing = _Syncing([path])
    try:
        return w.size, _read_back(path, group, w, _no_tick) if verify else w.file_hash
    finally:
        syncing.join(raise_error=sys.exc_info()[0] is None)


def _no_tick(*_args) -> None:
    pass


@dataclass(frozen=True, slots=True)
class _Written:
    size: int
    data_start: int
    file_hash: str
    tensor_hashes: tuple[int, ...]  # xxh3-64 of each tensor's bytes as written
    lengths: tuple[int, ...]  # each tensor's bytes


def _write_file(path: Path, tensors: list[Planned], target, maps: Maps, tick, check_crc: bool) -> _Written:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        n = t.nbytes(target)
        header[t.name] = {
            "dtype": SAFETENSORS_DTYPE[t.out_dtype(target)],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format asks for an 8-byte aligned start of data
    head = len(raw).to_bytes(8, "little") + raw
    whole = xxhash.xxh3_128(head)
    sums = []
    with open(path, "wb") as fh:
        fh.write(head)
        flush = _Writeback(fh.fileno())
        for t in tensors:
            th = xxhash.xxh3_64()
            dst = t.out_dtype(target)
            crcs = {i: 0 for i, p in enumerate(t.pieces) if p.entry is not None and check_crc}
            for mv in tensor_bytes(t, dst, maps, crcs):
                whole.update(mv)
                th.update(mv)
                for a in range(0, len(mv), BLOCK):  # a cast's block can be larger: writes of BLOCK at most
                    fh.write(mv[a : a + BLOCK])
                flush.wrote(len(mv))
            for i, crc in crcs.items():
                p = t.pieces[i]
                if p.entry is not None and maps.crc_recorded(p.path) and (crc & 0xFFFFFFFF) != p.entry.crc:
                    raise StreamError(
                        f"{p.path}: {p.entry.name} fails its CRC-32 as exported (changed since its check?)"
                    )
            sums.append(th.intdigest())
            tick(t.name)
    # not fsynced here: the caller syncs every file of the export once, after the read-back (placement.sync_tree)
    return _Written(
        size=len(head) + offset,
        data_start=len(head),
        file_hash=whole.hexdigest(),
        tensor_hashes=tuple(sums),
        lengths=tuple(t.nbytes(target) for t in tensors),
    )


class _Writeback:
    """Start the disk writing the output while the copy goes on (Linux sync_file_range, SYNC_FILE_RANGE_WRITE: no
    wait), so the one fsync at the end waits for the last blocks only, not the whole file; `cp` + sync pays the
    whole write at its sync. Durability is still the fsync's; this only moves the writing earlier."""

    EVERY = 8 * 1024 * 1024

    def __init__(self, fd: int) -> None:
        self.fd, self.pos, self.started = fd, 0, 0

    def wrote(self, n: int) -> None:
        self.pos += n
        if self.pos - self.started >= self.EVERY and (fn := _sync_file_range()) is not None:
            fn(self.fd, self.started, 0, 2)  # from there to the end: 0; SYNC_FILE_RANGE_WRITE = 2; errors ignored
            self.started = self.pos


class _Syncing:
    """fsync the weight files on a thread while the read-back re-reads them from the page cache: the wait for the
    disk and the read-back's hashing overlap instead of following each other. Joined before export_tensors returns
    or raises; placement.sync_tree's later fsync of these files finds nothing left to write."""

    def __init__(self, paths: list[Path]) -> None:
        import threading

        self.error: OSError | None = None
        self.thread = threading.Thread(target=self._run, args=(paths,), name="ckpt-export-fsync", daemon=True)
        self.thread.start()

    def _run(self, paths: list[Path]) -> None:
        try:
            for p in paths:
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as exc:
            self.error = exc

    def join(self, *, raise_error: bool) -> None:
        self.thread.join()
        if raise_error and self.error is not None:
            raise self.error


_SFR: list = []


def _sync_file_range():
    """libc's sync_file_range, or None (not Linux, or no such symbol)."""
    if not _SFR:
        fn = None
        if sys.platform.startswith("linux"):
            import ctypes

            try:
                fn = ctypes.CDLL(None, use_errno=True).sync_file_range
                fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
            except (OSError, AttributeError):
                fn = None
        _SFR.append(fn)
    return _SFR[0]


def _read_back(path: Path, tensors: list[Planned], w: _Written, read_tick) -> str:
    """Re-read the written file in bounded chunks: it must hash (xxh3-128) as it did when written. One hash pass; only
    a file that reads back different is read again, tensor by tensor, to name the first tensor that differs."""
    buf = memoryview(mmap.mmap(-1, BLOCK))
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size != w.size:
            raise StreamError(f"export check failed: {path.name} has the wrong size")
        whole = xxhash.xxh3_128(os.pread(fd, w.data_start, 0))
        pos = w.data_start
        for left in w.lengths:
            while left:
                k = os.preadv(fd, [buf[: min(left, BLOCK)]], pos)
                if not k:
                    raise StreamError(f"export check failed: {path.name} ends early")
                whole.update(buf[:k])
                pos += k
                left -= k
            read_tick()
        if whole.hexdigest() != w.file_hash:
            pos = w.data_start
            for t, want, n in zip(tensors, w.tensor_hashes, w.lengths):
                th = xxhash.xxh3_64()
                for at in range(pos, pos + n, BLOCK):
                    th.update(os.pread(fd, min(BLOCK, pos + n - at), at))
                if th.intdigest() != want:
                    raise StreamError(f"export check failed: {t.name} differs from the concatenation of its shards")
                pos += n
            raise StreamError(f"export check failed: {path.name} reads back different from what was written")
    finally:
        os.close(fd)
    return w.file_hash


def _dominant_float(tensors: list[Planned]) -> str:
    sizes: dict[str, int] = {}
    for t in tensors:
        if t.dtype in FLOATS:
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.nbytes(None)
    return max(sizes, key=sizes.__getitem__) if sizes else "float32"
