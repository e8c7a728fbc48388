"""--junit-xml FILE, the same for every command that has it (scan, verify, continuity, resume-test): checked before
the work starts, written atomically after it, a one-line error (exit 3) when it cannot be."""

from __future__ import annotations

import os

import click

from ckpt_audit.cli.common import CommandError

junit_option = click.option(
    "--junit-xml",
    "junit_xml",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="FILE",
    help="Also write a JUnit XML report here (one test case per compared item) for a CI system's test report; "
    "output and exit code are unchanged.",
)


def check_writable(path: str | None) -> None:
    """Refuse before minutes of work, not after: the report's directory must exist and be writable."""
    if path is None:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if not (os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK)):
        raise CommandError(f"cannot write --junit-xml {path}: {directory} is not a writable directory")


def write(path: str, suites) -> None:
    from ckpt_audit.report_junit import write_junit

    try:
        write_junit(path, suites)
    except OSError as exc:
        raise CommandError(f"cannot write --junit-xml {path}: {exc.strerror or exc}") from None
