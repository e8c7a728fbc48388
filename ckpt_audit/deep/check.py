"""What a deep check is: the functions a layout names in `Layout.deep_checks`, and how verify finds them.

A layout names its checks as "module:function" strings (layouts may not import deep: it sits above them and loads
torch); `component_checks` and `step_checks` import them when verify first asks.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass
from functools import cache
from typing import Any

from ckpt_audit import layouts
from ckpt_audit.models import Checkpoint, Component, Finding


@dataclass(frozen=True, slots=True)
class Deep:
    """What one check found on one component. A check whose state a later checkpoint is compared with (weights a
    step of training must have changed) also keeps that state (`view`) and the comparison (`since`): verify calls
    `since(previous, name)` with the result of the same check on the same role of the run's previous checkpoint,
    `name` that checkpoint's directory name."""

    findings: tuple[Finding, ...] = ()
    view: Any = None
    since: Callable[[Deep, str], Sequence[Finding]] | None = None


# (the checkpoint, the component, the paths the scan found broken beyond loading: not opened again) -> Deep
ComponentCheck = Callable[[Checkpoint, Component, Set[str]], Deep]
# (the checkpoint, the broken paths) -> findings on the checkpoint's own files
StepCheck = Callable[[Checkpoint, Set[str]], Sequence[Finding]]


@cache
def component_checks(layout: str) -> tuple[tuple[str, ComponentCheck], ...]:
    """(name, check) of each deep check of a component whose Component.layout is `layout`."""
    return tuple((name, _load(name)) for name in layouts.deep_checks(layout))


@cache
def step_checks(layout: str) -> tuple[StepCheck, ...]:
    """The deep checks of a checkpoint's own files in a run whose Run.layout is `layout`."""
    return tuple(_load(name) for name in layouts.deep_step_checks(layout))


def _load(name: str) -> Any:
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)
