"""`export --check HF_DIR`: is this HF directory the checkpoint's model, tensor for tensor? No torch.

What verl's `model_merger test` should have been: the source's tensors are planned exactly as export plans them
(export.plan_source: FSDP shards, a Megatron dist_ckpt, HF weights), then the HF directory's safetensors are compared
with that plan: both key sets complete (nothing missing, nothing extra), the tied-embedding rule and the expert
count against the model config, each tensor's shape and dtype, and every tensor's bytes (xxh3-64 of the source's
bytes as export would write them, against the file's) bit for bit, or exactly the documented cast (stream_copy's
round-to-nearest-even through float32) where the HF dtype is another float. Memory is export's block budget.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import xxhash

from ckpt_audit.export.stream_copy import BLOCK, Maps, tensor_bytes
from ckpt_audit.export.stream_plan import EXACT_CASTS, SAFETENSORS_DTYPE, Plan, Planned
from ckpt_audit.readers import safetensors_header
from ckpt_audit.rules.hf_trainer import TIED_EMBEDDINGS

_FROM_SAFETENSORS = {v: k for k, v in SAFETENSORS_DTYPE.items()}
_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckReport:
    source: str  # the role directory the plan came from
    hf_dir: str
    source_kind: str
    tensors: int  # tensors compared byte for byte
    differences: tuple[str, ...]  # one line each, in the order found: keys, rules, then tensor by tensor

    @property
    def same(self) -> bool:
        return not self.differences

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "hf_dir": self.hf_dir,
            "source_kind": self.source_kind,
            "tensors": self.tensors,
            "same": self.same,
            "differences": list(self.differences),
        }


class CheckError(Exception):
    """The HF directory cannot be read as safetensors; one line."""


def compare(plan: Plan, hf_dir: Path, config: dict, *, source: str) -> CheckReport:
    """The HF safetensors under `hf_dir` against `plan` and the model `config`."""
    where = _hf_tensors(hf_dir)
    expected = {t.name: t for t in plan.tensors}
    tied = bool(config.get("tie_word_embeddings"))
    lm = TIED_EMBEDDINGS[0]
    diffs: list[str] = []
    if tied:
        expected.pop(lm, None)  # export drops the copy of a tied head; the config decides, never a flag
        if lm in where:
            diffs.append(f"{lm}: present although config.json ties the word embeddings (tie_word_embeddings: true)")
            where.pop(lm)
    elif lm not in where and (lm in expected or TIED_EMBEDDINGS[1] in expected):  # a language model's head
        diffs.append(f"{lm}: missing although config.json does not tie the word embeddings")
    missing = sorted(set(expected) - set(where))
    extra = sorted(set(where) - set(expected))
    diffs += [f"{n}: missing (in the checkpoint, not in {hf_dir})" for n in missing if n != lm]
    diffs += [f"{n}: extra (in {hf_dir}, not in the checkpoint)" for n in extra]
    diffs += _expert_counts(where, config)
    checked = 0
    with Maps() as maps:
        for name in sorted(set(expected) & set(where), key=_natural):
            t, (path, info) = expected[name], where[name]
            dtype = _FROM_SAFETENSORS.get(info["dtype"], info["dtype"])
            shape = tuple(info["shape"])
            if shape != t.shape:
                diffs.append(f"{name}: shape {list(shape)}, the checkpoint's is {list(t.shape)}")
                continue
            if dtype != t.dtype and (t.dtype, dtype) not in EXACT_CASTS:
                diffs.append(f"{name}: dtype {dtype}, the checkpoint's is {t.dtype} (no exact cast between them)")
                continue
            checked += 1
            if _digest_plan(t, dtype, maps) != _digest_file(path, info):
                cast = f" (compared after the {t.dtype} -> {dtype} cast)" if dtype != t.dtype else ""
                diffs.append(f"{name}: values differ from the checkpoint's{cast}")
    return CheckReport(
        source=source, hf_dir=str(hf_dir), source_kind=plan.kind, tensors=checked, differences=tuple(diffs)
    )


def _hf_tensors(hf_dir: Path) -> dict[str, tuple[str, dict]]:
    """name -> (file, header entry with absolute data offsets) over the directory's *.safetensors."""
    files = sorted(hf_dir.glob("*.safetensors")) if hf_dir.is_dir() else []
    if not files:
        raise CheckError(f"{hf_dir}: no *.safetensors to check")
    out: dict[str, tuple[str, dict]] = {}
    for p in files:
        try:
            header = safetensors_header.read(str(p))
        except OSError as exc:
            raise CheckError(f"{p}: cannot read ({exc.strerror or exc})") from None
        if header.problems:
            raise CheckError(f"{p}: not a readable safetensors file ({header.problems[0]})")
        for name, v in header.tensors.items():
            if name in out:
                raise CheckError(f"{name}: in both {out[name][0]} and {p}")
            a, b = v["data_offsets"]
            out[name] = (str(p), {**v, "start": 8 + header.length + a, "length": b - a})
    return out


def _expert_counts(where: dict, config: dict) -> list[str]:
    want = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if not want:
        return []
    per_layer: dict[int, set[int]] = {}
    for name in where:
        if m := _EXPERT_RE.match(name):
            per_layer.setdefault(int(m[1]), set()).add(int(m[2]))
    return [
        f"model.layers.{layer}: {len(got)} experts, config.json says {want}"
        for layer, got in sorted(per_layer.items())
        if got != set(range(want))
    ]


def _digest_plan(t: Planned, dtype: str, maps: Maps) -> int:
    h = xxhash.xxh3_64()
    for mv in tensor_bytes(t, dtype, maps):
        h.update(mv)
    return h.intdigest()


def _digest_file(path: str, info: dict) -> int:
    h = xxhash.xxh3_64()
    fd = os.open(path, os.O_RDONLY)
    try:
        pos, left = info["start"], info["length"]
        while left:
            chunk = os.pread(fd, min(left, BLOCK), pos)
            if not chunk:
                break  # a short file: the digest differs
            h.update(chunk)
            pos += len(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    return h.intdigest()


def _natural(name: str) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))
