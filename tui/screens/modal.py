"""The base of every dialog: it answers once.

Textual's `dismiss` pops whatever screen is on top. Two answers read before the first closed the dialog (two
Enters, `??` on the help screen, Escape typed twice) would then close the screen below it as well, and the next
keys would land somewhere the user never saw. A dialog that is no longer on top has already answered.
"""

from __future__ import annotations

from typing import TypeVar

from textual.await_complete import AwaitComplete
from textual.screen import ModalScreen

ResultType = TypeVar("ResultType")


class Modal(ModalScreen[ResultType]):
    def dismiss(self, result: ResultType | None = None) -> AwaitComplete:
        if not self.is_active:
            return AwaitComplete.nothing()
        return super().dismiss(result)
