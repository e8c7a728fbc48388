"""Issue 26: one hostile pickle is a finding on its file, with bounded work, never the end of the whole scan.

Each case replaces `data.pt` of a trainer-written run (tests/conftest.py `verl_run`) with a torch.save-shaped zip
(`data/data.pkl`, `data/version`, `data/byteorder`) whose pickle is a few bytes of hostile opcodes:

- `builtins.bytearray(2**31)`: an allowlisted constructor with a huge size. torch.load(weights_only=False), as verl
  loads data.pt, allocates 2 GiB; the restricted unpickler used to do the same (RSS 2 GiB, 8 s).
- a dict whose key is a tuple nested 1M deep (~1 MB): hashing it overflows the C stack, so the scan died with
  SIGSEGV (exit -11) and took every run of the root with it.
- lists nested 100k deep, and a BINBYTES8 whose length runs past the file: findings, never RecursionError.

The CLI runs in a child whose peak RSS is measured: it stays far below the size the pickle asks for.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a trainer-written tree

_PEAK = (
    "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]);"
    " print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)"
)

DEEP = 1_000_000
BOMBS = {
    # PROTO 2, GLOBAL builtins.bytearray, LONG1 2**31, TUPLE1, REDUCE, STOP
    "bytearray-2GiB": (b"\x80\x02cbuiltins\nbytearray\n\x8a\x05\x00\x00\x00\x80\x00\x85R.", "pickle-over-bounds"),
    # EMPTY_DICT, EMPTY_TUPLE, TUPLE1 x DEEP (the key), BININT1 1, SETITEM, STOP
    "tuple-key-1M-deep": (b"\x80\x02})" + b"\x85" * DEEP + b"K\x01s.", "pickle-over-bounds"),
    # EMPTY_LIST x 100k, APPEND x 100k-1: lists nested 100k deep
    "lists-100k-deep": (b"\x80\x02" + b"]" * 100_000 + b"a" * 99_999 + b".", "pickle-over-bounds"),
    # BINBYTES8 of 2**40 bytes, of which the file holds 10
    "binbytes-past-the-end": (b"\x80\x04\x8e" + (2**40).to_bytes(8, "little") + b"x" * 10 + b".", "bad-pickle"),
}
# the deep tuple key in torch.load's other containers: the legacy format (its second pickle) and a raw pickle
LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19."
BOMBS["legacy-tuple-key-1M-deep"] = (LEGACY_MAGIC + BOMBS["tuple-key-1M-deep"][0], "pickle-over-bounds")
BOMBS["raw-tuple-key-1M-deep"] = BOMBS["tuple-key-1M-deep"]


def _plant(path: Path, pickle: bytes, case: str) -> None:
    """A zip shaped as torch.save writes it (stored entries under the stem's folder, a version record), or for the
    legacy and raw cases the bytes as they are."""
    if case.startswith(("legacy-", "raw-")):
        path.write_bytes(pickle)
        return
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("data/data.pkl", pickle)
        z.writestr("data/byteorder", "little")
        z.writestr("data/version", "3\n")


def _cli_peak(*args: str) -> tuple[int, str, int]:
    """(exit code, stdout, peak RSS in KiB) of `ckpt-audit ARGS` run in a child of its own (not cli_proc's: a parent
    that ran nothing else reads the CLI's peak from RUSAGE_CHILDREN)."""
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK, sys.executable, "-m", "ckpt_audit", *args],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return proc.returncode, proc.stdout, int(proc.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("case", sorted(BOMBS))
def test_a_hostile_pickle_is_a_finding_on_its_file_with_bounded_memory(copy_run, verl_run, tmp_path, case):
    pickle, code = BOMBS[case]
    run = copy_run(verl_run)
    steps = sorted(run.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    newest, target = steps[-1], steps[-1] / "data.pt"
    _plant(target, pickle, case)
    catalog = str(tmp_path / "c.db")

    rc, out, peak_kib = _cli_peak("scan", "--json", str(run.parent.parent), "--catalog", catalog)
    assert rc == 1, out[-2000:]
    assert peak_kib < 1024 * 1024, f"peak RSS {peak_kib} KiB"
    doc = json.loads(out)
    checkpoints = {c["path"]: c for r in doc["runs"] for c in r["checkpoints"]}
    ck = checkpoints[str(newest)]
    found = [f for f in ck["findings"] if f["path"] == str(target)]
    assert code in {f["code"] for f in found}, found
    assert ck["status"] == ("unsafe" if code == "pickle-over-bounds" else "corrupt")
    assert all(c["status"] == "complete" for p, c in checkpoints.items() if p != str(newest))  # the rest is judged

    rc, out, _ = _cli_peak("latest", str(run), "--catalog", catalog)
    assert (rc, out.strip()) == (0, str(steps[-2]))
    rc, out, _ = _cli_peak("prune", "--dry-run", "--json", "--keep-last", "1", str(run), "--catalog", catalog)
    plan = json.loads(out)["plan"]
    assert rc == 0 and {c["path"] for c in plan["keep"]} == {str(steps[-2]), str(newest)}
    if case not in ("tuple-key-1M-deep", "bytearray-2GiB"):
        return  # verify (torch.load behind the restricted read) once per kind of bomb: it imports torch
    rc, out, _ = _cli_peak("verify", "--json", str(newest), "--catalog", catalog)
    [ck] = [c for r in json.loads(out)["runs"] for c in r["checkpoints"]]
    assert (rc, ck["status"]) == (1, "unsafe" if code == "pickle-over-bounds" else "corrupt")
