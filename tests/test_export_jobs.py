"""`export --jobs N`: output shards written and read back by N worker processes. The files must be the bytes one
process writes (FSDP and Megatron sources, several shards), and a worker's failure must end the export as one
process's failure does: one line, nothing at --to, no work directory left."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
from cli_proc import ckpt_audit
from test_export_stream import latest_step

from ckpt_audit.export.fsdp_shards import plan_shards
from ckpt_audit.export.guard import MARKER, ExportError, ExportRefused
from ckpt_audit.export.orchestrator import export_checkpoint
from ckpt_audit.export.stream_plan import StreamError
from ckpt_audit.export.stream_write import export_tensors

pytestmark = pytest.mark.slow


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and p.name != MARKER}


def _same_both_ways(step: Path, root: Path, **kw) -> int:
    """Export `step` with --jobs 1 and --jobs 2; assert identical files and results; return the shard count."""
    got = {n: export_checkpoint(step, root / f"j{n}", jobs=n, max_load_size=0, **kw) for n in (1, 2)}
    one, two = _files(root / "j1"), _files(root / "j2")
    assert list(one) == list(two)
    for rel in one:
        assert one[rel] == two[rel], rel
    strip = [[(os.path.basename(f.path), f.size_bytes, f.hash) for f in got[n].files] for n in (1, 2)]
    assert strip[0] == strip[1]
    assert got[1].warnings == got[2].warnings and got[2].read_back and got[2].tensors == got[1].tensors
    return sum(1 for rel in one if rel.startswith("model-"))


def test_jobs_write_the_bytes_one_process_writes(verl_run, tmp_path):
    assert _same_both_ways(latest_step(verl_run), tmp_path / "fsdp", max_shard_size=20_000) >= 3
    # with a cast, so the numpy path runs in the workers too
    assert _same_both_ways(latest_step(verl_run), tmp_path / "bf16", max_shard_size=20_000, dtype="bf16") >= 3


@pytest.mark.skipif(find_spec("megatron") is None or find_spec("verl") is None, reason="needs megatron and verl")
def test_jobs_write_the_bytes_one_process_writes_from_megatron(tmp_path_factory, tmp_path):
    from conftest import build_cached, writer_key
    from test_export_megatron import WRITER, _step, _write

    key = writer_key(WRITER, ("torch", "megatron-core", "verl", "numpy", "transformers"))  # test_export_megatron's mgx
    mgx = build_cached(tmp_path_factory, "verl_megatron_export", _write, key=key)
    step, base = _step(mgx, "qwen3moe"), mgx / "qwen3moe" / "base_model"
    assert _same_both_ways(step, tmp_path, max_shard_size=20_000, hf_config=base) >= 3


def test_a_worker_failing_gives_the_error_one_process_gives(verl_run, copy_run, tmp_path):
    """A storage changed after planning fails its CRC in whichever process copies it: the same one-line error."""
    step = latest_step(copy_run(verl_run))
    files = {r: step / "actor" / f"model_world_size_2_rank_{r}.pt" for r in (0, 1)}
    plan = plan_shards(files, 2, step / "actor")
    piece = [p for t in plan.tensors for p in t.pieces if p.entry is not None and p.path == str(files[1])][-1]
    with open(files[1], "r+b") as fh:
        fh.seek(piece.offset)
        b = fh.read(1)
        fh.seek(piece.offset)
        fh.write(bytes([b[0] ^ 0x40]))
    errors = []
    for jobs in (1, 2):
        (tmp_path / f"w{jobs}").mkdir()
        with pytest.raises(StreamError) as exc:
            export_tensors(
                plan,
                tmp_path / f"w{jobs}",
                target=None,
                max_shard_size=20_000,
                verify=True,
                tie=False,
                tick=lambda n: None,
                read_tick=lambda: None,
                jobs=jobs,
            )
        errors.append(str(exc.value))
    assert "fails its CRC-32" in errors[0] and "\n" not in errors[0]
    assert errors[1] == errors[0]


def test_a_source_truncated_mid_export_leaves_nothing_at_to(verl_run, copy_run, tmp_path):
    """The rank file shrinks under the workers once the first shard is done: the export fails in one line, and
    neither --to nor a work directory is left (a worker killed by SIGBUS is a failure, not a hang)."""
    step = latest_step(copy_run(verl_run))
    victim = step / "actor" / "model_world_size_2_rank_1.pt"

    def progress(done, total, name):
        if victim.stat().st_size > 4096:
            os.truncate(victim, 4096)

    out = tmp_path / "out" / "hf"
    with pytest.raises((ExportError, ExportRefused)) as exc:
        export_checkpoint(step, out, jobs=2, max_shard_size=20_000, max_load_size=0, progress=progress)
    assert "\n" not in str(exc.value)
    assert victim.stat().st_size == 4096  # the truncation did happen mid-export
    assert not os.path.lexists(out)
    assert not os.path.lexists(tmp_path / "out")  # the parent this export made is gone too


_CUT_UNDER_EXPORT = """
import os, sys, threading
from pathlib import Path
from ckpt_audit.export.orchestrator import export_checkpoint
step, out, dtype = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
victim = step / "actor" / "model_world_size_2_rank_1.pt"
def progress(done, total, name):
    for check in threading.enumerate():  # the source check reads the files before the cut: the copy must find it
        if check.name == "ckpt-export-check":
            check.join()
    if victim.stat().st_size > 4096:
        os.truncate(victim, 4096)
try:
    export_checkpoint(step, out, jobs=1, dtype=dtype, max_shard_size=20_000, max_load_size=0, progress=progress)
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}")
"""


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_source_truncated_under_a_serial_export_is_one_line(verl_run, copy_run, tmp_path, dtype):
    """--jobs 1 copies in this process: a rank file cut mid-export is a one-line error, in the cast's path (bf16:
    numpy's blocks) as in the plain copy's, never SIGBUS from a mapping; nothing is left at --to or beside it. In its
    own process: a SIGBUS would kill pytest."""
    step = latest_step(copy_run(verl_run))
    out = tmp_path / "out" / "hf"
    proc = subprocess.run(
        [sys.executable, "-c", _CUT_UNDER_EXPORT, str(step), str(out), dtype],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ExportError: ") and "ends early" in proc.stdout, proc.stdout
    assert proc.stdout.count("\n") == 1
    assert (step / "actor" / "model_world_size_2_rank_1.pt").stat().st_size == 4096
    assert not os.path.lexists(tmp_path / "out")


def test_cli_jobs_option(verl_run, tmp_path):
    catalog = tmp_path / "c.db"
    args = [latest_step(verl_run), "--max-shard-size", "20000", "--max-load-size", "0", "--json"]
    for jobs in ("1", "2"):
        proc = ckpt_audit("export", *args, "--to", tmp_path / jobs, "--jobs", jobs, catalog=catalog)
        assert proc.returncode == 0, proc.stderr
    assert _files(tmp_path / "1") == _files(tmp_path / "2")
    bad = ckpt_audit(
        "export", latest_step(verl_run), "--to", tmp_path / "x", "--jobs", "0", catalog=catalog, timeout=60
    )
    assert bad.returncode == 2 and not (tmp_path / "x").exists()


def test_a_worker_killed_is_one_line_and_leaves_nothing(verl_run, tmp_path):
    """A worker gone (SIGKILL: the OOM killer, an operator) fails the export instead of hanging it."""
    import multiprocessing as mp
    import signal

    killed: list[int] = []

    def progress(done, total, name):
        for p in mp.active_children() if not killed else ():
            os.kill(p.pid, signal.SIGKILL)
            killed.append(p.pid)

    out = tmp_path / "out" / "hf"
    with pytest.raises(ExportError, match="an export worker process died"):
        export_checkpoint(latest_step(verl_run), out, jobs=2, max_shard_size=20_000, max_load_size=0, progress=progress)
    assert killed and not os.path.lexists(tmp_path / "out")
