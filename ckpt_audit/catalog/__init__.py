"""The SQLite catalog of scans: store.py opens and writes it, queries.py reads it; `manifest` holds the torch- and
sqlite_utils-free fast path."""

from __future__ import annotations

from ckpt_audit.catalog.manifest import CatalogError, probe, read_previous

__all__ = ["Catalog", "CatalogError", "open_catalog", "probe", "read_catalog", "read_previous"]


def __getattr__(name: str):
    # Catalog/open_catalog import sqlite_utils (~0.2-0.3 s): loaded on first use, after the scan has started
    if name in ("Catalog", "open_catalog", "read_catalog"):
        from ckpt_audit.catalog import store

        return getattr(store, name)
    raise AttributeError(name)
