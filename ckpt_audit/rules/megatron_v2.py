"""verl's Megatron layout v2 (verl >= 0.9.1, docs/megatron.md): what `ckpt_contents.json` promises, and the old layout.

verl's `MegatronCheckpointManager` writes `ckpt_contents.json` last (rank 0: tmp file, fsync, rename), after every
dist_checkpointing write; its presence is verl's word that the save finished. Its `contents` name each saved piece
and where it is (`model/dist_ckpt`, `optimizer/dist_ckpt`, `extra/dist_ckpt`, `model/huggingface`,
`transformer_config.json`). Everything else under the role directory, empty `*/dist_ckpt/` included (verl's path
helpers mkdir on every call), is not required. Pure: no IO.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass

from ckpt_audit.codes import finding
from ckpt_audit.models import Finding
from ckpt_audit.readers import bounded_json
from ckpt_audit.rules.hf_trainer import INDEX_FILES, WEIGHT_FILES, WEIGHT_SHARD_RE, index_shards

MANIFEST = "ckpt_contents.json"
V2_DIRS = ("model", "optimizer", "extra")  # verl's _raise_for_old_layout: any of them makes a directory v2
# what verl 0.9.1's load_checkpoint reads without a manifest (it never reads one): the three dist_ckpt of its load
# contents, and the HF weights when the bridge loads the model
READ_BY_LOAD = ("model/dist_ckpt", "optimizer/dist_ckpt", "extra/dist_ckpt", "model/huggingface")
MIGRATION = "python scripts/migrate_megatron_checkpoint_layout.py --checkpoint"


@dataclass(frozen=True, slots=True)
class Content:
    name: str  # "model", "optimizer", "rng_state", "hf_config", ...
    path: str  # relative to the role directory
    format: str  # "megatron_dist_checkpoint", "huggingface", "json"


@dataclass(frozen=True, slots=True)
class Manifest:
    global_step: int | None
    role: str | None
    world_size: int | None
    contents: tuple[Content, ...]


def parse_manifest(path: str, text: str | None) -> Manifest | Finding:
    """The manifest, or a finding saying why it cannot be trusted (unreadable, not schema 2, a path leaving the
    role directory)."""

    def bad(why: str) -> Finding:
        return finding("megatron-v2-manifest-invalid", path, f"{MANIFEST}: {why}")

    if text is None:
        return bad("not read (too large or unreadable)")
    try:
        doc = bounded_json.loads(text, max_bytes=bounded_json.MAX_FILE)
    except ValueError as exc:
        return bad(f"not JSON within bounds ({exc})")
    if not isinstance(doc, dict):
        return bad("not a JSON object")
    if doc.get("schema_version") != 2 or doc.get("framework") != "megatron":
        return bad(
            f"schema_version {doc.get('schema_version')!r}, framework {doc.get('framework')!r}: expected 2, megatron"
        )
    raw = doc.get("contents")
    if not isinstance(raw, dict):
        return bad("no contents object")
    contents = []
    for name, entry in sorted(raw.items()):
        rel = entry.get("path") if isinstance(entry, dict) else None
        norm = posixpath.normpath(rel) if isinstance(rel, str) and rel else "."
        if norm == "." or norm.startswith(("/", "../")) or norm == "..":  # verl writes os.path.relpath: always inside
            return bad(f"contents[{name!r}].path {rel!r} is not a path inside the role directory")
        contents.append(Content(name=name, path=norm, format=str(entry.get("format", ""))))

    def as_int(v: object) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    role = doc.get("role")
    return Manifest(
        global_step=as_int(doc.get("global_step")),
        role=role if isinstance(role, str) else None,
        world_size=as_int(doc.get("world_size")),
        contents=tuple(contents),
    )


def check_identity(man: Manifest, path: str, *, step: int | None, role: str) -> tuple[Finding, ...]:
    """The manifest's global_step and role against the directories it sits in (a copied step keeps its old
    manifest: verl resumes that other step's state under this step's number)."""
    out = []
    if step is not None and man.global_step != step:
        out.append(
            finding(
                "megatron-v2-step-mismatch",
                path,
                f"{MANIFEST} says global_step {man.global_step}, the directory is global_step_{step}: a copy or a "
                f"rename; verl would resume step {man.global_step}'s state as step {step}",
            )
        )
    if role and man.role != role:
        out.append(
            finding("megatron-v2-role-mismatch", path, f"{MANIFEST} says role {man.role!r}, the directory {role!r}")
        )
    return tuple(out)


def check_hf(
    hf_dir: str, names: frozenset[str], texts: Mapping[str, tuple[str | None, bool]], *, weights: bool
) -> list[Finding]:
    """A `huggingface` content: config.json, and with `weights` a weights file or an index whose files are all here.
    `texts`: name -> (what the scan read of it, whether that is the whole file), as rules.hf_trainer takes them."""
    out = []
    if "config.json" not in names:
        out.append(
            finding(
                "megatron-v2-content-missing",
                f"{hf_dir}/config.json",
                "the manifest lists HF content here: no config.json",
            )
        )
    if not weights:
        return out
    indexes = names & INDEX_FILES
    if not (names & WEIGHT_FILES) and not indexes:
        shards = any(WEIGHT_SHARD_RE.fullmatch(n) for n in names)
        why = "shards without their index" if shards else "no model.safetensors, pytorch_model.bin or index"
        out.append(finding("megatron-v2-content-missing", hf_dir, f"the manifest lists HF weights here: {why}"))
    for index in sorted(indexes):
        text, whole = texts.get(index, (None, False))
        listed = index_shards(text, whole=whole)
        if isinstance(listed, str):
            out.append(finding("hf-index-invalid", f"{hf_dir}/{index}", listed))
        elif listed:
            for name in sorted(listed - names):
                out.append(finding("hf-shard-missing", f"{hf_dir}/{name}", f"{index} names {name}, which is absent"))
    return out


def missing_manifest(role_dir: str, *, migrated: bool) -> Finding:
    if migrated:
        return finding(
            "megatron-migrated",
            role_dir,
            "migrated by verl's migrate_megatron_checkpoint_layout.py: model/, optimizer/, extra/ dist_ckpt mirror "
            "dist_ckpt/ (hardlinked files are counted once) and no ckpt_contents.json was written",
        )
    return finding(
        "megatron-v2-manifest-missing",
        f"{role_dir}/{MANIFEST}",
        f"no {MANIFEST}: verl writes it last, after every dist_ckpt write, so this save never finished (verl's "
        "load does not look for it and may load what is here)",
    )


def link_target(link: str, text: str) -> str:
    """Where a link holding `text` leads, as a normalised absolute path (one hop: the walk saw only this one)."""
    return posixpath.normpath(text if text.startswith("/") else posixpath.join(posixpath.dirname(link), text))


def check_link(link: str, text: str, *, exists: bool, run_dir: str) -> Finding | None:
    """A link in a v2 role: verl's load follows it. `exists`: its target was walked under the scanned roots."""
    target = link_target(link, text)
    if not exists:
        return finding(
            "megatron-link-dangling",
            link,
            f"links to {text!r}, which is not under the scanned roots: verl's load reads through it and fails "
            "(moved or copied after verl's migration script linked it?); re-point it with a relative link, or "
            "migrate with --mode hardlink",
        )
    outside = not target.startswith(run_dir.rstrip("/") + "/")
    if text.startswith("/") or outside:
        where = "out of its run" if outside else "by an absolute path"
        return finding(
            "megatron-link-absolute",
            link,
            f"links {where} to {target} (verl's migration script, --mode symlink): it breaks when the run is moved, "
            "and a copy of the run keeps reading these files; a relative link or --mode hardlink does not",
        )
    return None


def huggingface_moved(role_dir: str) -> Finding:
    return finding(
        "fsdp-huggingface-moved",
        f"{role_dir}/model/huggingface",
        "this FSDP role's huggingface/ is at model/huggingface/, where verl's Megatron migration script "
        "(--checkpoint-root --all-steps) moves it: verl's FSDP resume does not read it, but its model merger "
        f"(--backend fsdp) and export look for huggingface/; move it back: mv {role_dir}/model/huggingface "
        f"{role_dir}/huggingface && rmdir {role_dir}/model",
    )


def old_layout(role_dir: str) -> Finding:
    return finding(
        "megatron-old-layout",
        role_dir,
        "pre-v2 layout (dist_ckpt/ directly under the role, no model/ optimizer/ extra/): verl >= 0.9.1 refuses "
        f"to load it (RuntimeError) until it is migrated: {MIGRATION} {role_dir}",
    )


# What a resume may change, by the distributed optimizer's checkpoint format (megatron-core 0.16's
# DistributedOptimizer.sharded_state_dict). verl resumes with the format the checkpoint records, whatever its config
# says now (MegatronCheckpointManager._load_content_metadata).
RESHARDING = {
    "dp_reshardable": "only the data-parallel size may change at resume (tensor/pipeline parallel sizes must match)",
    "fully_reshardable": "tensor, pipeline, expert and data-parallel sizes may all change at resume",
    "fully_sharded_model_space": "tensor, pipeline, expert and data-parallel sizes may all change at resume",
    "fsdp_dtensor": "Megatron-FSDP's DTensor format: reshardable, with Megatron-FSDP only",
    "dp_zero_gather_scatter": "deprecated format saved per tensor x pipeline parallel group: those sizes must match",
}
NO_DISTRIBUTED_OPTIMIZER = "no distributed optimizer: optimizer state is sharded as the model, reshardable as it is"


def optimizer_format(meta: Mapping[str, object]) -> dict[str, object]:
    """verl's optimizer format flags as a dist_ckpt's common.pt records them (readers.megatron_meta), and what they
    allow at resume. `dist_ckpt_optim_fully_reshardable` is verl's config flag the sharding type was made from
    (None where the type is no choice of that flag)."""
    raw = meta.get("distrib_optim_sharding_type")
    kind = raw if isinstance(raw, str) else None
    flag = {"fully_reshardable": True, "dp_reshardable": False}.get(kind or "")
    return {
        "distrib_optim_sharding_type": kind,
        "dist_ckpt_optim_fully_reshardable": flag,
        "resharding": RESHARDING.get(kind, f"unknown format {kind!r}") if kind else NO_DISTRIBUTED_OPTIMIZER,
    }
