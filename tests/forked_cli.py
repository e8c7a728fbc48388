"""`ckpt-audit ARGS` in a child forked from one warm interpreter, for tests that run the CLI many times.

The server imports the CLI (and whatever `preload` names, e.g. torch) once, then forks a child per command: each
child is still its own process (a SIGKILL ends it alone, a payload that ran would run there, its exit status is
main()'s), without a start-up and import per command. Tests about the start-up itself or the installed entry point
keep a plain subprocess.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
from pathlib import Path

_SERVER = """
import importlib, json, os, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
from ckpt_audit.cli import main
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.environ.update(req["env"])
            sys.argv = ["ckpt-audit", *req["args"]]
            for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["out"], os.O_WRONLY | os.O_CREAT),
                                    (2, req["err"], os.O_WRONLY | os.O_CREAT)):
                os.dup2(os.open(path, flags), fd)
            main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


class ForkedCli:
    """ForkedCli(tmp_dir, preload)(*args, env={...}) -> CompletedProcess (returncode -9 when SIGKILL ended it)."""

    def __init__(self, tmp_dir: Path, preload: tuple[str, ...] = ()) -> None:
        self.tmp_dir = Path(tmp_dir)
        self.count = 0
        self.server = subprocess.Popen(
            [sys.executable, "-c", _SERVER, *preload], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def __call__(self, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        self.count += 1
        out, err = self.tmp_dir / f"forked{self.count}.out", self.tmp_dir / f"forked{self.count}.err"
        req = {"args": list(map(str, args)), "env": env or {}, "out": str(out), "err": str(err)}
        self.server.stdin.write(json.dumps(req) + "\n")
        self.server.stdin.flush()
        ready, _, _ = select.select([self.server.stdout], [], [], timeout)
        assert ready, f"ckpt-audit {args} hung"
        code = int(self.server.stdout.readline())
        return subprocess.CompletedProcess(args, code, out.read_text(), err.read_text())

    def close(self) -> None:
        self.server.stdin.close()
        assert self.server.wait(timeout=60) == 0
