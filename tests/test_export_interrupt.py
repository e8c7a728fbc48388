"""Ctrl-C at any moment of a real `ckpt-audit export`: exit 130, one line, nothing left written, nothing left running.

The terminal's Ctrl-C is SIGINT to the whole process group (the CLI, its --jobs workers and their forkserver, the
transformers load's child), so the test signals the group. The clock starts once main() has imported its first
module (`-X importtime` says when): before that it is Python's own start-up, not ours.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

# most fall while the command's modules load (where the exit was -2, or a traceback from a starting worker);
# the last ones while the shards are written, read back and loaded with transformers
DELAYS_S = (0.0, 0.03, 0.06, 0.09, 0.12, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.7, 1.0, 1.4)


def _interrupted_export(src, out, catalog, delay: float) -> tuple[int, list[str], str]:
    cmd = [sys.executable, "-X", "importtime", "-m", "ckpt_audit", "export", str(src), "--to", str(out)]
    cmd += ["--jobs", "2", "--max-shard-size", "20KB", "--catalog", str(catalog)]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    started = []
    for line in proc.stderr:  # up to the first module main() imports
        started.append(line)
        if any(x.split(b"|")[-1].strip() == b"ckpt_audit.cli" for x in started[:-1]):
            break
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    lines = b"".join(started + [stderr]).decode(errors="replace").splitlines()
    said = [x for x in lines if x.strip() and not x.startswith("import time:")]
    for _ in range(100):  # the forkserver leaves once the CLI has gone
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"processes of the export still running after its exit (delay {delay} s)")
    return proc.returncode, said, stdout.decode()


@pytest.mark.slow
def test_ctrl_c_at_any_moment_of_an_export_exits_130_and_leaves_nothing(verl_run, tmp_path):
    src = verl_run / "global_step_6"
    for i, delay in enumerate(DELAYS_S):
        parent = tmp_path / f"out{i}"
        parent.mkdir()
        code, said, printed = _interrupted_export(src, parent / "hf", tmp_path / "c.db", delay)
        assert (delay, code, said, printed) == (delay, 130, ["ckpt-audit: interrupted"], "")
        assert list(parent.iterdir()) == []  # no --to, no hidden work directory
