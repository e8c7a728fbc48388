"""The kill -9 test seam: SIGKILL this process right after its k-th counted step.

Every command that changes disk or the catalog counts its steps here, so a test matrix can kill it at each point
and check that the tree and the catalog are whole afterwards. Two channels, so that one matrix does not shift the
other's points: the tree (prune's renames and unlinks, export's writes) and the catalog's scan records.
Unset (always, outside tests), counting costs an integer increment.
"""

from __future__ import annotations

import os
import signal

KILL_AFTER_ENV = "CKPT_AUDIT_TEST_KILL_AFTER_OPS"  # prune and export steps
CATALOG_KILL_AFTER_ENV = "CKPT_AUDIT_TEST_KILL_AFTER_CATALOG_OPS"  # record_scan's statements


class OpCounter:
    def __init__(self, kill_after: int | None) -> None:
        self.kill_after = kill_after
        self.n = 0

    @classmethod
    def from_env(cls, name: str = KILL_AFTER_ENV) -> OpCounter:
        raw = os.environ.get(name)
        return cls(int(raw) if raw and raw.isdigit() else None)

    def tick(self) -> None:
        self.n += 1
        if self.kill_after is not None and self.n >= self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
