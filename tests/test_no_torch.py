"""A cron host without torch: scan, ls, show, prune (dry run), export and continuity run with `import torch` made to
fail (a meta-path blocker in the child, as on a host where `pip install ckpt-audit` pulled no extras), and none of
them imports sqlite-utils once the catalog is up to date. The export is the default stream engine; --engine torch
names the extra in one line.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

NO_TORCH = r"""
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
"""
BLOCK = (
    NO_TORCH
    + r"""
from ckpt_audit.cli import main
try:
    main()
finally:
    if "sqlite_utils" in sys.modules and sys.argv[1] != "scan-first":
        sys.stderr.write("SQLITE_UTILS_IMPORTED\n")
"""
)


# not cli_proc.ckpt_audit: the child runs BLOCK (torch made unimportable) before main, which `-m` cannot
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


TUI_VERIFY = (
    NO_TORCH
    + r"""
import asyncio, json
from pathlib import Path
from tui.app import AuditApp

async def drive():
    app = AuditApp(catalog_path=Path(sys.argv[1]), roots=[])
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        await app.workers.wait_for_complete()
        started = app.verify([sys.argv[2]])
        await app.workers.wait_for_complete()
        print(json.dumps({"started": started, "error": app.last_error}))

asyncio.run(drive())
"""
)


def test_what_needs_torch_says_so_in_one_line_and_writes_nothing(verl_run, copy_run, tmp_path):
    """Without torch, verify would call every shard not-loadable (a good checkpoint `incomplete`, recorded) and the
    demo's trainer would die with a traceback in its child: each refuses up front, naming the extra."""
    run = copy_run(verl_run)
    step = sorted(run.glob("global_step_*"), key=lambda p: int(p.name[12:]))[-1]
    db = tmp_path / "c.db"
    refused = {
        "verify": ("verify", step, "--catalog", tmp_path / "v.db"),
        "scan --deep": ("scan", "--deep", run, "--catalog", tmp_path / "v.db"),
        "demo": ("demo", tmp_path / "demo"),
        "train": ("train", tmp_path / "train"),
        "resume-test": ("resume-test", "--keep", tmp_path / "resume"),
    }
    for command, args in refused.items():
        out = cli(*args)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 3 and len(lines) == 1, (command, out.stderr)
        assert f"`ckpt-audit {command}` needs 'torch'" in lines[0] and "ckpt-audit[torch]" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == [run.parents[1].name]  # no catalog, no demo, no tree

    assert cli("scan", "-q", "--catalog", db, run).returncode == 0  # the check can fail: scan does run here
    tui = subprocess.run(
        [sys.executable, "-c", TUI_VERIFY, str(db), str(step)], capture_output=True, text=True, timeout=300
    )
    assert tui.returncode == 0, tui.stderr
    doc = json.loads(tui.stdout.strip().splitlines()[-1])
    assert doc["started"] is False and "ckpt-audit[torch]" in doc["error"], doc
    # the TUI's opening re-scan is recorded; a verify without torch would have added not-loadable on every file
    assert sqlite3.connect(db).execute("SELECT COUNT(*) FROM findings WHERE code = 'not-loadable'").fetchone() == (0,)
