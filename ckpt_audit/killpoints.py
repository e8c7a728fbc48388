"""The kill -9 test seam: SIGKILL this process right after its k-th counted step.

Every command that changes disk or the catalog (prune's renames and unlinks, export's writes, the catalog's
statements) counts its steps here, so one test matrix can kill it at each point and check that the tree and the
catalog are whole afterwards. Unset (always, outside tests), counting costs an integer increment.
"""

from __future__ import annotations

import os
import signal

KILL_AFTER_ENV = "CKPT_AUDIT_TEST_KILL_AFTER_OPS"


class OpCounter:
    def __init__(self, kill_after: int | None) -> None:
        self.kill_after = kill_after
        self.n = 0

    @classmethod
    def from_env(cls) -> OpCounter:
        raw = os.environ.get(KILL_AFTER_ENV)
        return cls(int(raw) if raw and raw.isdigit() else None)

    def tick(self) -> None:
        self.n += 1
        if self.kill_after is not None and self.n >= self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
