"""verify's checks of a Megatron `dist_ckpt/` (docs/megatron.md) beyond DCP's byte ranges. No torch.

- Every item of every `.distcp` against its CRC-32 (readers.distcp_items): megatron-core and DCP load a flipped bit
  silently as a changed weight.
- `integrity.json`, when present: the SHA-256 of each file it lists, as Megatron-LM's `load(verify_integrity=True)`
  computes it (megatron-core 0.16 writes none; newer Megatron-LM writes it with `save(verify_integrity=True)`).
- Where the model is: megatron-core saves model state under the module's own names (`decoder.*`, `embedding.*`,
  `output_layer.*`), optimizer state under `optimizer.*`; any key but those and `rng_state` is model state.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping

from ckpt_audit.codes import finding
from ckpt_audit.layouts.dcp import DISTCP_RE
from ckpt_audit.models import Finding
from ckpt_audit.readers import bounded_json, distcp_items
from ckpt_audit.readers.dcp_metadata import DcpMetadata

INTEGRITY = "integrity.json"
HASH_CHUNK = 1 << 20
NOT_MODEL_ROOTS = frozenset({"optimizer", "rng_state", "lr_scheduler", "common_state"})


def has_model_state(meta: DcpMetadata) -> bool:
    """True when `.metadata` holds model state: megatron-core's own names (`decoder.*`, ...), or an imitation's
    `model.*`; extra-state objects (`*._extra_state`) alone are not weights."""
    return any(
        k.split(".", 1)[0] not in NOT_MODEL_ROOTS and not k.endswith("_extra_state")
        for k in (*meta.tensors, *meta.byte_items)
    )


def check_item_crcs(dcp_dir: str, meta: DcpMetadata, skip: Iterable[str] = ()) -> tuple[Finding, ...]:
    """distcp-crc-mismatch / distcp-item-invalid for each item of each referenced file (files in `skip`, which the
    scan already found broken, and missing files are left to their own findings)."""
    per_file: dict[str, list[tuple[str, int, int]]] = {}
    for (fqn, _off), (rel, start, length) in meta.storage.items():
        per_file.setdefault(rel, []).append((fqn, start, length))
    skip = set(skip)
    out = []
    for rel in sorted(per_file):
        path = f"{dcp_dir}/{rel}"
        if path in skip or not os.path.isfile(path):
            continue
        try:
            report = distcp_items.check_items(path, per_file[rel])
        except OSError:
            continue  # unreadable: the scan reported it
        m = DISTCP_RE.fullmatch(os.path.basename(rel))
        for p in report.problems:
            out.append(
                finding(
                    p.problem.code,
                    path,
                    f"{p.key}: {p.problem.message}",
                    rank=int(m.group(1)) if m else None,
                    tensor=p.key,
                )
            )
    return tuple(out)


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
