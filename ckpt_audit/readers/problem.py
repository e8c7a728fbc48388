"""What a reader found wrong with a file: a registered finding code plus the one-line detail.

Readers name the code where they see the defect, so the rules never parse a message back into a code: rewording a
message cannot change a finding's code, and an unregistered code fails where it is made.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_audit.codes import CODES


@dataclass(frozen=True, slots=True)
class Problem:
    """A defect a reader saw: the finding code and its one-line message."""

    code: str  # a finding code of ckpt_audit.codes (its severity comes from the registry)
    message: str  # one line, shown to the user as the finding's message
    tensor: str | None = None  # the tensor it concerns, when one

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise KeyError(f"unregistered finding code {self.code!r}")

    def __str__(self) -> str:
        return self.message
