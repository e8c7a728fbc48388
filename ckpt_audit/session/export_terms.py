"""What `Session.export` raises (kept apart from session.terms: the export's modules cost ~50 ms to import, which
only an export should pay)."""

from ckpt_audit.export.guard import ExportError, ExportRefused
from ckpt_audit.export.orchestrator import check_export  # `export --check`: reads only, holds no lock

__all__ = ["ExportError", "ExportRefused", "check_export"]
