"""`run_ranks(script, *args)`: `python SCRIPT ARGS` as N ranks on this host, each with the environment
torch.distributed.run gives a rank (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), for the
scripts that write or load DeepSpeed and Trainer trees. torchrun itself adds an agent process that imports torch and
a rendezvous before the ranks start and a wind-down after they end (3 to 4 s a run on 2 busy cores); the ranks, and
what the libraries in them write, are the same. As torchrun does, the first rank to fail takes the others down.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_ranks(
    script: Path, *args: str, nprocs: int = 2, env: dict | None = None, cwd: Path | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """The ranks' exit status (the first failure's, else 0) and their stdout and stderr, rank 0's first."""
    with socket.socket() as s:  # a free port for the gloo rendezvous (rank 0 hosts the store)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = dict(os.environ if env is None else env)
    base.update(WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    base.update(GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_NAME="default", ROLE_WORLD_SIZE=str(nprocs))
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        procs = []
        for rank in range(nprocs):
            out, err = (open(Path(tmp) / f"{rank}.{kind}", "w+") for kind in ("out", "err"))
            rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
            cmd = [sys.executable, str(script), *map(str, args)]
            proc = subprocess.Popen(
                cmd, env=rank_env, cwd=cwd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True
            )
            procs.append((proc, out, err))
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p, _, _ in procs) and not any(p.returncode for p, _, _ in procs):
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout)
                time.sleep(0.05)
            code = next((p.returncode for p, _, _ in procs if p.returncode), 0)  # before the others are killed
        finally:
            for p, _, _ in procs:  # the group: a rank's own children (DeepSpeed's converter) too
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        texts = []
        for _, out, err in procs:
            out.seek(0)
            err.seek(0)
            texts.append((out.read(), err.read()))
            out.close()
            err.close()
    return subprocess.CompletedProcess(cmd, code, "".join(o for o, _ in texts), "".join(e for _, e in texts))
