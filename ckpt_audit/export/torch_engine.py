"""The torch engine: the oracle the stream engine is tested against byte for byte, and the fallback for what
streaming cannot do exactly. torch is imported lazily: `ckpt-audit scan` must never pay for it.

verl's merger loads every rank's shard fully, concatenates everything in memory and only then saves: peak
memory is about twice the model. Here each rank file is opened once with
`torch.load(weights_only=True, mmap=True, map_location="cpu")`, so tensors are views into the files, and
the output safetensors are written one tensor at a time: a dim-0 shard is cast and written piece by piece, a
Shard(d>0) tensor is assembled into one buffer of its final size. After each tensor its source pages are
dropped from this process (page_release), so peak memory stays near the largest tensor, not the model.

Handled shapes: FSDP1/FSDP2 DTensors with Shard(0) or Shard(1), uneven and empty trailing shards, HSDP
(`(Replicate(), Shard(d))`: only the first replica is read), world size 1 plain tensors, tied embeddings
(lm_head dropped when the config ties it and the two are equal), LoRA keys (base exported, adapter beside
it, not fused), Megatron checkpoints with HF weights in `huggingface/`.

What was written is then checked against an independent computation: every tensor read back with the
safetensors library must equal `torch.cat` of its shards, bit for bit after the cast.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_audit.export.guard import ExportError
from ckpt_audit.export.page_release import drop_ranges, mapped_ranges, release_pieces
from ckpt_audit.export.result import ExportedFile, ExportResult
from ckpt_audit.export.sources import FSDP, ExportInput, copy_hf_files, read_config, shard_set
from ckpt_audit.export.stream_plan import SAFETENSORS_DTYPE
from ckpt_audit.export.stream_write import output_shards
from ckpt_audit.killpoints import OpCounter
from ckpt_audit.rules.hf_trainer import TIED_EMBEDDINGS

TORCH_EXTRA = "pip install 'ckpt-audit[torch]'"


@dataclass(slots=True, kw_only=True)
class _Tensor:
    """One output tensor: where its pieces are and how they join."""

    name: str
    shape: tuple[int, ...]
    dtype: Any  # torch.dtype of the source
    pieces: list = field(default_factory=list)  # torch tensors (mmap-backed views), in join order
    dim: int | None = None  # concatenation dim; None: a single piece


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def export_torch(inp: ExportInput, tmp: Path, out: Path, *, target: str | None, **args) -> ExportResult:
    """Every rank file loaded with torch (mmap), tensors joined by torch, read back by safetensors. `target`: the
    torch dtype name floating tensors are cast to, None to keep theirs."""
    try:
        import torch  # lazy: see module docstring
    except ImportError:
        raise ExportError(f"the torch engine needs torch ({TORCH_EXTRA})") from None
    source = _ShardSource(inp) if inp.kind == FSDP else _HfSource(inp.hf_weights)
    return _export(source, inp, tmp, out, target=getattr(torch, target) if target else None, torch=torch, **args)


class _ShardSource:
    kind = "fsdp-shards"

    def __init__(self, inp: ExportInput) -> None:
        import logging  # the torch engine only: the stream path does not pay for it

        import torch
        import torch.distributed.tensor  # noqa: F401 - registers DTensor for weights_only loading

        logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)  # "unpickled before PGs"
        self.world_size, files = shard_set(inp)
        first = _load(files[0])
        mesh, names = _mesh_of(first, self.world_size)
        # HSDP: ranks along the leading (replicate) mesh dims hold copies; read the first replica only.
        self.ranks = [int(r) for r in mesh.reshape(-1, mesh.shape[-1])[0].tolist()]
        self.mesh_names = names
        self.states = {0: first} if self.ranks[0] == 0 else {}
        for r in self.ranks:
            if r not in self.states:
                self.states[r] = _load(files[r])
        if 0 not in self.ranks:
            raise ExportError(f"{inp.role_dir}: rank 0 is not in the first replica of mesh {mesh.tolist()}")
        self.warnings: list[str] = []
        self.tensors = self._plan(torch)
        self.ranges = mapped_ranges({str(files[r]) for r in self.ranks})

    def _plan(self, torch) -> list[_Tensor]:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        keys0 = list(self.states[0].keys())
        for r, sd in self.states.items():
            if set(sd.keys()) != set(keys0):
                extra = sorted(set(sd.keys()) ^ set(keys0))[:3]
                raise ExportError(f"rank {r} and rank 0 hold different keys (e.g. {', '.join(extra)})")
        out = []
        for key in keys0:
            v0 = self.states[0][key]
            if not isinstance(v0, torch.Tensor):
                self.warnings.append(f"{key}: not a tensor ({type(v0).__name__}); skipped")
                continue
            if isinstance(v0, DTensor):
                placements = tuple(v0.placements)
                for r in self.ranks:
                    if tuple(self.states[r][key].placements) != placements:
                        raise ExportError(f"{key}: placements differ between rank 0 and rank {r}")
                if any(not isinstance(p, Replicate) for p in placements[:-1]):
                    raise ExportError(f"{key}: placements {placements} shard a replicate mesh dim; unsupported")
                last = placements[-1]
                t = _Tensor(name=key, shape=tuple(v0.shape), dtype=v0.dtype)
                if isinstance(last, Replicate):
                    t.pieces = [v0._local_tensor]
                elif type(last) is Shard:
                    t.dim = last.dim
                    t.pieces = [self.states[r][key]._local_tensor for r in self.ranks]
                    joined = sum(p.shape[t.dim] for p in t.pieces)
                    if joined != t.shape[t.dim]:
                        raise ExportError(f"{key}: shards join to {joined} along dim {t.dim}, not {t.shape[t.dim]}")
                else:
                    raise ExportError(f"{key}: placement {last} is not supported (only Shard(d) and Replicate)")
            else:  # world size 1 (FSDP NO_SHARD) saves plain tensors
                copies = [self.states[r][key] for r in self.ranks]
                t = _Tensor(name=key, shape=tuple(v0.shape), dtype=v0.dtype, pieces=[v0])
                if len(copies) > 1 and not all(c.shape == v0.shape and torch.equal(c, v0) for c in copies[1:]):
                    t.dim, t.pieces = 0, copies  # what verl's merger does with plain tensors
                    t.shape = (sum(c.shape[0] for c in copies), *v0.shape[1:])
                    self.warnings.append(f"{key}: plain tensor differs across ranks; concatenated on dim 0")
            out.append(t)
        return out


class _HfSource:
    """HF safetensors already in huggingface/ (Megatron with mbridge, or FSDP saved with hf_model)."""

    kind = "hf-weights"
    world_size = None

    def __init__(self, weights: tuple[Path, ...]) -> None:
        from safetensors import safe_open

        self.warnings: list[str] = []
        self.handles = [safe_open(str(p), framework="pt") for p in weights]
        self.tensors = []
        for h in self.handles:
            for key in h.keys():
                sl = h.get_slice(key)
                t = h.get_tensor(key)  # mmap-backed by safetensors
                self.tensors.append(_Tensor(name=key, shape=tuple(sl.get_shape()), dtype=t.dtype, pieces=[t]))


def _load(path: Path):
    import torch

    try:
        return torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except Exception as exc:  # a corrupt or unsafe shard is the user's problem, told in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"{path}: cannot load safely ({first[:200]})") from None


def _mesh_of(state: dict, world_size: int):
    import torch
    from torch.distributed.tensor import DTensor

    for key in sorted(state):
        v = state[key]
        if isinstance(v, DTensor):
            mesh = v.device_mesh.mesh.cpu()
            if mesh.numel() != world_size:
                raise ExportError(f"device mesh {mesh.tolist()} does not cover world size {world_size}")
            return mesh, tuple(v.device_mesh.mesh_dim_names or ())
    return torch.arange(world_size).reshape(1, world_size), ("fsdp",)


def _export(
    source, inp: ExportInput, tmp: Path, out: Path, *, target, max_shard_size, verify, progress, hf_dir, torch, ops
):
    warnings = list(source.warnings)
    config = read_config(hf_dir)
    tensors = source.tensors

    names = {t.name for t in tensors}
    if config.get("tie_word_embeddings") and set(TIED_EMBEDDINGS) <= names:
        lm, emb = (next(t for t in tensors if t.name == n) for n in TIED_EMBEDDINGS)
        if _same(lm, emb, torch):
            tensors = [t for t in tensors if t.name != TIED_EMBEDDINGS[0]]
        else:
            warnings.append("tie_word_embeddings is true but lm_head.weight differs from embed_tokens; kept both")

    base: list[_Tensor] = []
    lora: list[_Tensor] = []
    for t in tensors:
        (lora if "lora_" in t.name else base).append(t)
    if lora:
        for t in base:
            t.name = t.name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        warnings.append(
            f"LoRA adapter ({len(lora)} tensors) exported to lora_adapter/ beside the model; it is "
            "NOT fused into the base weights"
        )

    out_dtype = target or _dominant_float(base, torch)
    total = len(base) + len(lora)
    counter = [0]

    def tick(name: str) -> None:
        ops.tick()  # one tensor written
        counter[0] += 1
        if progress is not None:
            progress(counter[0], total, name)

    ranges = getattr(source, "ranges", [])
    _write_model(tmp, base, target, max_shard_size, tick, ranges, torch)
    lora_dir = None
    if lora:
        (tmp / "lora_adapter").mkdir()
        _write_file(tmp / "lora_adapter" / "adapter_model.safetensors", lora, target, tick, ranges, torch)
        if inp.lora_config is not None:  # verl writes it beside actor/
            shutil.copy2(inp.lora_config, tmp / "lora_adapter" / "adapter_config.json")
        lora_dir = str(out / "lora_adapter")

    copy_hf_files(inp, hf_dir, tmp, out_dtype)
    read_back = False
    if verify:
        _verify(tmp, base + lora, target, ranges, torch, ops)
        read_back = True

    from ckpt_audit.readers.hashing import digest_file

    files = []
    for p in sorted(tmp.rglob("*")):
        if p.is_file():
            d = digest_file(str(p))
            files.append(ExportedFile(path=str(out / p.relative_to(tmp)), size_bytes=d.size_bytes, hash=d.hash))
    return ExportResult(
        source=str(inp.src),
        role_dir=str(inp.role_dir),
        out_dir=str(out),
        source_kind=source.kind,
        world_size=source.world_size,
        dtype=str(out_dtype).removeprefix("torch."),
        tensors=total,
        total_bytes=sum(_nbytes(t, target, torch) for t in base + lora),
        files=tuple(files),
        lora_dir=lora_dir,
        warnings=tuple(warnings),
        read_back=read_back,
    )


def _write_model(tmp: Path, tensors: list[_Tensor], target, max_shard_size: int, tick, ranges, torch) -> None:
    for name, group in output_shards(tensors, lambda t: _nbytes(t, target, torch), max_shard_size, tmp):
        _write_file(tmp / name, group, target, tick, ranges, torch)


def _write_file(path: Path, tensors: list[_Tensor], target, tick, ranges, torch) -> None:
    """Write a safetensors file by hand, so tensors stream in one at a time (save_file wants them all)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        n = _nbytes(t, target, torch)
        dt = str(_out_dtype(t, target, torch)).removeprefix("torch.")
        header[t.name] = {"dtype": SAFETENSORS_DTYPE[dt], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format asks for an 8-byte aligned start of data
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for t in tensors:
            for chunk in _chunks(t, target, torch):
                fh.write(_bytes_view(chunk, torch))
            release_pieces(t.pieces, ranges)
            tick(t.name)


def _chunks(t: _Tensor, target, torch) -> Iterator:
    dtype = _out_dtype(t, target, torch)
    if t.dim is None:
        yield t.pieces[0].to(dtype).contiguous()
    elif t.dim == 0:  # the bytes of a dim-0 concatenation are the pieces' bytes in order: no full buffer
        for p in t.pieces:
            if p.numel():
                yield p.to(dtype).contiguous()
    else:
        buf = torch.empty(t.shape, dtype=dtype)
        start = 0
        for p in t.pieces:
            n = p.shape[t.dim]
            buf.narrow(t.dim, start, n).copy_(p)  # copy_ casts
            start += n
        yield buf


def _verify(tmp: Path, tensors: list[_Tensor], target, ranges, torch, ops: OpCounter) -> None:
    """Every tensor read back (safetensors' own reader) equals torch.cat of its shards, as cast, bit for bit."""
    from safetensors import safe_open

    files = sorted(tmp.glob("*.safetensors")) + sorted((tmp / "lora_adapter").glob("*.safetensors"))
    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {key: h for h in handles for key in h.keys()}
    out_paths = {str(f) for f in files}
    expected = {t.name for t in tensors}
    if set(where) != expected:
        raise ExportError(f"export check failed: keys differ ({sorted(set(where) ^ expected)[:3]})")
    for t in tensors:  # one tensor at a time: reading back must not cost the model's size either
        got = where[t.name].get_tensor(t.name)
        dtype = _out_dtype(t, target, torch)
        want = (t.pieces[0] if t.dim is None else torch.cat(list(t.pieces), dim=t.dim)).to(dtype)
        if (
            got.dtype != want.dtype
            or tuple(got.shape) != tuple(want.shape)
            or not torch.equal(_bytes_of(got, torch), _bytes_of(want, torch))
        ):
            raise ExportError(f"export check failed: {t.name} differs from the concatenation of its shards")
        del got, want
        release_pieces(t.pieces, ranges)
        drop_ranges(mapped_ranges(out_paths))  # safetensors maps the files it reads back
        ops.tick()  # one tensor read back


def _same(a: _Tensor, b: _Tensor, torch) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.dim != b.dim or len(a.pieces) != len(b.pieces):
        return False
    return all(torch.equal(_bytes_of(x, torch), _bytes_of(y, torch)) for x, y in zip(a.pieces, b.pieces))


def _bytes_of(t, torch):
    return t.contiguous().reshape(-1).view(torch.uint8)


def _bytes_view(t, torch) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _out_dtype(t: _Tensor, target, torch):
    return target if target is not None and t.dtype.is_floating_point else t.dtype


def _nbytes(t: _Tensor, target, torch) -> int:
    n = 1
    for s in t.shape:
        n *= s
    return n * _out_dtype(t, target, torch).itemsize


def _dominant_float(tensors: list[_Tensor], torch):
    sizes: dict = {}
    for t in tensors:
        if t.dtype.is_floating_point:
            sizes[t.dtype] = sizes.get(t.dtype, 0) + _nbytes(t, None, torch)
    return max(sizes, key=sizes.__getitem__) if sizes else torch.float32
