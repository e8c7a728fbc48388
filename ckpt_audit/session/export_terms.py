"""What `Session.export` raises (kept apart from session.terms: the export's modules cost ~50 ms to import, which
only an export should pay)."""

from ckpt_audit.export import orchestrator
from ckpt_audit.export.guard import ExportError, ExportRefused

__all__ = ["ExportError", "ExportRefused", "check_export", "unreadable"]


def check_export(*args, **kwargs):
    """`export --check` (orchestrator.check_export): reads only, holds no lock. Raises ExportError."""
    try:
        return orchestrator.check_export(*args, **kwargs)
    except OSError as exc:
        raise unreadable(exc) from None


def unreadable(exc: OSError) -> ExportError:
    """An OSError the export met before writing (past that it names its own): what it could not read, one line (a
    huggingface/ without read permission was a bare PermissionError naming no command)."""
    return ExportError(f"cannot read {exc.filename or 'the checkpoint'} ({exc.strerror or exc}); nothing was written")
