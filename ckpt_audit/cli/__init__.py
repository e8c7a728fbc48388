"""The `ckpt-audit` entry point. Importing this module imports nothing heavy: the click group (ckpt_audit.cli.group)
loads inside main(), where a Ctrl-C is already answered with one line and exit 130 (an interrupt while click
loaded was a traceback and death by SIGINT)."""

from __future__ import annotations

import codecs
import os
import sys

from ckpt_audit.exitcodes import ExitCode

# the group's names, for `from ckpt_audit.cli import cli` (tests, plug-ins); loaded on first use
_GROUP_NAMES = ("cli", "COMMANDS", "PLUGIN_GROUP", "LazyGroup", "plugins", "run")


def __getattr__(name: str):
    if name in _GROUP_NAMES:
        from ckpt_audit.cli import group

        return getattr(group, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    """Entry point: map every outcome onto a documented exit code; never exit 1 on a crash."""
    _utf8_mode()
    try:
        from ckpt_audit.cli.group import run

        code = run()
    except KeyboardInterrupt:  # while the group loaded, or while run() answered another outcome
        print("ckpt-audit: interrupted", file=sys.stderr)
        code = ExitCode.INTERRUPTED
    # CPython (3.11, `python -m`) kills itself with SIGINT at exit, whatever code it was given, once a
    # KeyboardInterrupt has left an exec() of a string (dataclasses and namedtuple build their methods so at
    # import), caught or not; a clean exec() of a string clears that record.
    exec("None")
    sys.exit(int(code))


def _utf8_mode() -> None:
    """Run under Python's UTF-8 mode when the locale's encoding is ASCII (PYTHONUTF8=0 with LC_ALL=C, LANG=en_US):
    there every non-ASCII byte of a file name decodes to an escape the catalog (UTF-8 text) cannot store. Python
    enables the mode itself for LC_ALL=C unless told not to; this re-runs the command once, before it does anything."""
    if sys.flags.utf8_mode or codecs.lookup(sys.getfilesystemencoding()).name != "ascii":
        return
    try:
        os.execv(sys.executable, [sys.executable, "-X", "utf8", *sys.orig_argv[1:]])
    except OSError:
        pass  # cannot re-run: go on in this mode (arguments that are not UTF-8 are refused below)
