"""scan --ray without Ray: a one-line error, exit 2; scan without --ray never imports Ray (runs without the extra)."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_ray_flag_without_the_extra_is_one_line_exit_2(tmp_path):
    code = (
        "import sys\n"
        "sys.modules['ray'] = None  # as if the extra were not installed: `import ray` raises ImportError\n"
        "from ckpt_audit.cli import cli\n"
        f"cli.main(['scan', '--ray', '--catalog', {str(tmp_path / 'c.db')!r}, {str(tmp_path)!r}])\n"
    )
    out = _run(code)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "ckpt-audit: scan --ray needs the optional extra: pip install 'ckpt-audit[ray]'"
    ]
    assert not (tmp_path / "c.db").exists()
