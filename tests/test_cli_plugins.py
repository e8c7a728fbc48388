"""Commands plugged in from tui/ and harness/ through the `ckpt_audit.commands` entry points: listed, run, and
a missing plug-in package is a one-line error naming what to install (exit 3), never a traceback."""

from __future__ import annotations

import subprocess
import sys

from cli_proc import ckpt_audit
from click.testing import CliRunner

from ckpt_audit.cli import COMMANDS, cli, plugins
from ckpt_audit.exitcodes import ExitCode

PLUGGED = {"tui", "demo", "train", "resume-test"}


def run_without(module: str, *args: str) -> subprocess.CompletedProcess:
    """The real CLI in a fresh interpreter where `module` cannot be imported (as if it were not installed)."""
    code = f"import sys; sys.modules[{module!r}] = None; from ckpt_audit.cli import main; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


def test_plugins_are_registered_and_not_core_commands():
    assert set(plugins()) == PLUGGED  # pip install -e . registers them from pyproject.toml
    assert not PLUGGED & set(COMMANDS)


def test_help_lists_core_and_plugged_commands():
    out = ckpt_audit("--help", timeout=120)
    assert out.returncode == 0, out.stderr
    listed = {line.split()[0] for line in out.stdout.split("Commands:")[1].splitlines() if line.strip()}
    assert listed == set(COMMANDS) | PLUGGED


def test_plugged_command_help_has_an_example():
    for name in sorted(PLUGGED):
        res = CliRunner().invoke(cli, [name, "--help"])
        assert res.exit_code == 0 and "Example:" in res.output, name


def test_missing_plugin_package_is_one_line_naming_what_to_install(tmp_path):
    out = run_without("tui", "tui", str(tmp_path))
    assert out.returncode == ExitCode.ERROR
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert "ckpt-audit tui" in out.stderr and "pip install ckpt-audit" in out.stderr
    listing = run_without("harness", "--help")  # --help still lists it, marked unavailable
    rows = {line.split()[0]: line for line in listing.stdout.split("Commands:")[1].splitlines() if line.strip()}
    assert listing.returncode == 0 and "unavailable" in rows["demo"] and "unavailable" not in rows["tui"]


def test_the_core_commands_run_without_the_plugins(tmp_path):
    out = run_without("harness", "ls", "--catalog", str(tmp_path / "c.db"))
    assert "harness" not in out.stderr and out.returncode in (ExitCode.OK, ExitCode.ERROR)
