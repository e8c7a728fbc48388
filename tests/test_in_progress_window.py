"""One in-progress window (issue 27): every default of it is models.IN_PROGRESS_WINDOW_S, the 300 s docs/scan.md
promises. The command-line options, the service layer, the scanner and the judging context used to carry their own
copies (300 s and 120 s)."""

from __future__ import annotations

import importlib
import inspect

from ckpt_audit import scan, session, verify
from ckpt_audit.cli import COMMANDS
from ckpt_audit.models import IN_PROGRESS_WINDOW_S
from ckpt_audit.rules.status import ScanContext


def test_the_documented_window_is_300_s():
    assert IN_PROGRESS_WINDOW_S == 300.0


def test_every_command_option_defaults_to_the_one_window():
    seen = []
    for name, target in COMMANDS.items():
        module, attr = target.split(":")
        command = getattr(importlib.import_module(module), attr)
        for p in command.params:
            if p.name == "in_progress_window":
                seen.append(name)
                assert p.default == IN_PROGRESS_WINDOW_S, name
    assert {"scan", "verify", "latest", "fix-tracker"} <= set(seen)


def test_every_core_default_is_the_one_window():
    functions = [
        scan.scan,
        verify.verify,
        session.Session.scan,
        session.Session.verify,
        session.Session.plan_fix_tracker,
        session.latest,
    ]
    for f in functions:
        assert inspect.signature(f).parameters["in_progress_window_s"].default == IN_PROGRESS_WINDOW_S, f.__qualname__
    assert inspect.signature(scan.scan_partial).parameters["window_ns"].default == int(IN_PROGRESS_WINDOW_S * 1e9)
    assert ScanContext(now_ns=0).in_progress_window_ns == int(IN_PROGRESS_WINDOW_S * 1e9)
