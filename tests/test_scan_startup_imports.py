"""What `ckpt-audit scan` imports before it opens the first file (issue 16: start-up <= 0.15 s).

An audit hook (the stdlib's `open` event) snapshots sys.modules the moment the first .pt under the tree is opened;
rendering, the catalog's write path, sqlite-utils (and numpy behind it), torch and the plug-ins must not be in it.
An import-set check, not a timing check: it fails when someone adds an eager import to the scan's start-up path.
"""

from __future__ import annotations

import ast
import json
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

CHILD = r"""
import json, sys
root = sys.argv[1]
seen = []
def hook(event, args):
    path = args[0] if event == "open" and isinstance(args[0], str) else ""
    if not seen and path.startswith(root) and path.endswith(".pt"):
        seen.append(sorted(sys.modules))
sys.addaudithook(hook)
from ckpt_audit.cli import cli
try:
    cli.main(["scan", "-q", "--catalog", sys.argv[2], root], standalone_mode=False)
except SystemExit:
    pass
doc = {"before_first_open": seen[0] if seen else None, "after": sorted(sys.modules)}
print(json.dumps(doc))
"""

# must not be loaded when the first file is opened (the scan needs none of them to start reading)
NOT_BEFORE_FIRST_FILE = (
    "ckpt_audit.report",
    "ckpt_audit.catalog.store",
    "ckpt_audit.metrics_textfile",
    "ckpt_audit.cluster",
    "ckpt_audit.verify",
    "ckpt_audit.lifecycle",
    "ckpt_audit.catalog.node_memory",  # scan --ray's node memory
    "ckpt_audit.readers.pt",  # the pickle reader: needed once a file is hashed, not to open it
    "ckpt_audit.readers.dcp_metadata",  # DCP's .metadata reader (and the unpickler behind it): on the first one
    "ckpt_audit.readers.unpickler",
    "pickle",
    "concurrent.futures",  # the file pool is plain threads (concurrent.futures imports logging, traceback)
    "logging",
    "importlib.metadata",  # entry-point discovery: only for a command that is not built in (plug-ins, --help)
    "sqlite_utils",
    "numpy",
    "torch",
    "textual",
    "prometheus_client",
    "ray",
    "tui",
    "harness",
)
# the command modules the scan may load: the group imports a subcommand's module only when that command runs
SCAN_CLI_MODULES = {"ckpt_audit.cli", "ckpt_audit.cli.group", "ckpt_audit.cli.common", "ckpt_audit.cli.scan"}


def _tree(tmp_path):
    actor = tmp_path / "root" / "p" / "e" / "global_step_1" / "actor"
    actor.mkdir(parents=True)
    for r in range(2):
        for k in ("model", "optim", "extra_state"):
            (actor / f"{k}_world_size_2_rank_{r}.pt").write_bytes(b"x" * 1024)
    # one shard in torch.save's zip layout, so the scan reads a pickle (and loads its reader) after the first open
    with zipfile.ZipFile(actor / "model_world_size_2_rank_0.pt", "w") as z:
        z.writestr("model_world_size_2_rank_0/data.pkl", pickle.dumps({"step": 1}, protocol=2))
        z.writestr("model_world_size_2_rank_0/version", "3\n")
    (actor.parent.parent / "latest_checkpointed_iteration.txt").write_text("1")
    return tmp_path / "root"


def _run(tmp_path, root, db):
    cmd = [sys.executable, "-c", CHILD, str(root), str(db)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _loaded(modules, prefix):
    return [m for m in modules if m == prefix or m.startswith(prefix + ".")]


def test_scan_opens_its_first_file_before_rendering_or_catalog_writes(tmp_path):
    doc = _run(tmp_path, _tree(tmp_path), tmp_path / "c.db")
    before = doc["before_first_open"]
    assert before is not None, "the scan never opened a .pt file"
    assert "ckpt_audit.readers.hashing" in before  # the hook fired where the reading starts
    early = {p: _loaded(before, p) for p in NOT_BEFORE_FIRST_FILE if _loaded(before, p)}
    assert early == {}
    assert set(_loaded(before, "ckpt_audit.cli")) == SCAN_CLI_MODULES
    # the check can fail: rendering and the catalog's write path do load, after the first file
    assert "ckpt_audit.report" in doc["after"]
    assert "ckpt_audit.catalog.store" in doc["after"]
    assert "ckpt_audit.readers.pt" in doc["after"]


# stdlib modules no ckpt_audit module on the start-up path may import at module level (outside TYPE_CHECKING):
# pathlib brings urllib.parse and ipaddress (~5 ms here). Checked in the source, because a development (editable)
# install's import finder loads pathlib itself in every python start, so sys.modules cannot tell.
NOT_IMPORTED_AT_START = ("pathlib",)


def _module_level_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue  # annotations only
        for sub in ast.walk(node):
            if isinstance(sub, ast.Import):
                found.update(a.name.split(".")[0] for a in sub.names)
            elif isinstance(sub, ast.ImportFrom) and sub.module and not sub.level:
                found.add(sub.module.split(".")[0])
    return found


def test_the_start_up_path_imports_no_pathlib(tmp_path):
    doc = _run(tmp_path, _tree(tmp_path), tmp_path / "c.db")
    early = [m for m in doc["before_first_open"] if m.split(".")[0] == "ckpt_audit"]
    files = {m: Path(__import__(m, fromlist=["_"]).__file__) for m in early}
    assert len(files) > 20  # the check can fail: the scan's own modules are all there
    offenders = {m: sorted(_module_level_imports(f) & set(NOT_IMPORTED_AT_START)) for m, f in files.items()}
    assert {m: bad for m, bad in offenders.items() if bad} == {}
    # ... and the check sees a module-level import where there is one
    assert "pathlib" in _module_level_imports(Path(__import__("ckpt_audit.lifecycle.prune", fromlist=["_"]).__file__))
