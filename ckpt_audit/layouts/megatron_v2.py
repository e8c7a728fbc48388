"""verl's Megatron layout v2 (verl >= 0.9.1; docs/megatron.md), a component format inside verl's run structure.

    <run>/global_step_N/<role>/ckpt_contents.json             written last: the commit marker and the content list
    <run>/global_step_N/<role>/transformer_config.json
    <run>/global_step_N/<role>/model/{dist_ckpt,huggingface}/
    <run>/global_step_N/<role>/{optimizer,extra}/dist_ckpt/
    <run>/global_step_N/<role>/dist_ckpt/                     also there after verl's migration script (hardlinks)

Every content the manifest lists must be there and whole: a dist_ckpt directory as layouts.dcp checks one
(`.metadata`, its byte ranges, `metadata.json`, `common.pt`), a huggingface directory with its config (and weights
for the model), a json file. Without a manifest the save did not finish, unless verl's migration script made the
tree from an old one (a `dist_ckpt/` beside the v2 directories): then every non-empty `*/dist_ckpt/` is checked.
The pre-v2 layout itself stays with layouts.dcp, which flags it (rules.megatron_v2.old_layout).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from ckpt_audit import models
from ckpt_audit.codes import finding
from ckpt_audit.layouts import DeepChecks, TextRead
from ckpt_audit.layouts.dcp import (
    check_byte_ranges,
    check_dcp_dir,
    check_megatron_metadata,
    dcp_files,
)
from ckpt_audit.layouts.tracker import Tracker
from ckpt_audit.layouts.verl_fsdp import STEP_RE
from ckpt_audit.models import FileKind, Finding
from ckpt_audit.rules import megatron_v2 as rules
from ckpt_audit.rules.hf_trainer import INDEX_FILES, INDEX_TEXT_LIMIT, TEXT_LIMIT
from ckpt_audit.tree import FileFacts, Tree

if TYPE_CHECKING:
    from ckpt_audit.models import Component, Run
    from ckpt_audit.rules.status import ScanContext

NAME = "verl-megatron-v2"
DIST_FORMAT = "megatron_dist_checkpoint"
HF_FORMAT = "huggingface"
WEIGHTS = frozenset({"model", "hf_model"})  # contents whose huggingface path must hold weights, not only a config


def is_v2(role_dir: str, tree: Tree) -> bool:
    subs = tree.subdirs(role_dir)
    return rules.MANIFEST in tree.file_names(role_dir) or any(d in subs for d in rules.V2_DIRS)


def model_dirs(role_dir: str, tree: Tree) -> tuple[str | None, str]:
    """(the model's dist_ckpt, its huggingface directory) in a verl role directory, where verl's load and merger
    read them: model/dist_ckpt and model/huggingface (layout v2), else dist_ckpt/ and huggingface/ (pre-v2, and
    FSDP's huggingface/). The dist_ckpt is None where neither holds a `.metadata`. What export reads."""
    v2 = f"{role_dir}/model"
    dist = next((d for d in (f"{v2}/dist_ckpt", f"{role_dir}/dist_ckpt") if ".metadata" in tree.file_names(d)), None)
    moved = tree.has_dir(f"{v2}/huggingface") or tree.has_dir(f"{v2}/dist_ckpt")
    return dist, f"{v2}/huggingface" if moved else f"{role_dir}/huggingface"


def check_dist_ckpt(dist: str, tree: Tree, facts: Mapping[str, FileFacts]) -> tuple[int | None, list[Finding]]:
    """(writer count, findings) of one dist_checkpointing directory, as megatron-core's load needs it."""
    ws, found = check_dcp_dir(dist, tree)
    out = list(found)
    out.extend(check_byte_ranges(dist, tree, facts))
    meta = facts.get(f"{dist}/metadata.json")
    out.extend(check_megatron_metadata(f"{dist}/metadata.json", meta.text if meta else None, present=meta is not None))
    if "common.pt" not in tree.file_names(dist):
        out.append(
            finding("megatron-common-missing", f"{dist}/common.pt", "no common.pt: rank 0's non-sharded state is gone")
        )
    return ws, out


class MegatronV2:
    name = NAME
    # the commit marker, dist_ckpt's metadata.json, and the huggingface directory's weights index
    text_files = {
        "ckpt_contents.json": TextRead(),
        "metadata.json": TextRead(),
        **{n: TextRead(INDEX_TEXT_LIMIT, prefix=True) for n in INDEX_FILES},
    }
    deep_checks = DeepChecks(components={NAME: ("ckpt_audit.deep.megatron_check:check_v2",)})
    tracker: Tracker | None = None  # a component format: its runs are verl's, and so is their tracker

    def is_step_dir(self, name: str) -> bool:
        return False  # its steps are verl's global_step_N

    def find_runs(self, tree: Tree) -> Iterable[str]:
        return ()  # a component format: verl's run structure (layouts.verl_fsdp) finds the runs

    def file_kind(self, path: str) -> FileKind | None:
        return None

    def build_run(self, run_dir: str, tree: Tree, facts: Mapping[str, FileFacts], ctx: ScanContext) -> Run:
        raise NotImplementedError("no runs of its own (find_runs yields none)")

    def build_component(
        self, role: str, role_dir: str, tree: Tree, facts: Mapping[str, FileFacts], ctx: ScanContext
    ) -> Component | None:
        if not is_v2(role_dir, tree):
            return None
        files, found = dcp_files(role_dir, tree, facts, content_dirs=rules.V2_DIRS)
        manifest_path = f"{role_dir}/{rules.MANIFEST}"
        fact = facts.get(manifest_path)
        ws: int | None = None
        read = [f"{role_dir}/{rel}" for rel in rules.READ_BY_LOAD]  # where verl's load reads (and follows links)
        if fact is None:
            migrated = "dist_ckpt" in tree.subdirs(role_dir)
            found.append(rules.missing_manifest(role_dir, migrated=migrated))
            if migrated:  # verl's load reads all three: each must be a whole dist_ckpt (they mirror one another)
                checked = set()
                for at in [f"{role_dir}/{sub}/dist_ckpt" for sub in rules.V2_DIRS] + [f"{role_dir}/dist_ckpt"]:
                    dist = _resolve(at, tree)
                    if dist is None or dist in checked:
                        continue  # a dangling link (said by _links), or the directory a link before this led to
                    checked.add(dist)
                    if _nonempty(dist, tree):
                        w, more = check_dist_ckpt(dist, tree, facts)
                        ws = ws or w
                        found.extend(more)
                    elif at != f"{role_dir}/dist_ckpt":  # the old one is read through its mirrors only
                        why = "verl's load of a migrated role reads it: absent or empty"
                        found.append(finding("megatron-v2-content-missing", at, why))
        else:
            man = rules.parse_manifest(manifest_path, fact.text)
            if isinstance(man, Finding):
                found.append(man)
            else:
                read += [f"{role_dir}/{c.path}" for c in man.contents]
                found.extend(rules.check_identity(man, manifest_path, step=_step(role_dir), role=role))
                w, more = self._contents(role_dir, man, tree, facts)
                ws = man.world_size or w
                found.extend(more)
        found.extend(_links(role_dir, tree, read))
        return models.Component(
            role=role, path=role_dir, layout=NAME, world_size=ws, files=tuple(files), findings=tuple(found)
        )

    def _contents(
        self, role_dir: str, man: rules.Manifest, tree: Tree, facts: Mapping[str, FileFacts]
    ) -> tuple[int | None, list[Finding]]:
        out: list[Finding] = []
        ws = None
        # several contents share a path (optimizer and lr_scheduler; hf_config, tokenizer and the model): check each
        # path once, for weights when any content there is the model
        paths: dict[str, tuple[str, str, bool]] = {}  # path -> (first content's name, its format, weights wanted)
        for c in man.contents:
            name, fmt, weights = paths.get(c.path, (c.name, c.format, False))
            paths[c.path] = (name, fmt, weights or c.name in WEIGHTS)
        for rel, (name, fmt, weights) in paths.items():
            at = _resolve(f"{role_dir}/{rel}", tree)
            if at is None:
                continue  # a dangling link: said by _links
            if fmt in (DIST_FORMAT, HF_FORMAT):
                if not _nonempty(at, tree):
                    why = f"the manifest lists {name!r} at {rel}: absent or empty"
                    out.append(finding("megatron-v2-content-missing", at, why))
                elif fmt == DIST_FORMAT:
                    w, more = check_dist_ckpt(at, tree, facts)
                    ws = ws or w
                    out.extend(more)
                else:
                    names = frozenset(tree.file_names(at))
                    texts = {
                        n: (f.text, f.size_bytes <= (INDEX_TEXT_LIMIT if n in INDEX_FILES else TEXT_LIMIT))
                        for n in names
                        if (f := facts.get(f"{at}/{n}"))
                    }
                    out.extend(rules.check_hf(at, names, texts, weights=weights))
            else:
                parent, base = at.rsplit("/", 1)
                if base not in tree.file_names(parent):
                    out.append(
                        finding("megatron-v2-content-missing", at, f"the manifest lists {name!r} at {rel}: absent")
                    )
        return ws, out


def _walked(path: str, tree: Tree) -> bool:
    parent, _, name = path.rpartition("/")
    return tree.has_dir(path) or name in tree.file_names(parent)


def _resolve(path: str, tree: Tree) -> str | None:
    """`path`, or where it leads if it is a link (None: to nothing walked)."""
    text = tree.links.get(path)
    if text is None:
        return path
    target = rules.link_target(path, text)
    return target if _walked(target, tree) else None


def _links(role_dir: str, tree: Tree, read: list[str]) -> list[Finding]:
    """The links at or below where verl's load reads (`read`): it follows them, the walk does not."""
    run_dir = role_dir.rsplit("/", 2)[0]
    out = []
    followed = (p for p in tree.links if any(p == r or p.startswith(r + "/") for r in read))
    for link in sorted(followed):
        text = tree.links[link]
        f = rules.check_link(link, text, exists=_walked(rules.link_target(link, text), tree), run_dir=run_dir)
        if f is not None:
            out.append(f)
    return out


def _nonempty(d: str, tree: Tree) -> bool:
    return tree.has_dir(d) and bool(tree.file_names(d) or tree.subdirs(d))


def _step(role_dir: str) -> int | None:
    """N of the global_step_N the role directory is in."""
    parts = role_dir.rsplit("/", 2)
    m = STEP_RE.fullmatch(parts[-2]) if len(parts) >= 2 else None
    return int(m.group(1)) if m else None


LAYOUT = MegatronV2()
