"""Object-store roots (`s3://bucket/prefix`, `gs://…`): listed and judged from the stores' own metadata.

This module stays import-light (the scanner and the CLI ask `is_remote` of every root); the client library (s3fs,
the `s3` extra) is imported only by ckpt_audit.remote.store, when a remote root is given. docs/remote.md.
"""

from __future__ import annotations

SCHEMES = ("s3://", "gs://")


def is_remote(path: object) -> bool:
    return isinstance(path, str) and path.startswith(SCHEMES)


def normal(path: str) -> str:
    """A remote root as the catalog keys it: the URL without a trailing slash (local paths are the caller's)."""
    return path.rstrip("/") if path.count("/") > 2 else path


class RemoteError(Exception):
    """A remote root that cannot be listed or reached (no such bucket, no credentials, no client library): a
    one-line error, exit 3. Never carries credentials: the client's messages name the bucket and the operation."""
