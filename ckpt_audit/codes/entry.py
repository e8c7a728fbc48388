"""One registered finding code: the entry every family's table in this package is made of."""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_audit.models import Severity

E, W, INFO = Severity.ERROR, Severity.WARNING, Severity.INFO


@dataclass(frozen=True, slots=True, kw_only=True)
class Code:
    """One registered finding code: its slug, severity and the one-line explanation docs/codes.md shows."""

    code: str
    severity: Severity
    explanation: str
    corrupts: bool = False  # an ERROR of this code makes the checkpoint "corrupt" (not merely "incomplete")
