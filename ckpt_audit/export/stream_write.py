"""Export without torch: each tensor's bytes copied from the shards' stored zip entries into safetensors, in blocks.

torch.save writes every storage as a stored (uncompressed) zip entry, and readers.pt reads each tensor's
storage key, offset, shape, stride and DTensor placement without torch or running the pickle. A merged tensor is then
a byte copy: Shard(0) pieces follow one another, Shard(d>0) pieces are interleaved a block of rows at a time, HSDP
replicas after the first are never opened, and a cast (bf16/fp16/fp32) is done by numpy on the same blocks. Where no
cast is needed (every tensor of an FSDP2 or Megatron checkpoint saved in the dtype exported) the pieces' bytes are
read with preadv into one reused 1 MiB buffer, rows of a Shard(d>0) piece scattered to their places by the kernel,
and numpy is never imported. A cast reads through read-only file mappings whose pages are dropped from this process
after each block (MADV_DONTNEED on a file mapping only forgets pages; the next touch re-reads the file). Memory is a
fixed block budget whatever the model's size.

In the same pass: every storage entry copied whole is checked against the CRC-32 torch recorded for it (so the
bytes exported are the bytes the source check read), each output file is hashed as written (xxh3-128, what the
marker and catalog record; the read-back re-reads the file and compares it) and each tensor gets an xxh3-64 that
names the tensor when a file reads back different.

A Plan can come from elsewhere: export_megatron plans a Megatron dist_ckpt's chunks the same way (pieces of stored
zip entries inside `.distcp` items), and export_check compares an HF directory with a plan through `tensor_bytes`.

torch stays the oracle (export.py, engine "torch"): tests export every trainer tree both ways and compare the files
byte for byte. What this module cannot do exactly (legacy containers, big-endian files, float8 or float64 casts to
half types, tensor kinds the reader does not inspect) raises StreamUnsupported before anything is written, and the
caller falls back to torch.
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

from ckpt_audit.readers import safetensors_header
from ckpt_audit.readers.pt import PtStructure, TensorInfo, read_pt_structure
from ckpt_audit.readers.ptzip import ZipEntry, ZipFormatError, payload_offset
from ckpt_audit.rules.hf_trainer import TIED_EMBEDDINGS


class _Named(Protocol):  # an output tensor of either engine (Planned here, export._Tensor)
    @property
    def name(self) -> str: ...


T = TypeVar("T", bound=_Named)

try:  # isal's crc32 runs ~4x faster than the system zlib's (bench/README.md, bench_hash)
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a declared dependency
    from zlib import crc32 as _crc32

# bytes per block: the memory budget is a few of these, never a tensor. 1 MiB: writes of 2 MiB and more into the page
# cache ran 2-5x slower here at random (ext4 large folios: bench/README.md), and a block stays in the CPU's cache
# from the read through the CRC, both hashes and the write
BLOCK = 1024 * 1024
_IOV_MAX = 1024  # iovecs one preadv takes (Linux's UIO_MAXIOV)
_MARGIN = 256 * 1024  # dropped around each block as well (see Maps.release)
FLOATS = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})
ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
SAFETENSORS_DTYPE = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
_FROM_SAFETENSORS = {v: k for k, v in SAFETENSORS_DTYPE.items()}
# numpy has no bfloat16 or float8: their bits travel as unsigned ints of the same width
_NUMPY = {
    "float64": "<f8",
    "float32": "<f4",
    "float16": "<f2",
    "bfloat16": "<u2",
    "int64": "<i8",
    "int32": "<i4",
    "int16": "<i2",
    "int8": "i1",
    "uint8": "u1",
    "bool": "?",
    "float8_e4m3fn": "u1",
    "float8_e5m2": "u1",
}
# casts numpy does bit-exactly as torch does (via float32, which holds every half value exactly)
EXACT_CASTS = {(a, b) for a in ("float32", "float16", "bfloat16") for b in ("float32", "float16", "bfloat16")} | {
    ("float64", "float32")
}


class StreamUnsupported(Exception):
    """This checkpoint needs the torch engine; the message says why in one line."""


class StreamError(Exception):
    """A one-line reason the export cannot go on (the caller turns it into ExportError)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Piece:
    """One rank's part of a tensor: an array laid out at `offset` in `path`."""

    path: str
    offset: int  # byte offset of element [0, ..., 0]
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    entry: ZipEntry | None = None  # set when the piece is exactly its storage entry: CRC-checked as it is copied


@dataclass(frozen=True, slots=True, kw_only=True)
class Planned:
    name: str
    shape: tuple[int, ...]
    dtype: str  # source dtype name, torch's spelling
    pieces: tuple[Piece, ...]
    dim: int | None = None  # concatenation dim; None: a single piece
    to: str | None = None  # its own cast when no target is asked (zero_to_fp32 makes floating buffers float32)

    def out_dtype(self, target: str | None) -> str:
        if target is not None and self.dtype in FLOATS:
            return target
        return self.to or self.dtype

    def nbytes(self, target: str | None) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * ITEMSIZE[self.out_dtype(target)]


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    kind: str  # "fsdp-shards" | "hf-weights"
    world_size: int | None
    tensors: tuple[Planned, ...]
    warnings: tuple[str, ...] = ()


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


def _numpy():
    """numpy, imported on first use. Export uses it for casts and row gathers only, never BLAS, so OpenBLAS is asked
    for one thread unless the user chose: its per-core thread pool made `import numpy` 0.4 s wall, 0.22 s CPU
    instead of 0.21 and 0.16 here (bench/README.md, issue 16, fourth round). Once numpy is loaded this changes
    nothing."""
    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import numpy

    return numpy


# ---------------------------------------------------------------------------------------------------- planning


def plan_shards(files: dict[int, Path], world_size: int, role_dir: Path) -> Plan:
    """Which bytes of which rank file make each full tensor, read from the pickles alone (no torch)."""
    first = _structure(files[0])
    mesh = _mesh_ranks(first, world_size)
    width = mesh[1]
    ranks = list(mesh[0][:width])  # HSDP: ranks along the leading (replicate) dims hold copies; read the first row
    if 0 not in ranks:
        raise StreamError(f"{role_dir}: rank 0 is not in the first replica of mesh {list(mesh[0])}")
    structs = {0: first}
    for r in ranks:
        if r not in structs:
            structs[r] = _structure(files[r])
    keys0 = list(first.keys)
    for r, s in structs.items():
        if set(s.keys) != set(keys0):
            extra = sorted(set(s.keys) ^ set(keys0))[:3]
            raise StreamError(f"rank {r} and rank 0 hold different keys (e.g. {', '.join(extra)})")
    locate = {r: _Locator(files[r], structs[r]) for r in ranks}
    top = {r: {str(t.key_path[0]): t for t in s.tensors if len(t.key_path) == 1} for r, s in structs.items()}
    tree = first.tree if isinstance(first.tree, dict) else {}
    values = {str(k): v for k, v in tree.items()}
    warnings: list[str] = []
    out: list[Planned] = []
    for key in keys0:
        v0 = top[0].get(key)
        if v0 is None:
            warnings.append(f"{key}: not a tensor ({type(values.get(key)).__name__}); skipped")
            continue
        if v0.dtype not in ITEMSIZE or v0.storage_key is None:
            raise StreamUnsupported(f"{key}: a {v0.dtype} tensor on {v0.device}")
        if v0.is_dtensor:
            out.append(_plan_dtensor(key, v0, ranks, top, locate))
        else:
            pieces = [locate[r].piece(top[r][key]) for r in ranks]
            t = Planned(name=key, shape=v0.shape, dtype=v0.dtype, pieces=(pieces[0],))
            if len(pieces) > 1 and not all(
                top[r][key].shape == v0.shape and top[r][key].dtype == v0.dtype and _same_bytes(p, pieces[0], v0.dtype)
                for r, p in zip(ranks[1:], pieces[1:])
            ):
                shape = (sum(top[r][key].shape[0] for r in ranks), *v0.shape[1:])
                t = replace(t, dim=0, pieces=tuple(pieces), shape=shape)  # what verl's merger does
                warnings.append(f"{key}: plain tensor differs across ranks; concatenated on dim 0")
            out.append(t)
    for loc in locate.values():
        loc.close()
    return Plan(kind="fsdp-shards", world_size=world_size, tensors=tuple(out), warnings=tuple(warnings))


def plan_hf(paths: list[Path]) -> Plan:
    """HF safetensors already in huggingface/: each tensor one piece, in the order safetensors lists keys."""
    out: list[Planned] = []
    for p in paths:
        try:
            header = safetensors_header.read(str(p))
        except OSError as exc:
            raise StreamError(f"{p}: not a readable safetensors file ({exc.strerror or exc})") from None
        if header.problems:  # what safetensors itself refuses to load
            raise StreamError(f"{p}: not a readable safetensors file ({header.problems[0]})")
        for key in sorted(header.tensors):
            v = header.tensors[key]
            dtype = _FROM_SAFETENSORS.get(v["dtype"])
            if dtype is None:
                raise StreamUnsupported(f"{p}: {key} has dtype {v['dtype']}")
            shape = tuple(v["shape"])
            start = v["data_offsets"][0]
            piece = Piece(path=str(p), offset=8 + header.length + start, shape=shape, strides=c_strides(shape))
            out.append(Planned(name=key, shape=shape, dtype=dtype, pieces=(piece,)))
    return Plan(kind="hf-weights", world_size=None, tensors=tuple(out))


def _structure(path: Path) -> PtStructure:
    try:
        s = read_pt_structure(path)
    except OSError as exc:
        raise StreamError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if s.unsafe_globals:  # what torch.load(weights_only=True) refuses too; nothing of it is ever run
        raise StreamError(f"{path}: cannot load safely (it asks for {sorted(s.unsafe_globals)[0]})")
    if s.container != "zip":
        raise StreamUnsupported(f"{path}: {s.container} container")
    if s.problems or s.notes:  # notes: tensors the reader left unread (quantized, subclasses)
        raise StreamUnsupported(f"{path}: {(*s.problems, *s.notes)[0]}")
    if s.byteorder == "big":
        raise StreamUnsupported(f"{path}: big-endian storages")
    return s


def _mesh_ranks(first: PtStructure, world_size: int) -> tuple[tuple[int, ...], int]:
    """(mesh ranks in row-major order, size of the last mesh dim), from the first DTensor in key order."""
    for t in sorted((t for t in first.tensors if t.is_dtensor and len(t.key_path) == 1), key=lambda t: t.key):
        shape = t.mesh_shape
        if not shape:
            raise StreamUnsupported(f"{t.key}: device mesh not readable")
        ranks = t.mesh_ranks if t.mesh_ranks is not None else tuple(range(_numel(shape)))
        if len(ranks) != world_size:
            raise StreamError(f"device mesh {list(ranks)} does not cover world size {world_size}")
        return ranks, shape[-1]
    return tuple(range(world_size)), world_size


def _plan_dtensor(key: str, v0: TensorInfo, ranks: list[int], top, locate) -> Planned:
    placements = v0.placements
    for r in ranks:
        if top[r][key].placements != placements:
            raise StreamError(f"{key}: placements differ between rank 0 and rank {r}")
    if any(p != "Replicate()" for p in placements[:-1]):
        raise StreamError(f"{key}: placements {placements} shard a replicate mesh dim; unsupported")
    if v0.global_shape is None:
        raise StreamUnsupported(f"{key}: DTensor without its global shape")
    last = placements[-1] if placements else ""
    shape = v0.global_shape
    if last == "Replicate()":
        return Planned(name=key, shape=shape, dtype=v0.dtype, pieces=(locate[0].piece(v0),))
    if last.startswith("Shard(") and last[6:-1].isdigit():
        dim = int(last[6:-1])
        infos = [top[r][key] for r in ranks]
        if any(t.dtype != v0.dtype or len(t.shape) != len(shape) for t in infos):
            raise StreamError(f"{key}: local shards differ in dtype or rank")
        joined = sum(t.shape[dim] for t in infos)
        if joined != shape[dim]:
            raise StreamError(f"{key}: shards join to {joined} along dim {dim}, not {shape[dim]}")
        pieces = tuple(locate[r].piece(t) for r, t in zip(ranks, infos))
        return Planned(name=key, shape=shape, dtype=v0.dtype, pieces=pieces, dim=dim)
    raise StreamError(f"{key}: placement {last} is not supported (only Shard(d) and Replicate)")


class _Locator:
    """Storage key -> (entry, payload offset) of one rank file; one local-header read per storage used."""

    def __init__(self, path: Path, s: PtStructure) -> None:
        self.path = str(path)
        cut = len(s.prefix) + 1 if s.prefix is not None else 0
        self.entries = {e.name[cut + 5 :]: e for e in s.entries if e.name[cut:].startswith("data/")}
        self.fd = os.open(self.path, os.O_RDONLY)

    def piece(self, t: TensorInfo) -> Piece:
        entry = self.entries.get(t.storage_key or "")
        if entry is None or not entry.stored:
            raise StreamUnsupported(f"{self.path}: storage {t.storage_key} of {t.key} is not a stored entry")
        try:
            start = payload_offset(self.fd, entry)
        except ZipFormatError as exc:
            raise StreamError(f"{self.path}: {exc}") from None
        item = ITEMSIZE[t.dtype]
        nbytes = _numel(t.shape) * item
        whole = t.storage_offset == 0 and nbytes == entry.size and _contiguous(t.shape, t.stride)
        return Piece(
            path=self.path,
            offset=start + t.storage_offset * item,
            shape=t.shape,
            strides=t.stride,
            entry=entry if whole and nbytes else None,
        )

    def close(self) -> None:
        os.close(self.fd)


# ---------------------------------------------------------------------------------------------------- writing


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
            if _same_tensor(lm, emb, maps):
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

    # never fork: the caller's source check runs on a thread beside this
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    done: dict[int, tuple[int, str]] = {}
    pool = cf.ProcessPoolExecutor(max_workers=min(jobs, len(files)), mp_context=mp.get_context(method))
    try:
        running = {
            pool.submit(_write_and_read_back, path, group, target, check_crc, verify): i
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


def _write_and_read_back(path: Path, group: list[Planned], target, check_crc: bool, verify: bool) -> tuple[int, str]:
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
    # not fsynced here: the caller syncs every file of the export once, after the read-back (export._sync_tree)
    return _Written(
        size=len(head) + offset,
        data_start=len(head),
        file_hash=whole.hexdigest(),
        tensor_hashes=tuple(sums),
        lengths=tuple(t.nbytes(target) for t in tensors),
    )


def tensor_bytes(t: Planned, dst: str, maps: Maps, crcs: dict[int, int] | None = None) -> Iterator[memoryview]:
    """The bytes of tensor `t` as written in dtype `dst`, a block at a time; each block is valid until the next is
    asked for. `crcs` (piece index -> running CRC-32): the pieces whose storage CRC is computed on the way."""
    crcs = {} if crcs is None else crcs
    if (runs := _runs(t, dst)) is not None:  # the output is runs of the pieces' bytes: no numpy (~0.2 s to import)
        yield from _gather(t, *runs, maps, crcs)
        return
    np = _numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        for block, sources in _blocks(t, maps):
            for i, src in sources:
                if i in crcs:
                    crcs[i] = _crc32(_bytes(src), crcs[i])
            yield _bytes(np.ascontiguousarray(_cast(block, t.dtype, dst)))
            for i, src in sources:
                maps.release(t.pieces[i], src)


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
    or raises; export._sync_tree's later fsync of these files finds nothing left to write."""

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


# ---------------------------------------------------------------------------------------------------- blocks


class Maps:
    """The source files, each opened once: a descriptor (and one buffer) for _gather, a read-only map for numpy's
    path, whose pages are dropped after each block."""

    def __init__(self) -> None:
        self.maps: dict[str, mmap.mmap] = {}
        self.addresses: dict[str, int] = {}
        self.crc_off: dict[str, bool] = {}
        self.fds: dict[str, int] = {}
        self.sizes: dict[str, int] = {}
        self.buf: memoryview | None = None

    def __enter__(self) -> Maps:
        return self

    def __exit__(self, *exc) -> None:
        for fd in self.fds.values():
            os.close(fd)
        for m in self.maps.values():
            try:
                m.close()
            except BufferError:  # a numpy view still alive (an exception unwinding): the GC closes it
                pass

    def get(self, path: str) -> mmap.mmap:
        m = self.maps.get(path)
        if m is None:
            with open(path, "rb") as fh:
                m = self.maps[path] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        return m

    def buffer(self) -> memoryview:
        """The one BLOCK-sized buffer _gather reads into (anonymous memory, made once)."""
        if self.buf is None:
            self.buf = memoryview(mmap.mmap(-1, BLOCK))
        return self.buf

    def fd(self, p: Piece, nbytes: int) -> int:
        """A read descriptor of p.path (opened once), after checking that `nbytes` from p.offset lie in the file."""
        fd = self.fds.get(p.path)
        if fd is None:
            fd = self.fds[p.path] = os.open(p.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            self.sizes[p.path] = os.fstat(fd).st_size
        if p.offset < 0 or p.offset + nbytes > self.sizes[p.path]:
            raise StreamError(f"{p.path}: a tensor's bytes lie outside the file")
        return fd

    def read(self, p: Piece, fd: int, views: list[memoryview], pos: int) -> None:
        """Fill `views` with the file's bytes from `pos` on, in order (preadv, IOV_MAX views a call). The range was
        inside the file when it was opened: a short read is a file cut under the export."""
        for c in range(0, len(views), _IOV_MAX):
            part = views[c : c + _IOV_MAX]
            want = sum(len(v) for v in part)
            if os.preadv(fd, part, pos) != want:
                raise StreamError(f"{p.path}: ends early (truncated while it was exported?)")
            pos += want

    def crc_recorded(self, path: str) -> bool:
        """False when torch saved this file with CRCs disabled (every entry's CRC is 0). A `.distcp` is many zips:
        its planner (export_megatron) gives a piece its entry only when that piece's own zip records CRCs."""
        if path.endswith(".distcp"):
            return True
        if path not in self.crc_off:
            from ckpt_audit.readers.ptzip import open_archive

            self.crc_off[path] = not open_archive(path).crc_disabled
        return self.crc_off[path]

    def view(self, p: Piece, dtype: str):
        np = _numpy()

        item = ITEMSIZE[dtype]
        try:
            return np.ndarray(
                p.shape,
                dtype=np.dtype(_NUMPY[dtype]),
                buffer=self.get(p.path),
                offset=p.offset,
                strides=tuple(s * item for s in p.strides),
            )
        except (TypeError, ValueError) as exc:
            raise StreamError(f"{p.path}: a tensor's bytes lie outside the file ({exc})") from None

    def release(self, p: Piece, block) -> None:
        """Drop the pages under `block` (a numpy view into p's map) from this process."""
        if block.size == 0:
            return
        if p.path not in self.addresses:
            np = _numpy()
            self.addresses[p.path] = np.frombuffer(self.maps[p.path], dtype=np.uint8, count=1).ctypes.data
        base = block.__array_interface__["data"][0] - self.addresses[p.path]
        extent = block.itemsize + sum((n - 1) * s for n, s in zip(block.shape, block.strides))
        self.drop(p.path, base, extent)

    def drop(self, path: str, base: int, extent: int) -> None:
        """Drop the pages of bytes [base, base + extent) of `path`'s map from this process."""
        if not hasattr(mmap, "MADV_DONTNEED") or extent <= 0:
            return
        m = self.maps[path]
        # with a margin: the kernel maps pages around a faulting one (fault-around, 64 KiB), so pages of the pieces
        # before and after get mapped too and would stay resident, ~100 KiB a tensor, growing with the model
        lo = max(0, (base - _MARGIN) // mmap.PAGESIZE * mmap.PAGESIZE)
        hi = min(len(m), base + extent + _MARGIN)
        if hi > lo:
            m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def _runs(t: Planned, dst: str) -> tuple[int, list[int]] | None:
    """(outer, run bytes of each piece) when the output is, for each of `outer` indices before the join dim, each
    piece's next `run` bytes in turn: no cast and every piece in C order. Dim 0 (FSDP2 shards every parameter on
    it) and one piece: outer 1, each piece whole. Dim 1 (Megatron's row-parallel layers): a row of each piece in
    turn. None: numpy's path."""
    if dst != t.dtype or not all(_contiguous(p.shape, p.strides) for p in t.pieces):
        return None
    d = t.dim or 0
    outer = _numel(t.shape[:d])
    if any(_numel(p.shape[:d]) != outer for p in t.pieces):
        return None
    return outer, [_numel(p.shape[d:]) * ITEMSIZE[t.dtype] for p in t.pieces]


def _gather(t: Planned, outer: int, runs: list[int], maps: Maps, crcs: dict[int, int]) -> Iterator[memoryview]:
    """tensor_bytes for a tensor `_runs` describes: read with preadv into one reused buffer, a piece's runs of a block
    scattered into their places in one call, then CRC'd, hashed and written from there. No mapping of the source
    (its page faults and MADV_DONTNEED cost more than the copy pread makes) and the same bytes for all three."""
    row = sum(runs)
    buf = maps.buffer()
    fds = [maps.fd(p, outer * n) for p, n in zip(t.pieces, runs)]
    if outer > 1 and row <= len(buf):  # several outer indices a block: each piece's rows scattered in one call
        step = len(buf) // row
        for o in range(0, outer, step):
            k = min(step, outer - o)
            at = 0
            for i, (p, n) in enumerate(zip(t.pieces, runs)):
                if n:
                    iov = [buf[j * row + at : j * row + at + n] for j in range(k)]
                    maps.read(p, fds[i], iov, p.offset + o * n)
                    if i in crcs:
                        for v in iov:
                            crcs[i] = _crc32(v, crcs[i])
                at += n
            yield buf[: k * row]
        return
    for o in range(outer):  # a run at a time, a buffer at a time
        for i, (p, n) in enumerate(zip(t.pieces, runs)):
            for s in range(0, n, len(buf)):
                view = buf[: min(len(buf), n - s)]
                maps.read(p, fds[i], [view], p.offset + o * n + s)
                if i in crcs:
                    crcs[i] = _crc32(view, crcs[i])
                yield view


def _rows(v, budget: int = BLOCK):
    """Slices of `v` along dim 0 of about `budget` bytes (a contiguous array is flattened first)."""
    if v.ndim == 0 or v.flags.c_contiguous:
        v = v.reshape(-1)
    row = max(1, v[:1].nbytes if v.shape[0] else 1)
    step = max(1, budget // row)
    for r in range(0, v.shape[0], step):
        yield v[r : r + step]


def _blocks(t: Planned, maps: Maps) -> Iterator[tuple[object, list[tuple[int, object]]]]:
    """(block in the source dtype, [(piece index, the source view it came from)]) in output byte order."""
    np = _numpy()

    views = [maps.view(p, t.dtype) for p in t.pieces]
    if t.dim is None or t.dim == 0:
        for i, v in enumerate(views):
            if v.size:
                for b in _rows(v):
                    yield b, [(i, b)]
        return
    live = [(i, v) for i, v in enumerate(views) if v.size]
    if not live:
        return
    rows = live[0][1].shape[0]
    row_bytes = sum(v[:1].nbytes for _i, v in live) or 1
    step = max(1, BLOCK // row_bytes)
    for r in range(0, rows, step):
        parts = [(i, v[r : r + step]) for i, v in live]
        yield np.concatenate([b for _i, b in parts], axis=t.dim), parts


def _bytes(a) -> memoryview:
    np = _numpy()

    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def _cast(a, src: str, dst: str):
    """torch's `.to(dst)` on `a` (bfloat16 as uint16 bits), bit for bit: round to nearest even through float32."""
    np = _numpy()

    if src == dst:
        return a
    if src == "bfloat16":
        f = (a.astype(np.uint32) << 16).view(np.float32)
    else:
        f = a.astype(np.float32)
    if dst == "float32":
        return f
    nan = np.isnan(f)
    if dst == "float16":
        h = f.astype(np.float16).view(np.uint16)
        h[nan] |= 0x200  # torch quiets a NaN; numpy keeps a signalling payload
        return h
    u = f.view(np.uint32)
    b = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    b[nan] = 0xFFFF  # torch's vectorised CPU cast writes all-ones for NaN
    return b


def _same_bytes(a: Piece, b: Piece, dtype: str, maps: Maps | None = None) -> bool:
    """Bit for bit (NaN equals itself, -0.0 differs from 0.0), a block at a time."""
    np = _numpy()

    if maps is None:
        with Maps() as own:
            return _same_bytes(a, b, dtype, own)
    va, vb = maps.view(a, dtype), maps.view(b, dtype)
    if va.shape != vb.shape:
        return False
    for x, y in zip(_rows(va), _rows(vb)):
        same = np.array_equal(np.frombuffer(_bytes(x), np.uint8), np.frombuffer(_bytes(y), np.uint8))
        maps.release(a, x)
        maps.release(b, y)
        if not same:
            return False
    return True


def _same_tensor(a: Planned, b: Planned, maps: Maps) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.dim != b.dim or len(a.pieces) != len(b.pieces):
        return False
    return all(_same_bytes(pa, pb, a.dtype, maps) for pa, pb in zip(a.pieces, b.pieces))


def _dominant_float(tensors: list[Planned]) -> str:
    sizes: dict[str, int] = {}
    for t in tensors:
        if t.dtype in FLOATS:
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.nbytes(None)
    return max(sizes, key=sizes.__getitem__) if sizes else "float32"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    acc = 1
    for n, s in zip(reversed(shape), reversed(stride)):
        if n != 1 and s != acc:
            return False
        acc *= n
    return True
