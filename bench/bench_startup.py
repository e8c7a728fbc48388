"""`ckpt-audit scan` start-up: time from process spawn to the first file opened (target < 0.15 s, issue 16; no torch),
as a ratio against a bare `python -c pass` measured in the same run.

The child installs an audit hook (sys.addaudithook, the stdlib's `open` event) that records the wall clock and its
own CPU time (time.process_time) the first time a file under the scanned tree is opened, so no instrumentation lives
in ckpt-audit itself. On a loaded machine the CPU time is the steadier figure (the wall time includes waiting for a
core).

    python bench/bench_startup.py [--repeat 7] [--no-bytecode] [--before DIR] [--whole]

`--whole` times whole processes instead (spawn to exit) of three named commands: `python -m ckpt_audit --help`,
`scan -q` of the same small tree (a re-scan: its catalog is made by the warm-up run) and `ls` of that catalog,
each against the same bare `python -c pass`, interleaved with --before's runs.

`--before DIR` also times DIR (a copy of the package from another commit, e.g. `git worktree add /tmp/before HEAD`;
put first on PYTHONPATH, with its own bytecode cache), interleaved with the working tree's runs in one loop, so a
before/after pair meets the same load; the module count at the first open is printed for each.

Modules load from compiled bytecode, as in an installed package (pip writes .pyc files at install): the children
run with PYTHONDONTWRITEBYTECODE unset and a private PYTHONPYCACHEPREFIX, warmed by one discarded run. Where the
environment sets PYTHONDONTWRITEBYTECODE (as the development VM does), every start-up would otherwise compile each
module from source, about half of the import time. `--no-bytecode` measures that case instead.

It times the ckpt_audit the running interpreter imports. A development (editable) install is not what a user runs:
setuptools' finder for it imports pathlib, re and urllib.parse at every python start, ~30 ms here, so the bare python
figure grows by as much. To time a regular install, make one and run this file with its interpreter:
`python3 -m venv /tmp/inst && /tmp/inst/bin/pip install . && /tmp/inst/bin/python bench/bench_startup.py` (with
`PYTHONPATH=$PWD` the working tree is timed on that interpreter). The first lines printed name the interpreter
and where ckpt_audit came from.
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
        os.write(2, f"FIRST {time.time()} {time.process_time()} {len(sys.modules)}\n".encode())
sys.addaudithook(hook)
from ckpt_audit.cli import main
sys.argv = ["ckpt-audit", "scan", "-q", "--catalog", sys.argv[2], root]
try:
    main()
finally:
    os.write(2, ("TORCH " + str("torch" in sys.modules) + "\n").encode())
"""

WHERE = r"""
import sys, ckpt_audit
editable = any(m.startswith("__editable__") for m in sys.modules)
kind = "editable install" if editable else "regular install or PYTHONPATH"
print(f"ckpt_audit from {ckpt_audit.__path__[0]} ({kind})")
"""


def _child(cmd: list[str], env: dict[str, str], cwd: str) -> tuple[float, float, int, str | None]:
    """One scan child: (wall seconds to its first open, its CPU seconds by then, modules loaded by then, torch?).
    `cwd` is not the repository root: `python -c` puts the working directory ahead of PYTHONPATH (and --before)."""
    t = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
    lines = dict(line.split(" ", 1) for line in out.stderr.splitlines() if line[:5] in ("FIRST", "TORCH"))
    if "FIRST" not in lines:
        raise SystemExit(f"the scan child opened no shard: {out.stderr[-2000:]}")
    wall_at, cpu_at, modules = lines["FIRST"].split()
    return float(wall_at) - t, float(cpu_at), int(modules), lines.get("TORCH")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--no-bytecode", action="store_true", help="compile from source every run (no .pyc)")
    ap.add_argument("--before", type=Path, help="a package tree to compare with, put first on PYTHONPATH")
    ap.add_argument("--whole", action="store_true", help="whole-process wall time of --help, scan and ls")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ)
        if args.no_bytecode:
            env["PYTHONDONTWRITEBYTECODE"] = "1"
        else:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = os.path.join(tmp, "pycache")
        trees = {"now": env}
        if args.before:
            path = [str(args.before.resolve()), *filter(None, [env.get("PYTHONPATH")])]
            trees = {"before": {**env, "PYTHONPATH": os.pathsep.join(path)}, "now": env}
            if not args.no_bytecode:  # its own cache: the two trees' modules share names and paths differ
                trees["before"]["PYTHONPYCACHEPREFIX"] = os.path.join(tmp, "pycache-before")
        actor = Path(tmp) / "root" / "p" / "e" / "global_step_1" / "actor"
        actor.mkdir(parents=True)
        for r in range(2):
            for k in ("model", "optim", "extra_state"):
                (actor / f"{k}_world_size_2_rank_{r}.pt").write_bytes(b"x" * 1024)
        (actor.parent / "data.pt").write_bytes(b"x" * 64)
        (actor.parent.parent / "latest_checkpointed_iteration.txt").write_text("1")
        root = str(Path(tmp) / "root")
        if args.whole:
            return _whole(args.repeat, trees, env, root, tmp)
        base, base_cpu = [], []
        first = {name: [] for name in trees}
        cpu = {name: [] for name in trees}
        modules, torch_loaded = {}, None
        for name, tree_env in trees.items():  # writes the bytecode; not timed
            _child([sys.executable, "-c", CHILD, root, os.path.join(tmp, f"warm-{name}.db")], tree_env, tmp)
        for i in range(args.repeat):
            r0, t = resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
            subprocess.run([sys.executable, "-c", "pass"], check=True, env=env)
            base.append(time.time() - t)
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            base_cpu.append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
            for name in list(trees)[:: 1 if i % 2 == 0 else -1]:  # alternate which tree goes first
                db = os.path.join(tmp, f"c{i}-{name}.db")
                cmd = [sys.executable, "-c", CHILD, root, db]
                wall, cpu_at, modules[name], torch = _child(cmd, trees[name], tmp)
                first[name].append(wall)
                cpu[name].append(cpu_at)
                torch_loaded = torch if name == "now" else torch_loaded
        med = statistics.median
        where = subprocess.run(  # what is timed: an editable install's finder runs at every start, bare python too
            [sys.executable, "-c", WHERE], capture_output=True, text=True, env=env, cwd=tmp, check=True
        ).stdout.strip()
        print(f"interpreter: {sys.executable} (Python {sys.version.split()[0]}); {where}")
        b, bc = med(base), med(base_cpu)
        print("bytecode:", "none (compiled from source each run)" if args.no_bytecode else "cached (.pyc)")
        print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(f"bare `python -c pass`: {b * 1000:.0f} ms wall, {bc * 1000:.0f} ms CPU (median of {args.repeat})")
        for name in trees:
            f, c = first[name], cpu[name]
            print(
                f"{name}: `ckpt-audit scan` spawn to first shard opened: {med(f) * 1000:.0f} ms "
                f"(min {min(f) * 1000:.0f}, max {max(f) * 1000:.0f}); CPU (user+sys) of the child by then: "
                f"{med(c) * 1000:.0f} ms (min {min(c) * 1000:.0f}), {med(c) / bc:.1f}x a whole bare python "
                f"(steadier than wall time on a loaded box); {modules[name]} modules loaded"
            )
        if args.before:
            print(
                f"now/before: wall {med(first['now']) / med(first['before']):.2f}x, "
                f"CPU {med(cpu['now']) / med(cpu['before']):.2f}x"
            )
        f = med(first["now"])
        print(f"torch imported: {torch_loaded}")
        print(f"ratio: {f / b:.1f}x bare python; target < 0.15 s: {'met' if f < 0.15 else 'MISSED'}")


def _whole(repeat: int, trees: dict[str, dict[str, str]], env: dict[str, str], root: str, tmp: str) -> None:
    """Spawn-to-exit wall time of three commands, each tree's runs interleaved (alternating which goes first)."""
    commands = {
        "--help": ["--help"],
        "scan": ["scan", "-q", "--catalog", "{db}", root],
        "ls": ["ls", "--catalog", "{db}"],
    }
    walls: dict[tuple[str, str], list[float]] = {(c, n): [] for c in commands for n in trees}
    cpus: dict[tuple[str, str], list[float]] = {(c, n): [] for c in commands for n in trees}
    base: list[float] = []

    def once(name: str, argv: list[str]) -> tuple[float, float]:
        db = os.path.join(tmp, f"whole-{name}.db")
        cmd = [sys.executable, "-m", "ckpt_audit", *(a.replace("{db}", db) for a in argv)]
        r0, t = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, env=trees[name], cwd=tmp)
        wall, r1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN)
        if out.returncode not in (0, 1):
            raise SystemExit(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr.decode()[-2000:]}")
        return wall, r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime

    for name in trees:  # bytecode and the catalogs; not timed
        for argv in commands.values():
            once(name, argv)
    for i in range(repeat):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True, env=env)
        base.append(time.perf_counter() - t)
        for c, argv in commands.items():
            for name in list(trees)[:: 1 if i % 2 == 0 else -1]:
                wall, cpu = once(name, argv)
                walls[c, name].append(wall)
                cpus[c, name].append(cpu)
    med = statistics.median
    b = med(base)
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {repeat} runs each, bytecode cached")
    print(f"bare `python -c pass`: {b * 1000:.0f} ms wall (median)")
    for c in commands:
        line = [f"`ckpt-audit {c}` whole process:"]
        for name in trees:
            w = walls[c, name]
            u = cpus[c, name]
            line.append(
                f"{name} {med(w) * 1000:.0f} ms (min {min(w) * 1000:.0f}, {med(w) / b:.1f}x bare python; "
                f"CPU {med(u) * 1000:.0f} ms)"
            )
        if "before" in trees:
            now, before = (c, "now"), (c, "before")
            line.append(
                f"now/before wall {med(walls[now]) / med(walls[before]):.3f}x, "
                f"CPU {med(cpus[now]) / med(cpus[before]):.3f}x"
            )
        print("  ".join(line))


if __name__ == "__main__":
    main()
