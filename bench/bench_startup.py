"""`ckpt-audit scan` start-up: time from process spawn to the first file opened (target < 0.15 s, issue 16; no torch),
as a ratio against a bare `python -c pass` measured in the same run.

The child installs an audit hook (sys.addaudithook, the stdlib's `open` event) that records the wall clock and its
own CPU time (time.process_time) the first time a file under the scanned tree is opened, so no instrumentation lives
in ckpt-audit itself. On a loaded machine the CPU time is the steadier figure (the wall time includes waiting for a
core).

    python bench/bench_startup.py [--repeat 7] [--no-bytecode]

Modules load from compiled bytecode, as in an installed package (pip writes .pyc files at install): the children
run with PYTHONDONTWRITEBYTECODE unset and a private PYTHONPYCACHEPREFIX, warmed by one discarded run. Where the
environment sets PYTHONDONTWRITEBYTECODE (as the development VM does), every start-up would otherwise compile each
module from source, about half of the import time. `--no-bytecode` measures that case instead.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import os, sys, time
root = sys.argv[1]
def hook(event, args, _root=root, _done=[]):
    path = args[0] if event == "open" and isinstance(args[0], str) else ""
    if not _done and path.startswith(_root) and path.endswith(".pt"):
        _done.append(1)
        os.write(2, f"FIRST {time.time()} {time.process_time()}\n".encode())
sys.addaudithook(hook)
from ckpt_audit.cli import main
sys.argv = ["ckpt-audit", "scan", "-q", "--catalog", sys.argv[2], root]
try:
    main()
finally:
    os.write(2, ("TORCH " + str("torch" in sys.modules) + "\n").encode())
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--no-bytecode", action="store_true", help="compile from source every run (no .pyc)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ)
        if args.no_bytecode:
            env["PYTHONDONTWRITEBYTECODE"] = "1"
        else:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = os.path.join(tmp, "pycache")
        actor = Path(tmp) / "root" / "p" / "e" / "global_step_1" / "actor"
        actor.mkdir(parents=True)
        for r in range(2):
            for k in ("model", "optim", "extra_state"):
                (actor / f"{k}_world_size_2_rank_{r}.pt").write_bytes(b"x" * 1024)
        (actor.parent / "data.pt").write_bytes(b"x" * 64)
        (actor.parent.parent / "latest_checkpointed_iteration.txt").write_text("1")
        root = str(Path(tmp) / "root")
        base, first, cpu, base_cpu, torch_loaded = [], [], [], [], None
        warm = [sys.executable, "-c", CHILD, root, os.path.join(tmp, "warm.db")]
        subprocess.run(warm, capture_output=True, env=env)  # writes the bytecode; not timed
        for i in range(args.repeat):
            r0, t = resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
            subprocess.run([sys.executable, "-c", "pass"], check=True, env=env)
            base.append(time.time() - t)
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            base_cpu.append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
            db = os.path.join(tmp, f"c{i}.db")
            t = time.time()
            out = subprocess.run([sys.executable, "-c", CHILD, root, db], capture_output=True, text=True, env=env)
            lines = dict(line.split(" ", 1) for line in out.stderr.splitlines() if line[:5] in ("FIRST", "TORCH"))
            wall_at, cpu_at = map(float, lines["FIRST"].split())
            first.append(wall_at - t)
            cpu.append(cpu_at)
            torch_loaded = lines.get("TORCH")
        b, f = statistics.median(base), statistics.median(first)
        print("bytecode:", "none (compiled from source each run)" if args.no_bytecode else "cached (.pyc)")
        print(f"bare `python -c pass`: {b * 1000:.0f} ms (median of {args.repeat})")
        print(
            f"`ckpt-audit scan` spawn to first shard opened: {f * 1000:.0f} ms "
            f"(min {min(first) * 1000:.0f}, max {max(first) * 1000:.0f}); torch imported: {torch_loaded}"
        )
        print(
            f"CPU time (user+sys) of the child up to its first open: {statistics.median(cpu) * 1000:.0f} ms "
            f"(min {min(cpu) * 1000:.0f}) vs a whole bare `python -c pass` "
            f"{statistics.median(base_cpu) * 1000:.0f} ms: "
            f"{statistics.median(cpu) / statistics.median(base_cpu):.1f}x (steadier than wall time on a loaded box)"
        )
        print(f"ratio: {f / b:.1f}x bare python; target < 0.15 s: {'met' if f < 0.15 else 'MISSED'}")


if __name__ == "__main__":
    main()
