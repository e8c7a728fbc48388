"""Layouts own their deep checks (`Layout.deep_checks`) and trackers (`Layout.tracker`): every name a layout gives
resolves to a function of `ckpt_audit.deep`, every kind of component a layout builds has its checks named, every run
layout has a tracker, and verify, fix-tracker, `latest`'s tag answer and the cluster's tracker comparison know no
format of their own."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

from ckpt_audit import layouts
from ckpt_audit.deep import check

PACKAGE = Path(__file__).resolve().parent.parent / "ckpt_audit"
VERIFY = PACKAGE / "verify.py"
# the tracker's users: they ask the run's layout (layouts.run_tracker), never compare Run.layout with a name
TRACKER_USERS = ("lifecycle/tracker_fix.py", "session/reads.py", "cluster/findings.py")


def named_checks() -> list[str]:
    return [
        name
        for layout in layouts.load_layouts()
        for names in (*layout.deep_checks.components.values(), layout.deep_checks.step)
        for name in names
    ]


def layout_names() -> set[str]:
    return {name for layout in layouts.load_layouts() for name in (layout.name, *layout.deep_checks.components)}


def imported_modules(tree: ast.AST) -> set[str]:
    return {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }


def test_every_named_check_is_a_function_of_deep_with_the_check_signature():
    names = named_checks()
    assert names and all(n.startswith("ckpt_audit.deep.") for n in names)
    for name in names:
        module, _, function = name.partition(":")
        fn = getattr(importlib.import_module(module), function)
        params = list(inspect.signature(fn).parameters)
        step = any(name in layout.deep_checks.step for layout in layouts.load_layouts())
        assert params == (["ckpt", "bad"] if step else ["ckpt", "comp", "bad"]), name


def test_every_layout_names_the_checks_of_its_own_components():
    """Each layout's own name is the Component.layout it builds (dcp also builds verl's old Megatron role)."""
    for layout in layouts.load_layouts():
        assert layout.name in layout.deep_checks.components, layout.name
        assert check.component_checks(layout.name), layout.name
    assert [n for n, _ in check.component_checks("verl-megatron")] == ["ckpt_audit.deep.megatron_check:check_old"]
    assert [n for n, _ in check.component_checks("hf-trainer")] == [
        "ckpt_audit.deep.hf_check:check",
        "ckpt_audit.deep.deepspeed_check:check",
    ]
    assert check.component_checks("not-a-layout") == ()
    assert len(check.step_checks("verl-fsdp")) == 1 and check.step_checks("dcp") == ()


def test_verify_dispatches_on_no_layout_and_names_no_file():
    """The composer asks the layouts; the formats' names and files stay in layouts/ and deep/."""
    tree = ast.parse(VERIFY.read_text())
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert not strings & layout_names()
    assert not [s for s in strings if any(x in s for x in (".json", ".pt", ".metadata", "dist_ckpt", "huggingface"))]
    assert not [m for m in imported_modules(tree) if m.startswith("ckpt_audit.layouts")]
    assert "FileKind" not in VERIFY.read_text()


def test_tracker_users_dispatch_on_no_layout():
    """fix-tracker, `latest`'s tag answer and the cluster's tracker findings ask the run's layout for its tracker:
    no layout's name, no layout module, no DeepSpeed rules (its `latest`) in them."""
    modules = {f"ckpt_audit.layouts.{m.rsplit('.', 1)[-1]}" for m in layouts.LAYOUTS} | {"ckpt_audit.rules.deepspeed"}
    for rel in TRACKER_USERS:
        tree = ast.parse((PACKAGE / rel).read_text())
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not strings & layout_names(), rel
        assert not imported_modules(tree) & modules, rel
        compared = [x for n in ast.walk(tree) if isinstance(n, ast.Compare) for x in (n.left, *n.comparators)]
        assert not [x for x in compared if isinstance(x, ast.Attribute) and x.attr == "layout"], rel


def test_every_run_layout_has_a_tracker():
    """A layout that finds runs says what their resume reads; the lookup by Run.layout finds it."""
    for layout in layouts.load_layouts():
        if layout.tracker is None:
            continue
        assert layouts.run_tracker(layout.name) is layout.tracker
        assert layout.tracker.file and "/" not in layout.tracker.file
    assert layouts.run_tracker("deepspeed").takes_tag and not layouts.run_tracker("verl-fsdp").takes_tag
    assert layouts.layout_named("verl-megatron-v2").tracker is None  # a component format: its runs are verl's
    # no tracker to write: fix-tracker refuses with the layout's reason
    assert "has no tracker" in layouts.run_tracker("hf-trainer").refusal
    assert "has no tracker" in layouts.run_tracker("torchtitan").refusal
    assert layouts.tracker_by_file("latest") is layouts.run_tracker("deepspeed")
    assert layouts.tracker_by_file("latest_checkpointed_iteration.txt") is layouts.run_tracker("verl-fsdp")
