"""What `Session.export` raises (kept apart from session.terms: the export's modules cost ~50 ms to import, which
only an export should pay)."""

from ckpt_audit.lifecycle.export import check_export  # `export --check`: reads only, holds no lock
from ckpt_audit.lifecycle.export_guard import ExportError, ExportRefused

__all__ = ["ExportError", "ExportRefused", "check_export"]
