"""Exit codes shared by every command (documented in README.md and docs/cli.md; tests/test_docs.py holds both)."""

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0  # clean (or: equivalent, for resume-test)
    FINDINGS = 1  # findings at or above --fail-on (or: diverged)
    USAGE = 2  # bad arguments
    ERROR = 3  # unusable root or catalog, or an internal error; outranks findings
    LOCKED = 4  # another run holds the lock
    INTERRUPTED = 130  # Ctrl-C
