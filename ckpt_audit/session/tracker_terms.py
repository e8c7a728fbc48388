"""What `Session.fix_tracker` raises (kept apart from session.terms: only fix-tracker should pay its import)."""

from ckpt_audit.lifecycle.tracker_fix import FixError

__all__ = ["FixError"]
