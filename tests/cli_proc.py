"""`ckpt-audit ARGS` in a real subprocess: the one helper for tests that run the CLI as a shell or a cron job
would (its own process, its real exit status, stdin not a terminal so nothing prompts).

Tests that run the CLI many times use forked_cli.py (one warm interpreter, a fork per command); in-process
CliRunner calls stay where the process boundary does not matter.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def unprivileged() -> list[str] | None:
    """A command prefix under which chmod 000 is honoured: nothing when not root; for root, setpriv dropping the
    capabilities that bypass file permissions; None when neither is possible (skip such tests)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search"] if setpriv else None


def ckpt_audit(
    *args: object,
    catalog: Path | None = None,
    env: dict[str, str] | None = None,
    as_user: bool = False,
    cwd: Path | None = None,
    text: bool = True,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """Run `python -m ckpt_audit ARGS`. `catalog`: given as CKPT_AUDIT_CATALOG (every command's default);
    `env`: added to this process's environment; `as_user`: under unprivileged() (root loses its file-permission
    bypass)."""
    prefix = unprivileged() if as_user else []
    assert prefix is not None, "mark the test skipif(unprivileged() is None)"
    extra = {} if catalog is None else {"CKPT_AUDIT_CATALOG": str(catalog)}
    return subprocess.run(
        [*prefix, sys.executable, "-m", "ckpt_audit", *map(str, args)],
        capture_output=True,
        text=text,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        cwd=cwd,
        env={**os.environ, **extra, **(env or {})},
    )
