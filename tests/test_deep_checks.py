"""Layouts own their deep checks (`Layout.deep_checks`): every name a layout gives resolves to a function of
`ckpt_audit.deep`, every kind of component a layout builds has its checks named, and verify, the composer, knows no
format of its own."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

from ckpt_audit import layouts
from ckpt_audit.deep import check

VERIFY = Path(__file__).resolve().parent.parent / "ckpt_audit" / "verify.py"


def named_checks() -> list[str]:
    return [
        name
        for layout in layouts.load_layouts()
        for names in (*layout.deep_checks.components.values(), layout.deep_checks.step)
        for name in names
    ]


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
    kinds = {name for layout in layouts.load_layouts() for name in (layout.name, *layout.deep_checks.components)}
    assert not strings & kinds
    assert not [s for s in strings if any(x in s for x in (".json", ".pt", ".metadata", "dist_ckpt", "huggingface"))]
    imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    assert not [m for m in imported if m.startswith("ckpt_audit.layouts")]
    assert "FileKind" not in VERIFY.read_text()
