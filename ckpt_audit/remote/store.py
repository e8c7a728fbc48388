"""The S3 client side: list a prefix, HEAD its objects for their checksums, list in-progress multipart uploads, read
or delete an object. Through s3fs (fsspec), the `s3` extra: its HEAD can ask for the checksums S3 keeps
(ChecksumMode=ENABLED), which obstore's does not expose (bench/README.md has the listing figures of both).

Credentials and endpoint come the library's usual way (AWS_* environment, ~/.aws profiles, instance roles;
AWS_ENDPOINT_URL for an S3-compatible server); nothing here prints or stores them.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from ckpt_audit.remote import RemoteError

HEAD_CONCURRENCY = 64  # HEADs in flight at once (one per object; the event loop of s3fs runs them)


@dataclass(frozen=True, slots=True)
class Obj:
    """One object as the listing gives it."""

    url: str
    size: int
    mtime_ns: int


@dataclass(frozen=True, slots=True)
class Head:
    """An object's checksums as its HEAD gives them: {"crc64nvme": base64, ...} and S3's ChecksumType (FULL_OBJECT,
    COMPOSITE: a multipart upload's checksum of its parts' checksums, which no whole-file read reproduces)."""

    size: int
    checksums: tuple[tuple[str, str], ...]
    kind: str | None


_ALGORITHMS = {"ChecksumCRC32": "crc32", "ChecksumCRC32C": "crc32c", "ChecksumCRC64NVME": "crc64nvme"}


class Store:
    """One bucket's client (s3fs); every call raises RemoteError in one line, never a traceback."""

    def __init__(self, url: str) -> None:
        if url.startswith("gs://"):
            raise RemoteError(f"{url}: gs:// roots are not supported yet (no GCS-protocol server to test against)")
        try:
            import s3fs
        except ImportError:
            raise RemoteError("s3:// roots need the s3 extra: pip install 'ckpt-audit[s3]'") from None
        self.fs = s3fs.S3FileSystem(skip_instance_cache=True)
        self.gets = 0  # objects read (GET): bench/bench_remote.py prints it
        self._lock = threading.Lock()

    # ---------------------------------------------------------------------------------------- reads

    def objects(self, url: str) -> list[Obj]:
        """Every object at or below the prefix `url` (an object named exactly `url` is no root: not listed)."""
        path = _path(url)
        self.fs.invalidate_cache(path)  # a listing again is the store's answer now, never s3fs's cached one
        try:
            found = self._call(self.fs.find, path, detail=True)
        except FileNotFoundError:
            raise RemoteError(f"{url}: no such bucket") from None
        out = []
        for key, info in found.items():
            if info.get("type") != "file" or key.endswith("/"):
                continue  # a "directory marker" object holds no bytes of a checkpoint
            mtime = info.get("LastModified")
            out.append(Obj(url=f"s3://{key}", size=int(info["size"]), mtime_ns=int(mtime.timestamp() * 1e9)))
        return out

    def heads(self, urls: Sequence[str]) -> dict[str, Head | RemoteError]:
        """url -> its Head (one HEAD request each, HEAD_CONCURRENCY at a time), or why it could not be had."""
        from fsspec.asyn import sync

        async def one(sem: asyncio.Semaphore, url: str) -> Head | RemoteError:
            bucket, key = _split(url)
            async with sem:
                try:
                    r = await self.fs._call_s3("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED")
                except FileNotFoundError:
                    return RemoteError("gone before its HEAD")
                except OSError as exc:
                    return RemoteError(f"HEAD failed: {exc.strerror or type(exc).__name__}")
            sums = tuple((name, r[field]) for field, name in _ALGORITHMS.items() if r.get(field))
            return Head(size=int(r.get("ContentLength", -1)), checksums=sums, kind=r.get("ChecksumType"))

        async def every() -> list:
            sem = asyncio.Semaphore(HEAD_CONCURRENCY)  # made inside the loop it serves
            # one HEAD alone first: on a fresh client, concurrent first requests each set up what one would
            # (3.5 s instead of 0.3 s for 12 HEADs here)
            first = await one(sem, urls[0])
            return [first, *await asyncio.gather(*(one(sem, u) for u in urls[1:]))]

        return dict(zip(urls, self._call(sync, self.fs.loop, every), strict=True)) if urls else {}

    def uploads(self, url: str) -> list[str]:
        """The keys (as URLs) of multipart uploads begun and neither completed nor aborted under `url`."""
        bucket, prefix = _split(url)
        out: list[str] = []
        kw = {"Bucket": bucket, "Prefix": prefix.rstrip("/") + "/" if prefix else ""}
        while True:
            r = self._call(self.fs.call_s3, "list_multipart_uploads", **kw)
            out.extend(f"s3://{bucket}/{u['Key']}" for u in r.get("Uploads", ()))
            if not r.get("IsTruncated"):
                return out
            kw.update(KeyMarker=r["NextKeyMarker"], UploadIdMarker=r["NextUploadIdMarker"])

    def read(self, url: str, limit: int) -> bytes:
        """The object's first `limit` bytes (a GET)."""
        self._got()
        return self._call(self.fs.cat_file, _path(url), start=0, end=limit)

    def download(self, url: str, dest: str) -> None:
        self._got()
        self._call(self.fs.get_file, _path(url), dest)

    # ---------------------------------------------------------------------------------------- writes

    def delete(self, url: str) -> None:
        """Delete exactly the object `url` (one DeleteObject; remote prune, ckpt_audit.remote.prune). In a
        versioned bucket this adds a delete marker: the old version stays until the bucket's lifecycle rules
        expire it."""
        bucket, key = _split(url)
        self._call(self.fs.call_s3, "delete_object", Bucket=bucket, Key=key)

    def _got(self) -> None:
        with self._lock:  # the remote scan reads on a thread pool
            self.gets += 1

    # ----------------------------------------------------------------------------------------

    @staticmethod
    def _call(fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError:
            raise
        except (OSError, ValueError) as exc:  # s3fs maps the service's errors to OSError subclasses
            why = getattr(exc, "strerror", None) or exc
            raise RemoteError(f"{_path(str(args[0])) if args else ''}: {why}") from None
        except Exception as exc:  # noqa: BLE001 - botocore's credential and endpoint errors are no OSError
            raise RemoteError(f"{type(exc).__name__}: {exc}") from None


def _path(url: str) -> str:
    return url.split("://", 1)[1] if "://" in url else url


def _split(url: str) -> tuple[str, str]:
    bucket, _, key = _path(url).partition("/")
    return bucket, key
