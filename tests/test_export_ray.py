"""`export --ray`: each output shard written and read back by a Ray task on the session's local cluster
(tests/ray_cluster.py: three nodes on this machine, so they share its filesystem, as nodes on a shared store do).
The files must be the bytes one process writes; a node that does not see the work directory must refuse the export
before anything is written; a task's failure must end the export as a local worker's does: one line, the
destination as it was."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_export_jobs import _files
from test_export_stream import latest_step

from ckpt_audit.cli import cli
from ckpt_audit.cluster.ray_export import RayFiles
from ckpt_audit.export.fsdp_shards import plan_shards
from ckpt_audit.export.guard import ExportError
from ckpt_audit.export.orchestrator import export_checkpoint
from ckpt_audit.export.stream_plan import StreamError
from ckpt_audit.export.stream_write import export_tensors

REPO = Path(__file__).resolve().parent.parent
SHARDS = ["--max-shard-size", "20000", "--max-load-size", "0"]


@pytest.mark.slow
def test_ray_tasks_write_the_bytes_one_process_writes(ray_cluster, verl_run, tmp_path):
    step = latest_step(verl_run)
    export_checkpoint(step, tmp_path / "one", max_shard_size=20_000, max_load_size=0)
    args = ["export", str(step), "--to", str(tmp_path / "ray"), *SHARDS, "--json", "--catalog", str(tmp_path / "c.db")]
    out = CliRunner().invoke(cli, [*args, "--ray"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    one, ray = _files(tmp_path / "one"), _files(tmp_path / "ray")
    assert list(one) == list(ray) and all(one[rel] == ray[rel] for rel in one)
    shards = [rel for rel in ray if rel.startswith("model-")]
    assert len(shards) >= 3 and doc["read_back"]
    # every shard was a task, pinned round robin over the nodes that passed the probe
    assert sum(doc["ray"]["nodes"].values()) == len(shards) and len(doc["ray"]["nodes"]) >= 2


@pytest.mark.slow
def test_a_node_that_does_not_see_the_work_directory_refuses_the_export(ray_cluster, verl_run, tmp_path):
    """--to on a tmpfs mounted in this driver's own mount namespace: the nodes' workers, outside it, see an empty
    directory there. Refused before any shard is written, exit 2, and nothing is left in the directory."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"], check=False).returncode != 0:
        pytest.skip("needs unshare -m (root or CAP_SYS_ADMIN) to give the driver a store the nodes do not see")
    private = tmp_path / "private"
    private.mkdir()
    export = [sys.executable, "-m", "ckpt_audit", "export", str(latest_step(verl_run)), "--to", str(private / "hf")]
    export += [*SHARDS, "--ray", ray_cluster.cluster.address]
    script = 'mount -t tmpfs none "$0" || exit 99; "$@"; rc=$?; ls -A "$0"; exit $rc'
    env = {**os.environ, "PYTHONPATH": str(REPO), "CKPT_AUDIT_CATALOG": str(tmp_path / "c.db")}
    proc = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(private), *export],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not see the export's work directory" in lines[0], proc.stderr
    assert proc.stdout == ""  # `ls -A` of the tmpfs after the export: nothing written, nothing left


@pytest.mark.slow
def test_a_failing_task_gives_the_error_one_process_gives(ray_cluster, verl_run, copy_run, tmp_path):
    """A storage changed after planning fails its CRC in the Ray task that copies it: the same one-line error as
    export --jobs 1 (the worker's own exception, not Ray's traceback)."""
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
    for name, run_files in (("local", None), ("ray", RayFiles())):
        (tmp_path / name).mkdir()
        with pytest.raises(StreamError) as exc:
            export_tensors(
                plan,
                tmp_path / name,
                target=None,
                max_shard_size=20_000,
                verify=True,
                tie=False,
                tick=lambda n: None,
                read_tick=lambda: None,
                run_files=run_files,
            )
        errors.append(str(exc.value))
    assert "fails its CRC-32" in errors[0] and "\n" not in errors[0]
    assert errors[1] == errors[0]


@pytest.mark.slow
def test_a_task_failing_mid_export_leaves_the_earlier_export_in_place(ray_cluster, verl_run, copy_run, tmp_path):
    """--force over an earlier export; a source shrinks once the first shard's task is done: the export fails in one
    line and --to is the earlier export, byte for byte, with no work directory beside it."""
    step = latest_step(copy_run(verl_run))
    out = tmp_path / "out" / "hf"
    export_checkpoint(step, out, max_shard_size=20_000, max_load_size=0)
    before = _files(out)
    victim = step / "actor" / "model_world_size_2_rank_1.pt"

    def progress(done, total, name):
        if victim.stat().st_size > 4096:
            os.truncate(victim, 4096)

    with pytest.raises(ExportError) as exc:
        export_checkpoint(
            step, out, force=True, max_shard_size=20_000, max_load_size=0, progress=progress, run_files=RayFiles(jobs=1)
        )
    assert "\n" not in str(exc.value)
    assert victim.stat().st_size == 4096  # the truncation did happen mid-export
    assert _files(out) == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["hf"]


# not cli_proc.ckpt_audit: `code` runs in the child before the CLI (through -c), which `-m` cannot
def _cli(args: list[str], code: str = "") -> subprocess.CompletedProcess:
    run = f"{code}from ckpt_audit.cli import cli\ncli.main({args!r})\n"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, env=env, timeout=120)


def test_ray_flag_without_the_extra_or_the_cluster_is_one_line(tmp_path):
    """Before the catalog is touched: no extra, exit 2; an address nobody answers, exit 3 (at once, not after Ray's
    minutes of retries)."""
    base = ["export", str(tmp_path), "--to", str(tmp_path / "hf"), "--catalog", str(tmp_path / "c.db")]
    missing = _cli([*base, "--ray"], code="import sys\nsys.modules['ray'] = None\n")
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        "ckpt-audit: export --ray needs the optional extra: pip install 'ckpt-audit[ray]'"
    ]
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    port_of = f"127.0.0.1:{port}"
    gone = _cli([*base, "--ray", port_of])
    assert gone.returncode == 3
    lines = gone.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"ckpt-audit: error: cannot reach the Ray cluster at 127.0.0.1:{port}"
    )
    assert not (tmp_path / "c.db").exists() and not (tmp_path / "hf").exists()


def _task_pids() -> list[int]:
    """Ray workers running an export task (Ray titles a worker after the task it runs)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and (d / "cmdline").read_bytes().startswith(b"ray::_write_task"):
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


@pytest.mark.slow
def test_a_task_killed_is_one_line_and_the_other_tasks_are_stopped(ray_cluster, verl_run, tmp_path):
    """Every shard task waits at the hold seam; the first to start is SIGKILLed (the OOM killer, an operator): the
    export fails in one line instead of hanging, and once it returns no other task is left to write."""
    import signal
    import threading
    import time

    step = latest_step(verl_run)
    files = {r: step / "actor" / f"model_world_size_2_rank_{r}.pt" for r in (0, 1)}
    plan = plan_shards(files, 2, step / "actor")
    for node in ray_cluster.ids:
        (ray_cluster.hold / f"{node}.hold").touch()
    killed: list[int] = []

    def kill_the_first_started() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed:
            if any(ray_cluster.hold.glob("*.started")) and (pids := _task_pids()):
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
            time.sleep(0.05)

    killer = threading.Thread(target=kill_the_first_started)
    killer.start()
    try:
        with pytest.raises(StreamError) as exc:
            export_tensors(
                plan,
                tmp_path,
                target=None,
                max_shard_size=20_000,
                verify=True,
                tie=False,
                tick=lambda n: None,
                read_tick=lambda: None,
                run_files=RayFiles(),
            )
    finally:
        killed.append(-1)  # stops the killer if the export ended first
        killer.join()
    assert killed[0] > 0 and "\n" not in str(exc.value) and " died (" in str(exc.value), exc.value
    assert _task_pids() == []  # the held tasks were cancelled and their workers gone before it returned
    assert not any(p.suffix == ".safetensors" for p in tmp_path.iterdir())  # all were held before writing
