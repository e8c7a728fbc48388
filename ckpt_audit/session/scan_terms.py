"""What a front end passes to `Session.scan` beyond paths and flags: the scrub policy (kept apart from
session.terms, whose prune planning costs ~40 ms to import that a cron scan should not pay)."""

from ckpt_audit.scan.scrub import ScrubPolicy

__all__ = ["ScrubPolicy"]
