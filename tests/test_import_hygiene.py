"""What each light path must not load, as one table: the cron commands never import torch or textual (~1.7 s and
~0.3 s here), nor an optional extra they were not asked to use (ray, prometheus_client); the modules a light
command imports stay light themselves. Each row runs in a fresh interpreter: sys.modules there is the truth.

A row either imports modules or runs a command on a tree (`tree`: a fixture name, "" for an empty directory), then
lists the top-level packages (or ckpt_audit modules) that must be absent and those that must be present (proof
that the path ran at all).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import NamedTuple

import pytest

HEAVY = ("torch", "textual", "tui", "transformers")  # numpy: sqlite_utils loads it (through pandas) when installed


class Row(NamedTuple):
    imports: tuple[str, ...] = ()  # modules to import
    command: tuple[str, ...] = ()  # or a CLI command, run on the tree
    tree: str = ""  # fixture name of the tree the command scans ("": an empty directory)
    absent: tuple[str, ...] = ()
    present: tuple[str, ...] = ()


TABLE = {
    "readers": Row(
        imports=("ckpt_audit.readers.hashing", "ckpt_audit.readers.pt", "ckpt_audit.readers.ptzip"),
        absent=("torch", "textual", "numpy"),
    ),
    "prune-and-export-modules": Row(
        imports=(
            "ckpt_audit.cli.prune",
            "ckpt_audit.cli.export",
            "ckpt_audit.lifecycle.prune",
            "ckpt_audit.lifecycle.retention",
            "ckpt_audit.lifecycle.survivors",
            "ckpt_audit.export.orchestrator",
            "ckpt_audit.session.terms",
            "ckpt_audit.session.export_terms",
        ),
        absent=("torch", "textual"),
    ),
    "continuity-modules": Row(
        imports=("ckpt_audit.cli.continuity", "ckpt_audit.continuity.plot", "ckpt_audit.continuity.audit"),
        absent=("torch",),
    ),
    "tui-command": Row(imports=("tui.command",), absent=("textual",)),
    # ls, show and the TUI's catalog reads: a session and the catalog, none of the scan's stages (design.md)
    "catalog-reads-modules": Row(
        imports=("ckpt_audit.session", "ckpt_audit.catalog.store", "ckpt_audit.catalog.verdicts"),
        absent=("torch", "ckpt_audit.scan", "ckpt_audit.scan.pipeline", "ckpt_audit.layouts"),
        present=("ckpt_audit.session.reads", "ckpt_audit.roots"),
    ),
    # scan without --ray / --metrics-file: no extra it was not asked for, and no cluster code
    "scan-empty-root": Row(
        command=("scan", "-q"),
        absent=(*HEAVY, "ray", "prometheus_client", "ckpt_audit.cluster", "ckpt_audit.session.cluster"),
        present=("ckpt_audit.session",),
    ),
    "scan-trainer-run": Row(
        command=("scan", "-q"),
        tree="verl_run",
        absent=(*HEAVY, "ray", "prometheus_client", "ckpt_audit.cluster", "ckpt_audit.session.cluster"),
        present=("ckpt_audit.readers.pt",),  # the shards were read: the path ran
    ),
}

PROBE = """
import json, sys
imports, command = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for name in imports:
    __import__(name)
if command:
    from ckpt_audit.cli import cli
    try:
        cli.main(command, standalone_mode=False)
    except SystemExit:
        pass
loaded = set(sys.modules)
print(json.dumps(sorted(loaded | {m.split(".")[0] for m in loaded})))
"""


@pytest.mark.parametrize(("name", "tree"), [(n, r.tree) for n, r in TABLE.items()])
def test_a_light_path_loads_nothing_heavy(name, tree, request, tmp_path):
    row = TABLE[name]
    root = request.getfixturevalue(tree) if tree else tmp_path / "empty"
    if not tree:
        root.mkdir()
    command = [*row.command, "--catalog", str(tmp_path / "c.db"), str(root)] if row.command else []
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(row.imports), json.dumps(command)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    loaded = set(json.loads(out.stdout.splitlines()[-1]))
    assert sorted(set(row.absent) & loaded) == [] and sorted(set(row.present) - loaded) == []


def test_the_table_can_fail():
    """A row's check sees a heavy import: importing the TUI's app loads textual."""
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(["tui.app"]), "[]"], capture_output=True, text=True)
    assert "textual" in json.loads(out.stdout.splitlines()[-1])
