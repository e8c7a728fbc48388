"""Issue 11, invariant 5: export never destroys and never launders. Attacks through the real CLI (a subprocess, as a
user runs it) and the real TUI on trees written by the reference trainer, plus the kill -9 matrix for export.

Destroying: a --to that is, contains or sits inside a checkpoint, run or scanned root is refused (exit 2) and nothing
is touched; --force replaces only an earlier export (its .ckpt-audit-export.json marker) or an empty directory.
Laundering: a source whose shards fail their CRC or their hash against the catalog's manifest, or that the catalog
holds as corrupt, is refused (exit 1) unless --allow-corrupt, which is recorded; "verified" says what it rests on.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import zipfile
import zlib
from pathlib import Path

import pytest
from cli_proc import ckpt_audit
from forked_cli import ForkedCli

from ckpt_audit.killpoints import KILL_AFTER_ENV
from harness.commands.demo import flip_payload_byte

MARKER = ".ckpt-audit-export.json"


# ---------------------------------------------------------------------------------------------------- helpers


def tree_digest(top: Path) -> dict[str, tuple[str, int]]:
    """Every file under `top` (links not followed) by content and mtime, and every directory: what "untouched" means."""
    out = {}
    for dirpath, dirs, files in os.walk(top):
        for name in dirs:
            out[os.path.join(dirpath, name)] = ("dir", 0)
        for name in files:
            p = Path(dirpath, name)
            out[str(p)] = (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
    return out


def step(run: Path, n: int) -> Path:
    return run / f"global_step_{n}"


def shard(run: Path, n: int, rank: int = 1) -> Path:
    return step(run, n) / "actor" / f"model_world_size_2_rank_{rank}.pt"


def one_line_error(proc: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpt-audit: error: ") and "Traceback" not in proc.stderr, lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def export_files_match_marker(out: Path) -> dict:
    """The export at `out` is whole: its marker lists exactly the files there, each with its recorded hash."""
    from ckpt_audit.readers.hashing import digest_file

    marker = json.loads((out / MARKER).read_text())
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} - {MARKER}
    assert on_disk == set(marker["files"]), (on_disk, set(marker["files"]))
    for rel, f in marker["files"].items():
        assert digest_file(out / rel).hash == f["hash"], rel
    return marker


def flip_payload_byte_keeping_crc(path: Path) -> None:
    """Flip a payload byte AND rewrite that entry's CRC-32 (local header and central directory), size and mtime kept:
    the zip is self-consistent again, so only a hash against the catalog's manifest can tell."""
    st = os.stat(path)
    flip_payload_byte(path)
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
        start_dir = z.start_dir
    data = bytearray(path.read_bytes())
    n, m = (int.from_bytes(data[info.header_offset + o : info.header_offset + o + 2], "little") for o in (26, 28))
    payload = info.header_offset + 30 + n + m
    crc = zlib.crc32(data[payload : payload + info.compress_size]).to_bytes(4, "little")
    data[info.header_offset + 14 : info.header_offset + 18] = crc
    pos = start_dir
    while data[pos : pos + 4] == b"PK\x01\x02":
        ln, le, lc = (int.from_bytes(data[pos + o : pos + o + 2], "little") for o in (28, 30, 32))
        if bytes(data[pos + 46 : pos + 46 + ln]) == info.filename.encode():
            data[pos + 16 : pos + 20] = crc
        pos += 46 + ln + le + lc
    with open(path, "r+b") as fh:
        fh.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture
def scanned(verl_run, copy_run, tmp_path):
    """(root, run, catalog): a private copy of the W=2 run under its own root, scanned into a fresh catalog."""
    run = Path(copy_run(verl_run))
    root = run.parent.parent
    catalog = tmp_path / "catalog.db"
    proc = ckpt_audit("scan", root, "-q", catalog=catalog)
    assert proc.returncode == 0, proc.stderr
    return root, run, catalog


# ---------------------------------------------------------------------------------------------------- destroying


def test_force_to_the_run_dir_a_typo_for_run_hf_is_refused_and_the_run_is_untouched(scanned):
    root, run, catalog = scanned
    before = tree_digest(root)
    proc = ckpt_audit("export", step(run, 6), "--to", run, "--force", catalog=catalog)
    one_line_error(proc, 2, f"is the run {run}")
    assert tree_digest(root) == before


def test_force_to_a_root_holding_two_runs_is_refused(verl_run, verl_run_w3, copy_run, tmp_path):
    run = Path(copy_run(verl_run))
    other = run.parent / "exp-w3"
    shutil.copytree(verl_run_w3, other, symlinks=True)
    root = run.parent.parent
    catalog = tmp_path / "catalog.db"
    assert ckpt_audit("scan", root, "-q", catalog=catalog).returncode == 0
    before = tree_digest(root)
    for to in (run.parent, root):  # the directory holding both runs, and the scanned root itself
        one_line_error(
            ckpt_audit("export", step(run, 6), "--to", to, "--force", catalog=catalog), 2, "refusing to write there"
        )
    assert tree_digest(root) == before


def test_force_to_the_parent_of_the_run_is_refused_without_any_catalog_knowledge(verl_run, copy_run, tmp_path):
    run = Path(copy_run(verl_run))  # never scanned: only the source's own run tells
    before = tree_digest(run.parent)
    proc = ckpt_audit("export", step(run, 6), "--to", run.parent, "--force", catalog=tmp_path / "empty.db")
    one_line_error(proc, 2, f"contains the run {run}")
    assert tree_digest(run.parent) == before


def test_to_inside_the_checkpoint_is_refused_and_nothing_is_created(scanned):
    _root, run, catalog = scanned
    to = step(run, 6) / "actor" / "hf"
    one_line_error(ckpt_audit("export", step(run, 6), "--to", to, catalog=catalog), 2, "is inside the checkpoint")
    assert not to.exists() and not list(to.parent.glob(".hf.ckpt-audit-*"))


def test_force_to_a_symlink_into_another_run_is_refused_and_the_link_kept(scanned, verl_run_w3, tmp_path):
    root, run, catalog = scanned
    other = run.parent / "exp-w3"
    shutil.copytree(verl_run_w3, other, symlinks=True)
    assert ckpt_audit("scan", root, "-q", catalog=catalog).returncode == 0
    link = tmp_path / "hf-link"
    link.symlink_to(step(other, 4))  # outside every root itself, but it points into a run
    before = tree_digest(root)
    one_line_error(
        ckpt_audit("export", step(run, 6), "--to", link, "--force", catalog=catalog), 2, "refusing to write there"
    )
    assert link.is_symlink() and os.readlink(link) == str(step(other, 4))
    assert tree_digest(root) == before


def test_force_at_an_unscanned_run_is_refused_by_what_it_holds(scanned, verl_run_w3, tmp_path):
    _root, run, catalog = scanned
    elsewhere = tmp_path / "elsewhere" / "exp"  # a run no catalog and no root knows
    shutil.copytree(verl_run_w3, elsewhere, symlinks=True)
    before = tree_digest(elsewhere)
    one_line_error(
        ckpt_audit("export", step(run, 6), "--to", elsewhere, "--force", catalog=catalog), 2, "holds checkpoint data"
    )
    assert tree_digest(elsewhere) == before


def test_force_at_a_nonempty_directory_that_is_not_an_export_is_refused(scanned, tmp_path):
    _root, run, catalog = scanned
    out = tmp_path / "models"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    one_line_error(
        ckpt_audit("export", step(run, 6), "--to", out, "--force", catalog=catalog),
        2,
        "only an earlier export or an empty directory",
    )
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"


def test_force_at_an_earlier_export_with_a_file_added_is_refused(scanned, tmp_path):
    _root, run, catalog = scanned
    out = tmp_path / "hf"
    assert ckpt_audit("export", step(run, 4), "--to", out, catalog=catalog).returncode == 0
    (out / "README.md").write_text("my model card")
    one_line_error(ckpt_audit("export", step(run, 6), "--to", out, "--force", catalog=catalog), 2, "README.md")
    assert (out / "README.md").read_text() == "my model card"


def test_force_replaces_an_earlier_export(scanned, tmp_path):
    _root, run, catalog = scanned
    out = tmp_path / "hf"
    assert ckpt_audit("export", step(run, 4), "--to", out, catalog=catalog).returncode == 0
    assert json.loads((out / MARKER).read_text())["source"] == str(step(run, 4))
    proc = ckpt_audit("export", step(run, 6), "--to", out, "--force", "--json", catalog=catalog)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["replaced"] == "export" and doc["verified"] is True
    assert export_files_match_marker(out)["source"] == str(step(run, 6))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".hf")) == []  # no work dirs left


# ---------------------------------------------------------------------------------------------------- laundering


def test_byte_flipped_with_size_and_mtime_kept_is_refused_while_the_catalog_says_complete(scanned, tmp_path):
    _root, run, catalog = scanned
    flip_payload_byte(shard(run, 6))  # after the scan: the catalog still holds step 6 as complete
    out = tmp_path / "hf"
    one_line_error(
        ckpt_audit("export", step(run, 6), "--to", out, catalog=catalog),
        1,
        str(shard(run, 6)),
        "crc-mismatch",
        "--allow-corrupt",
    )
    assert not out.exists()


def test_flip_with_its_crc_rewritten_is_caught_by_the_hash_against_the_manifest(scanned, tmp_path):
    _root, run, catalog = scanned
    flip_payload_byte_keeping_crc(shard(run, 6))
    from ckpt_audit.readers.hashing import digest_file

    assert digest_file(shard(run, 6)).crc_ok is True  # the CRC check alone would pass it
    one_line_error(
        ckpt_audit("export", step(run, 6), "--to", tmp_path / "hf", catalog=catalog),
        1,
        str(shard(run, 6)),
        "hash-drift",
    )
    assert not (tmp_path / "hf").exists()


def test_a_checkpoint_the_catalog_holds_as_corrupt_is_refused_even_when_its_files_now_read_clean(scanned, tmp_path):
    root, run, catalog = scanned
    pristine = tmp_path / "pristine.pt"
    shutil.copy2(shard(run, 6), pristine)
    flip_payload_byte(shard(run, 6))
    assert ckpt_audit("scan", root, "--rehash", "-q", catalog=catalog).returncode == 1  # now the catalog says corrupt
    shutil.copy(pristine, shard(run, 6))  # good bytes back, new mtime: the files alone would pass
    line = one_line_error(
        ckpt_audit("export", step(run, 6), "--to", tmp_path / "hf", catalog=catalog),
        1,
        str(shard(run, 6)),
        "re-scan if it was repaired",
    )
    assert "crc-mismatch" in line or "hash-drift" in line, line
    assert not (tmp_path / "hf").exists()


def test_a_source_failing_its_check_while_it_is_copied_is_refused_and_the_copy_discarded(scanned, tmp_path):
    """The source check re-reads the shards beside the copy pass. A flip with its CRC rewritten passes the copy's
    CRC checks, so the whole export is written into the hidden work directory before the whole-file hash against the
    catalog refuses it: that directory and the directories made for --to are gone, and no thread is left."""
    from ckpt_audit.export.guard import ExportRefused
    from ckpt_audit.session import open_session

    _root, run, catalog = scanned
    flip_payload_byte_keeping_crc(shard(run, 6))  # after the scan: the catalog still holds step 6 as complete
    out = tmp_path / "made" / "for" / "hf"
    written: list[str] = []
    before = set(threading.enumerate())
    with open_session(catalog) as s, pytest.raises(ExportRefused) as refused:
        s.export(step(run, 6), out, progress=lambda _i, _n, name: written.append(name))
    assert refused.value.about == "source" and [f.code for f in refused.value.findings] == ["hash-drift"]
    assert len(written) == TENSORS  # copied in full before the check's verdict came
    assert not (tmp_path / "made").exists()  # nothing at --to, no work dir, no parent left behind
    assert set(threading.enumerate()) == before
    db = sqlite3.connect(catalog)
    assert db.execute("SELECT COUNT(*) FROM exports").fetchone() == (0,)


# Fails the copy pass with a real write error: a file-size limit (EFBIG once SIGXFSZ is ignored) under the output
# size, while the source check is still reading a large (sparse) file the export would copy.
COPY_FAILS = r"""
import json, resource, signal, sys, threading
from pathlib import Path
from ckpt_audit.export.guard import ExportError
from ckpt_audit.session import open_session

catalog, step, out, limit = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
checking = []
def progress(_i, _n, _name):
    checking.append(any(t.name == "ckpt-export-check" for t in threading.enumerate()))
error = None
with open_session(Path(catalog)) as s:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        s.export(step, out, progress=progress)
    except ExportError as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
print(json.dumps({"error": error, "checking": checking, "threads": [t.name for t in threading.enumerate()]}))
"""


def test_a_copy_pass_failing_while_the_source_check_runs_is_one_line_and_leaves_nothing(scanned, tmp_path):
    _root, run, catalog = scanned
    big = step(run, 6) / "actor" / "huggingface" / "tokenizer.model"  # a file export copies: the check reads it
    with open(big, "wb") as fh:
        fh.truncate(768 * 2**20)  # sparse: no disk used, ~0.2 s to hash
    limit = (shard(run, 6, 0).stat().st_size + shard(run, 6, 1).stat().st_size) // 4  # a quarter of the weights

    out = tmp_path / "made" / "hf"
    proc = subprocess.run(
        [sys.executable, "-c", COPY_FAILS, str(catalog), str(step(run, 6)), str(out), str(limit)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["error"].startswith("ExportError: ") and "File too large" in doc["error"], doc["error"]
    assert doc["checking"] and doc["checking"][-1], doc  # tensors were written while the check was still reading
    assert doc["threads"] == ["MainThread"]  # joined: no check or hashing thread outlives the export
    assert not (tmp_path / "made").exists()

    def no_limit_past(n: int):  # a child's file-size limit, with SIGXFSZ ignored (inherited across exec)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (n, resource.RLIM_INFINITY))

    proc = subprocess.run(  # not cli_proc.ckpt_audit: the child needs preexec_fn for its file-size limit
        [sys.executable, "-m", "ckpt_audit", "export", str(step(run, 6)), "--to", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "CKPT_AUDIT_CATALOG": str(catalog)},
        preexec_fn=lambda: no_limit_past(limit),
    )
    one_line_error(proc, 3, f"export to {out} failed", "File too large", "nothing was put there")
    assert not (tmp_path / "made").exists()


@pytest.mark.parametrize("config", [b"{garbage", b"[1, 2]", b"\xff\xfe"])
def test_a_config_json_that_is_not_a_json_object_is_refused_by_name(verl_run, copy_run, tmp_path, config):
    """huggingface/config.json garbled: transformers cannot load the export, so it is refused as the model check
    refuses a missing config (exit 1, naming config.json), not a bare JSONDecodeError or TypeError; nothing at --to."""
    run = Path(copy_run(verl_run))
    (step(run, 6) / "actor" / "huggingface" / "config.json").write_bytes(config)
    out = tmp_path / "hf"
    proc = ckpt_audit("export", step(run, 6), "--to", out, "--max-load-size", "0", catalog=tmp_path / "c.db")
    one_line_error(proc, 1, "config.json")
    assert not out.exists() and not list(tmp_path.glob(".hf*"))


def test_allow_corrupt_exports_and_records_the_override(scanned, tmp_path):
    _root, run, catalog = scanned
    flip_payload_byte(shard(run, 6))
    proc = ckpt_audit("export", step(run, 6), "--to", tmp_path / "hf", "--allow-corrupt", "--json", catalog=catalog)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["override"] == "allow-corrupt" and doc["verified"] is False and doc["source_verified"] is False
    assert {f["code"] for f in doc["source_findings"]} >= {"crc-mismatch"}
    assert "--allow-corrupt" in proc.stderr  # the warning names what was overridden
    db = sqlite3.connect(catalog)
    assert db.execute("SELECT override, verified, source_verified FROM exports").fetchall() == [("allow-corrupt", 0, 0)]
    assert json.loads((tmp_path / "hf" / MARKER).read_text())["override"] == "allow-corrupt"


def test_verified_says_what_the_source_was_checked_against(scanned, verl_run, tmp_path):
    _root, run, catalog = scanned
    proc = ckpt_audit("export", step(run, 6), "--to", tmp_path / "a", "--json", catalog=catalog)
    doc = json.loads(proc.stdout)
    assert (doc["source_check"], doc["source_verified"], doc["verified"]) == ("manifest", True, True)
    assert (
        "source re-read and equal to the catalog's manifest"
        in ckpt_audit("export", step(run, 6), "--to", tmp_path / "b", catalog=catalog).stdout
    )
    db = sqlite3.connect(catalog)
    assert [r[0] for r in db.execute("SELECT source_verified FROM exports ORDER BY id")] == [1, 1]
    shard_rows = dict(db.execute("SELECT path, hash FROM files WHERE checkpoint_path = ?", [str(step(run, 6))]))
    recorded = dict(json.loads(db.execute("SELECT source_files FROM exports").fetchone()[0]))
    assert recorded[str(shard(run, 6))] == shard_rows[str(shard(run, 6))]

    never_scanned = step(verl_run, 6)  # no manifest for it: CRCs only, and said so
    doc = json.loads(
        ckpt_audit("export", never_scanned, "--to", tmp_path / "c", "--json", catalog=tmp_path / "other.db").stdout
    )
    assert (doc["source_check"], doc["source_verified"], doc["verified"]) == ("crc-only", False, True)


# ---------------------------------------------------------------------------------------------------- TUI


def _tui_export(root: Path, catalog: Path, to: str | None):
    """Export the newest checkpoint from its details screen as a user does; `to` None keeps the offered default."""
    from textual.widgets import Input
    from tui_pilot import drive, open_run, settle, wait_armed

    from tui.app import AuditApp
    from tui.screens.prompt import ExportPrompt

    app = AuditApp(catalog_path=catalog, roots=[str(root)])

    async def script(pilot):
        await open_run(pilot)
        await pilot.press("enter")
        await pilot.pause()
        await pilot.press("x")
        await pilot.pause()
        prompt = app.screen
        assert isinstance(prompt, ExportPrompt)
        await wait_armed(pilot, prompt)
        if to is not None:
            prompt.query_one("#export-to", Input).value = to
        await pilot.press("enter")  # ends the path
        await pilot.pause()
        await pilot.press("enter")  # presses Export
        await settle(pilot)

    drive(app, script)
    return app


def test_tui_export_goes_through_the_same_checks(scanned):
    root, run, catalog = scanned
    before = tree_digest(root)
    app = _tui_export(root, catalog, str(run / "hf"))  # a new directory inside the run
    assert app.last_export is None and "is inside the run" in (app.last_error or ""), app.last_error
    assert tree_digest(root) == before


def test_tui_offers_a_default_destination_the_checks_accept(scanned):
    root, _run, catalog = scanned
    app = _tui_export(root, catalog, None)
    assert app.last_error is None, app.last_error
    out = Path(app.last_export.out_dir)
    assert app.last_export.verified and out.parent == root.parent and (out / MARKER).is_file()


# ---------------------------------------------------------------------------------------------------- kill -9

TENSORS = 27  # tensors in verl_run's export (asserted below): the kill points are counted in them
# transformers' load of the export adds no kill point and would cost seconds per export here; its own kill test is
# in test_export_model.py
NO_LOAD = ("--max-load-size", "0")


@pytest.fixture
def forked_cli(tmp_path):
    """forked_cli(catalog, *args, env=...): the export in a child of one warm interpreter (tests/forked_cli.py), so
    each kill point is still a real process ended by SIGKILL at its k-th step, without a start-up per point."""
    server = ForkedCli(tmp_path, preload=("ckpt_audit.cli.export", "ckpt_audit.export.orchestrator"))
    yield lambda catalog, *args, env=None: server(*args, env={"CKPT_AUDIT_CATALOG": str(catalog), **(env or {})})
    server.close()


def kill_points(t: int) -> dict[str, int]:
    """export's counted steps (ckpt_audit.export.orchestrator docstring): t written, t read back, marker, rename, old
    removed, then the catalog transaction."""
    return {
        "writing the first tensor": 1,
        "writing the last tensor": t,
        "reading back": t + 2,
        "marked, right before the rename": 2 * t + 1,
        "right after the rename": 2 * t + 2,
        "earlier export removed": 2 * t + 3,
        "inside the catalog transaction": 2 * t + 4,
    }


def test_kill_9_at_every_point_of_an_export_leaves_source_target_and_catalog_whole(scanned, forked_cli, tmp_path):
    """At each point: the source byte-identical, --to a whole export (the earlier one before the rename, the new one
    after), the catalog intact with nothing half-recorded, and a re-run succeeds. Each re-run's export is the
    earlier export the next point's --force replaces (sources alternate, so the two are told apart)."""
    root, run, catalog = scanned
    out = tmp_path / "hf"
    first = forked_cli(catalog, "export", *NO_LOAD, step(run, 2), "--to", out, "--json")
    assert first.returncode == 0 and json.loads(first.stdout)["tensors"] == TENSORS
    before = tree_digest(root)
    earlier = step(run, 2)
    for point, k in kill_points(TENSORS).items():
        new = step(run, 6) if earlier != step(run, 6) else step(run, 4)
        killed = forked_cli(catalog, "export", *NO_LOAD, new, "--to", out, "--force", env={KILL_AFTER_ENV: str(k)})
        assert killed.returncode == -9, (point, killed.returncode, killed.stderr)

        assert tree_digest(root) == before, point
        in_place = k >= kill_points(TENSORS)["right after the rename"]
        assert export_files_match_marker(out)["source"] == str(new if in_place else earlier), point
        db = sqlite3.connect(catalog)
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok", point
        recorded = [r[0] for r in db.execute("SELECT source FROM exports ORDER BY id")]
        assert recorded[-1] == str(earlier), (point, recorded)  # the killed export left no row, whole or half
        assert db.execute(
            "SELECT COUNT(*) FROM export_files WHERE export_id NOT IN (SELECT id FROM exports)"
        ).fetchone() == (0,), point
        db.close()

        again = forked_cli(catalog, "export", *NO_LOAD, new, "--to", out, "--force")
        assert again.returncode == 0, (point, again.stderr)
        assert export_files_match_marker(out)["source"] == str(new), point
        assert [p.name for p in out.parent.iterdir() if p.name.startswith(".hf.")] == [], point  # reclaimed
        earlier = new


def test_the_kill_points_are_counted_as_the_matrix_assumes(scanned, forked_cli, tmp_path):
    """One step past the last kill point the export completes: the matrix above killed where it says it did."""
    _root, run, catalog = scanned
    out = tmp_path / "hf"
    assert forked_cli(catalog, "export", *NO_LOAD, step(run, 4), "--to", out).returncode == 0
    past = max(kill_points(TENSORS).values()) + 1
    proc = forked_cli(
        catalog, "export", *NO_LOAD, step(run, 6), "--to", out, "--force", env={KILL_AFTER_ENV: str(past)}
    )
    assert proc.returncode == 0, proc.stderr
    # Without an earlier export there is no removal step: the catalog transaction is one step sooner.
    fresh = tmp_path / "fresh"
    killed = forked_cli(catalog, "export", *NO_LOAD, step(run, 6), "--to", fresh, env={KILL_AFTER_ENV: str(past - 2)})
    assert killed.returncode == -9 and export_files_match_marker(fresh)["source"] == str(step(run, 6))
    db = sqlite3.connect(catalog)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert db.execute("SELECT COUNT(*) FROM exports WHERE out_dir = ?", [str(fresh)]).fetchone() == (0,)
    db.close()
    proc = forked_cli(
        catalog, "export", *NO_LOAD, step(run, 6), "--to", fresh, "--force", env={KILL_AFTER_ENV: str(past)}
    )
    assert proc.returncode == 0, proc.stderr
