"""verify's checks of a Megatron `dist_ckpt/` (docs/megatron.md): verl's old layout (`<role>/dist_ckpt/`) and v2's
(`<role>/{model,optimizer,extra}/dist_ckpt/`). Torch only for `common.pt` (safe_load).

- DCP's checks of the directory (dcp_check: byte ranges, tiling, every `.distcp` item against its CRC-32:
  megatron-core and DCP load a flipped bit silently as a changed weight); `common.pt` loaded the safe way.
- `integrity.json`, when present: the SHA-256 of each file it lists, as Megatron-LM's `load(verify_integrity=True)`
  computes it (megatron-core 0.16 writes none; newer Megatron-LM writes it with `save(verify_integrity=True)`).
- Where the model is: megatron-core saves model state under the module's own names (`decoder.*`, `embedding.*`,
  `output_layer.*`), optimizer state under `optimizer.*`; any key but those and `rng_state` is model state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Set

from ckpt_audit.codes import finding
from ckpt_audit.deep import dcp_check, safe_load
from ckpt_audit.deep.check import Deep
from ckpt_audit.layouts.dcp import DIST_CKPT, METADATA
from ckpt_audit.models import Checkpoint, Component, FileKind, Finding
from ckpt_audit.readers import bounded_json
from ckpt_audit.readers.dcp_metadata import DcpMetadata

INTEGRITY = "integrity.json"
HASH_CHUNK = 1 << 20
NOT_MODEL_ROOTS = frozenset({"optimizer", "rng_state", "lr_scheduler", "common_state"})


def check_old(ckpt: Checkpoint, comp: Component, bad: Set[str]) -> Deep:
    """verl's old Megatron role directory: its `dist_ckpt/`, and where the model is (mbridge saves it to
    huggingface/ instead)."""
    dist = f"{comp.path}/{DIST_CKPT}"
    out, meta = check_dist_ckpt(comp, dist, bad)
    if meta is None:
        return Deep(tuple(out))
    hf_weights = any(f.kind is FileKind.HF and f.path.endswith((".safetensors", ".bin")) for f in comp.files)
    if not has_model_state(meta) and not hf_weights:
        out.append(
            finding(
                "megatron-model-missing",
                dist,
                "dist_ckpt holds only optimizer/RNG state and huggingface/ no weights (mbridge saves the model there)",
            )
        )
    return Deep(tuple(out))


def check_v2(ckpt: Checkpoint, comp: Component, bad: Set[str]) -> Deep:
    """A v2 role directory: each of its dist_ckpt directories (the directory of a `.metadata`), as the old one's."""
    dirs = sorted({f.path.rsplit("/", 1)[0] for f in comp.files if f.kind is FileKind.DCP_METADATA})
    return Deep(tuple(f for d in dirs for f in check_dist_ckpt(comp, d, bad)[0]))


def check_dist_ckpt(comp: Component, dist: str, bad: Set[str]) -> tuple[list[Finding], DcpMetadata | None]:
    """(findings, its .metadata) of one megatron-core dist_checkpointing directory of `comp`."""
    out = list(dcp_check.check_dir(dist))
    for f in comp.files:
        if f.kind is FileKind.COMMON and f.path.rpartition("/")[0] == dist and f.path not in bad:
            out.extend(safe_load.load(f.path).findings)
    out.extend(check_integrity(dist))
    try:
        meta = dcp_check.read_metadata(f"{dist}/{METADATA}")
    except (OSError, ValueError, TypeError):
        return out, None
    out.extend(dcp_check.item_crcs(comp, dist, bad, meta))
    return out, meta


def has_model_state(meta: DcpMetadata) -> bool:
    """True when `.metadata` holds model state: megatron-core's own names (`decoder.*`, ...), or an imitation's
    `model.*`; extra-state objects (`*._extra_state`) alone are not weights."""
    return any(
        k.split(".", 1)[0] not in NOT_MODEL_ROOTS and not k.endswith("_extra_state")
        for k in (*meta.tensors, *meta.byte_items)
    )


def read_integrity(text: str) -> Mapping[str, str]:
    """{file name: sha256 hex} from integrity.json; raises ValueError (one line) for anything else."""
    try:
        doc = bounded_json.loads(text, max_bytes=bounded_json.MAX_FILE)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
        raise ValueError("no 'files' object")
    algorithm = doc.get("algorithm", "sha256")
    if algorithm != "sha256":
        raise ValueError(f"hash algorithm {algorithm!r}, Megatron writes 'sha256'")
    files = doc["files"]
    if not all(
        isinstance(k, str) and "/" not in k and k not in ("", ".", "..") and isinstance(v, str)
        for k, v in files.items()
    ):
        raise ValueError("'files' must map plain file names to hex digests")
    return files


def check_integrity(dist_dir: str) -> tuple[Finding, ...]:
    """integrity.json against the files it lists (nothing when there is none: Megatron writes it only on request)."""
    path = f"{dist_dir}/{INTEGRITY}"
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            files = read_integrity(f.read(16 << 20))
    except FileNotFoundError:
        return ()
    except OSError as exc:
        return (finding("megatron-integrity-invalid", path, f"cannot read integrity.json: {exc.strerror or exc}"),)
    except ValueError as exc:
        return (finding("megatron-integrity-invalid", path, f"integrity.json: {exc}"),)
    out = []
    for name, want in sorted(files.items()):
        target = f"{dist_dir}/{name}"
        try:
            got = _sha256(target)
        except FileNotFoundError:
            out.append(
                finding("megatron-integrity-file-missing", target, f"integrity.json lists {name}, which is gone")
            )
            continue
        except OSError as exc:
            out.append(finding("megatron-integrity-file-missing", target, f"unreadable: {exc.strerror or exc}"))
            continue
        if got != want.lower():
            out.append(
                finding(
                    "megatron-integrity-mismatch",
                    target,
                    f"SHA-256 {got[:16]}... but integrity.json records {want[:16]}...: changed since the save",
                )
            )
    return tuple(out)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()
