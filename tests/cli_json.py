"""Scan a tree through the real CLI and read its JSON document: the layout tests' shared vocabulary."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from click.testing import CliRunner

from ckpt_audit.cli import cli


def age(root: Path, seconds: float = 3600) -> None:
    """Date `root` and everything below it `seconds` back, so nothing counts as being written."""
    t = time.time() - seconds
    for p in [root, *root.rglob("*")]:
        os.utime(p, (t, t))


def invoke(*args: str, catalog: Path):
    return CliRunner().invoke(cli, [*args, "--catalog", str(catalog)])


def scan_json(root: Path, catalog: Path, *extra: str, command: str = "scan") -> dict:
    """`command` (scan or verify) --json on `root`; exit 0 or 1 (findings), never a usage or IO error."""
    res = invoke(command, "--json", *extra, str(root), catalog=catalog)
    assert res.exit_code in (0, 1), res.output
    return json.loads(res.stdout)


def statuses(doc: dict) -> dict[int, str]:
    [run] = doc["runs"]
    return {c["step"]: c["status"] for c in run["checkpoints"]}


def findings_of(doc: dict, step: int) -> list[dict]:
    [run] = doc["runs"]
    [c] = [c for c in run["checkpoints"] if c["step"] == step]
    return [*c["findings"], *(f for comp in c["components"] for f in comp["findings"])]


def codes_of(doc: dict, step: int) -> set[str]:
    return {f["code"] for f in findings_of(doc, step)}
