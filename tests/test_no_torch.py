"""A cron host without torch: scan, ls, show, prune (dry run), export and continuity run with `import torch` made to
fail (a meta-path blocker in the child, as on a host where `pip install ckpt-audit` pulled no extras), and none of
them imports sqlite-utils once the catalog is up to date. The export is the default stream engine; --engine torch
names the extra in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BLOCK = r"""
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
from ckpt_audit.cli import main
try:
    main()
finally:
    if "sqlite_utils" in sys.modules and sys.argv[1] != "scan-first":
        sys.stderr.write("SQLITE_UTILS_IMPORTED\n")
"""


def cli(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK, *map(str, args)], capture_output=True, text=True, timeout=300)


def test_the_cron_commands_run_without_torch(verl_run, copy_run, tmp_path):
    run = copy_run(verl_run)
    db = tmp_path / "c.db"
    first = cli("scan", "-q", "--catalog", db, run)  # creates the catalog: migrations import sqlite-utils here
    assert first.returncode == 0, first.stderr
    again = cli("scan", "-q", "--catalog", db, run)
    assert again.returncode == 0 and "SQLITE_UTILS_IMPORTED" not in again.stderr, again.stderr
    listed = cli("ls", "--json", "--catalog", db)
    assert listed.returncode == 0 and json.loads(listed.stdout)["runs"], listed.stderr
    step = sorted(run.glob("global_step_*"), key=lambda p: int(p.name[12:]))[-1]
    shown = cli("show", step, "--catalog", db)
    assert shown.returncode == 0 and "SQLITE_UTILS_IMPORTED" not in shown.stderr, shown.stderr
    pruned = cli("prune", "--keep-last", "1", "--dry-run", "--catalog", db, run)
    assert pruned.returncode == 0, pruned.stderr
    assert all(p.exists() for p in run.glob("global_step_*"))
    out = tmp_path / "hf"
    exported = cli("export", step, "--to", out, "--dtype", "bf16", "--json", "--catalog", db)
    assert exported.returncode == 0, exported.stderr
    assert json.loads(exported.stdout)["verified"] is True and (out / "model.safetensors").is_file()
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 40)))
    cont = cli("continuity", metrics, "--metric", "loss")
    assert cont.returncode in (0, 1), cont.stderr  # 1: a finding; never an import error
    assert "torch" not in cont.stderr

    torch_engine = cli("export", step, "--to", tmp_path / "hf2", "--engine", "torch", "--catalog", db)
    lines = torch_engine.stderr.strip().splitlines()
    assert torch_engine.returncode == 3 and len(lines) == 1 and "ckpt-audit[torch]" in lines[0], lines
    assert not (tmp_path / "hf2").exists() and Path(out).is_dir()
