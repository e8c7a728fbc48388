"""torch.distributed.checkpoint trees: verl's Megatron `dist_ckpt/` (docs/verl-format.md §2.1) and plain DCP.

    <run>/global_step_N/actor/dist_ckpt/{.metadata, __R_k.distcp, common.pt, metadata.json}
    <run>/global_step_N/actor/{huggingface/, transformer_config.json, adapter_checkpoint/}
    <dir>/<name-N>/{.metadata, __R_k.distcp}          plain DCP (anything with .metadata but torchtitan step-N)

Megatron components plug into verl's run structure through `build_component`; plain DCP checkpoint directories
outside any verl step become runs of their own (the parent directory is the run, the trailing number of the
directory name the step). Shallow and torch-free: which files exist, what metadata.json says, and whether every data
file `.metadata` points into is there and long enough (the reader's DcpFacts). Chunk tiling and the rest of
`.metadata` is verify's job (`ckpt_audit.deep.dcp_check`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import replace

from ckpt_audit import models
from ckpt_audit.codes import finding
from ckpt_audit.layouts import DeepChecks, TextRead, shard_file
from ckpt_audit.layouts.verl_fsdp import STEP_RE, STEP_TRACKER
from ckpt_audit.models import MAX_STEP, Component, FileKind, Finding, Run, ShardFile, Status
from ckpt_audit.readers import bounded_json
from ckpt_audit.rules import megatron_v2, status
from ckpt_audit.rules.status import ScanContext
from ckpt_audit.tree import FileFacts, Tree

MEGATRON = "verl-megatron"
DCP = "dcp"
DIST_CKPT = "dist_ckpt"
METADATA = ".metadata"
DISTCP_RE = re.compile(r"__(\d{1,9})_(\d{1,9})\.distcp")  # a longer number is no rank (nor an SQLite INTEGER)
TRAILING_INT_RE = re.compile(r"(\d+)$")
KNOWN_SHARDED_BACKENDS = frozenset({"torch_dist", "zarr"})
KNOWN_COMMON_BACKENDS = frozenset({"torch"})


def classify(rel_parts: tuple[str, ...]) -> FileKind:
    """The kind of a file inside a DCP / Megatron component, from its path below the component directory."""
    name = rel_parts[-1]
    if rel_parts[0] in ("huggingface", "adapter_checkpoint", "lora_adapter"):
        return FileKind.HF if rel_parts[0] == "huggingface" else FileKind.LORA
    if name == METADATA:
        return FileKind.DCP_METADATA
    if DISTCP_RE.fullmatch(name):
        return FileKind.DISTCP
    if name == "common.pt":
        return FileKind.COMMON
    if name == "metadata.json" and len(rel_parts) >= 2 and rel_parts[-2] == DIST_CKPT:
        return FileKind.MEGATRON_METADATA
    return FileKind.OTHER


def dcp_files(
    comp_dir: str, tree: Tree, facts: Mapping[str, FileFacts], *, content_dirs: tuple[str, ...] = ()
) -> tuple[list[ShardFile], list[Finding]]:
    """The component's files, each named as classify knows it; a first folder in `content_dirs` is not part of the
    name (Megatron v2's model/dist_ckpt/x reads as dist_ckpt/x, model/huggingface/x as huggingface/x)."""
    files: list[ShardFile] = []
    found: list[Finding] = []
    cut = len(comp_dir) + 1
    for path in tree.files_below(comp_dir):
        fact = facts.get(path)
        if fact is None:
            continue
        parts = tuple(path[cut:].split("/"))
        kind = classify(parts[1:] if parts[0] in content_dirs and len(parts) > 1 else parts)
        m = DISTCP_RE.fullmatch(parts[-1]) if kind is FileKind.DISTCP else None
        files.append(shard_file(fact, kind, int(m.group(1)) if m else None))
        found.extend(fact.findings)  # the zip rules never ran on a .distcp (file_kind): nothing to filter
    return files, found


def check_dcp_dir(dcp_dir: str, tree: Tree) -> tuple[int | None, tuple[Finding, ...]]:
    """(writer count, findings) for one directory DCP wrote: `.metadata` and data files present."""
    names = tree.file_names(dcp_dir)
    ranks = {int(m.group(1)) for n in names if (m := DISTCP_RE.fullmatch(n))}
    out = []
    if METADATA not in names:
        out.append(
            finding(
                "dcp-metadata-missing",
                f"{dcp_dir}/{METADATA}",
                "no .metadata: DCP cannot load this checkpoint (the coordinator died before finishing the save)",
            )
        )
    if not ranks:
        out.append(finding("dcp-no-data", dcp_dir, "no __R_k.distcp data files"))
    return (max(ranks) + 1 if ranks else None), tuple(out)


# state-dict keys that are no model's: torchtitan's CheckpointManager saves these beside the model's own keys, which
# it flattens into the top level (tok_embeddings.weight, layers.0...; _flattened_model_states_sd)
NON_MODEL_ROOTS = frozenset({"optimizer", "lr_scheduler", "dataloader", "train_state"})


def check_model_keys(dcp_dir: str, facts: Mapping[str, FileFacts]) -> tuple[Finding, ...]:
    """A save whose `.metadata` names no model key: loading the model from it fails (DCP's default load planner
    raises "Missing key in checkpoint state_dict" for each model key the caller asks for; torchtitan asks for all)."""
    meta = facts.get(f"{dcp_dir}/{METADATA}")
    if meta is None or meta.dcp is None or set(meta.dcp.key_roots) - NON_MODEL_ROOTS:
        return ()
    saved = ", ".join(meta.dcp.key_roots) or "nothing"
    return (
        finding(
            "dcp-no-model",
            f"{dcp_dir}/{METADATA}",
            f".metadata names no model key (only {saved}): loading the model from it fails (Missing key)",
        ),
    )


def check_byte_ranges(dcp_dir: str, tree: Tree, facts: Mapping[str, FileFacts]) -> tuple[Finding, ...]:
    """Every data file `.metadata` points into exists and is as long as its byte ranges need (the scan's part of
    verify's dcp_check: what the file names and sizes show, from the reader's DcpFacts; no .metadata, no check)."""
    meta = facts.get(f"{dcp_dir}/{METADATA}")
    if meta is None or meta.dcp is None:
        return ()
    out = []
    for rel, end in meta.dcp.file_ends:
        parent, name = f"{dcp_dir}/{rel}".rsplit("/", 1)
        m = DISTCP_RE.fullmatch(name)
        rank = int(m.group(1)) if m else None
        fact = facts.get(f"{dcp_dir}/{rel}")
        if name not in tree.file_names(parent):
            out.append(
                finding(
                    "dcp-file-missing",
                    f"{dcp_dir}/{rel}",
                    f".metadata stores data in {rel}, which does not exist: DCP's load fails",
                    rank=rank,
                )
            )
        elif fact is not None and fact.size_bytes < end:
            out.append(
                finding(
                    "dcp-range-outside-file",
                    f"{dcp_dir}/{rel}",
                    f".metadata needs {end} bytes of {rel}, which holds {fact.size_bytes} (truncated)",
                    rank=rank,
                )
            )
    return tuple(out)


def check_megatron_metadata(path: str, text: str | None, present: bool) -> tuple[Finding, ...]:
    if not present:
        return (
            finding(
                "megatron-metadata-missing",
                path,
                "no dist_ckpt/metadata.json (Megatron writes it last): the "
                "save did not finish, or this node is not rank 0's (multi-node without a shared FS)",
            ),
        )
    try:
        doc = bounded_json.loads(text or "", max_bytes=bounded_json.MAX_FILE)
    except ValueError as exc:
        return (finding("megatron-backend-unknown", path, f"metadata.json is not JSON ({exc})"),)
    if not isinstance(doc, dict):
        return (finding("megatron-backend-unknown", path, "metadata.json is not a JSON object"),)
    sharded, common = doc.get("sharded_backend"), doc.get("common_backend", "torch")
    if sharded not in KNOWN_SHARDED_BACKENDS or common not in KNOWN_COMMON_BACKENDS:
        return (
            finding(
                "megatron-backend-unknown",
                path,
                f"sharded_backend {sharded!r}, common_backend {common!r}: "
                f"expected one of {sorted(KNOWN_SHARDED_BACKENDS)} / {sorted(KNOWN_COMMON_BACKENDS)}",
            ),
        )
    return ()


class DcpLayout:
    name = DCP
    text_files = {"metadata.json": TextRead()}  # Megatron's dist_ckpt/metadata.json (the backend it was saved with)
    deep_checks = DeepChecks(
        components={
            MEGATRON: ("ckpt_audit.deep.megatron_check:check_old",),
            DCP: ("ckpt_audit.deep.dcp_check:check",),
        }
    )

    # a plain DCP run's: torch.distributed.checkpoint writes no tracker, the training script names what it loads.
    # Verl's file is read where a run has one (any directory of the step), never written there.
    tracker = replace(
        STEP_TRACKER,
        refusal="a plain DCP run has no tracker (torch.distributed.checkpoint writes none; the training script names "
        "the directory it loads): pass `ckpt-audit latest` to it instead",
    )

    def is_step_dir(self, name: str) -> bool:
        return False  # its steps are verl's global_step_N (or a directory named for the step)

    # -- components inside verl runs ----------------------------------------------------------------------------

    def build_component(
        self, role: str, role_dir: str, tree: Tree, facts: Mapping[str, FileFacts], ctx: ScanContext
    ) -> Component | None:
        if DIST_CKPT in tree.subdirs(role_dir):
            return self._megatron(role, role_dir, tree, facts)
        if METADATA in tree.file_names(role_dir):
            return self._plain(role, role_dir, tree, facts)
        return None

    def _megatron(self, role: str, role_dir: str, tree: Tree, facts: Mapping[str, FileFacts]) -> Component:
        files, found = dcp_files(role_dir, tree, facts)
        dist = f"{role_dir}/{DIST_CKPT}"
        ws, more = check_dcp_dir(dist, tree)
        found.extend(more)
        found.extend(check_byte_ranges(dist, tree, facts))  # megatron-core's load fails on either (docs/megatron.md)
        meta = f"{dist}/metadata.json"
        fact = facts.get(meta)
        found.extend(check_megatron_metadata(meta, fact.text if fact else None, present=fact is not None))
        if "common.pt" not in tree.file_names(dist):
            found.append(
                finding(
                    "megatron-common-missing",
                    f"{dist}/common.pt",
                    "no common.pt: rank 0's non-sharded state (lr_scheduler, optimizer common) is gone",
                )
            )
        if tree.file_names(dist) or tree.subdirs(dist):  # verl's _raise_for_old_layout: a non-empty dist_ckpt/
            found.append(megatron_v2.old_layout(role_dir))  # (layouts.megatron_v2 claims v2 directories first)
        return models.Component(
            role=role, path=role_dir, layout=MEGATRON, world_size=ws, files=tuple(files), findings=tuple(found)
        )

    def _plain(self, role: str, ckpt_dir: str, tree: Tree, facts: Mapping[str, FileFacts]) -> Component:
        files, found = dcp_files(ckpt_dir, tree, facts)
        ws, more = check_dcp_dir(ckpt_dir, tree)
        more += check_byte_ranges(ckpt_dir, tree, facts)
        more += check_model_keys(ckpt_dir, facts)
        return models.Component(
            role=role, path=ckpt_dir, layout=DCP, world_size=ws, files=tuple(files), findings=tuple(found) + more
        )

    def file_kind(self, path: str) -> FileKind | None:
        """DCP's own names: .metadata, and a .distcp (torch.save blobs back to back: it starts like a zip, is none)."""
        name = path.rsplit("/", 1)[-1]
        if DISTCP_RE.fullmatch(name):
            return FileKind.DISTCP
        return FileKind.DCP_METADATA if name == METADATA else None

    # -- plain DCP runs -----------------------------------------------------------------------------------------

    def find_runs(self, tree: Tree) -> Iterable[str]:
        runs: set[str] = set()
        if METADATA not in tree.distinct_file_names():
            return []
        for d in tree.dirs:
            if METADATA not in tree.file_names(d) or d.rsplit("/", 1)[-1] == DIST_CKPT or _under_verl_step(d):
                continue
            parent = d.rsplit("/", 1)[0]
            runs.add(parent if parent in tree.dirs else d)
        return sorted(runs)

    def build_run(self, run_dir: str, tree: Tree, facts: Mapping[str, FileFacts], ctx: ScanContext) -> Run:
        dirs = [run_dir] if METADATA in tree.file_names(run_dir) else []
        dirs += [f"{run_dir}/{s}" for s in tree.subdirs(run_dir) if METADATA in tree.file_names(f"{run_dir}/{s}")]
        checkpoints, found = [], []
        for d in dirs:
            m = TRAILING_INT_RE.search(d.rsplit("/", 1)[-1])
            if m and int(m.group(1)) > MAX_STEP:
                found.append(finding("step-out-of-range", d, f"step {m.group(1)} is past 2^63-1; not a checkpoint"))
                continue
            comp = self._plain("", d, tree, facts)
            # directories included (see verl_fsdp); a run dir that is itself a checkpoint stops at its siblings
            below = frozenset(x for x in dirs if x != d)
            mtime = max([tree.newest_dir_mtime_ns(d, stop=below), *(f.mtime_ns for f in comp.files)])
            ckpt = models.Checkpoint(
                run_path=run_dir,
                step=int(m.group(1)) if m else 0,
                path=d,
                status=Status.INCOMPLETE,
                components=(comp,),
                mtime_ns=mtime,
            )
            # DCP's coordinator writes .metadata last: its presence commits the checkpoint, as verl's tracker does
            committed = ckpt.step if METADATA in tree.file_names(d) else None
            checkpoints.append(status.judge(ckpt, tracker_step=committed, ctx=ctx))
        checkpoints.sort(key=lambda c: (c.step, c.path))
        return models.Run(path=run_dir, layout=DCP, checkpoints=tuple(checkpoints), findings=tuple(found))


def _under_verl_step(d: str) -> bool:
    return any(STEP_RE.fullmatch(p) for p in d.split("/"))


LAYOUT = DcpLayout()
