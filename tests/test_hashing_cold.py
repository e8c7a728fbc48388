"""Hashing a file that is not in the page cache: the read-ahead (POSIX_FADV_WILLNEED ahead of the hashing, only for
windows not cached) must change nothing but the timing: same digest and CRC verdicts as a warm read, on both the
read() and the mapped path; a truncation under the reader is still a short read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import xxhash

from ckpt_audit.readers import hashing
from ckpt_audit.readers.ptzip import open_archive, payload_offset

SLICE = 256 * 1024  # small windows, so a few-MiB file has many of them


@pytest.fixture
def small_windows(monkeypatch):
    monkeypatch.setattr(hashing, "MAP_SLICE", SLICE)
    monkeypatch.setattr(hashing, "AHEAD", 2 * SLICE)
    monkeypatch.setattr(hashing, "CHUNK", 64 * 1024)


def _shard(path: Path) -> Path:
    g = torch.Generator().manual_seed(1)
    torch.save({"a": torch.randn(400_000, generator=g), "b": torch.randn(300, 64, generator=g).bfloat16()}, path)
    return path


def _evict(path: Path) -> None:
    """Drop the file's clean pages from the page cache (no root needed); skip where the file system keeps them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        ahead = hashing._ReadAhead(fd, os.fstat(fd).st_size)
        if ahead._cached(0) or ahead.probe is None:
            pytest.skip("this file system keeps the pages cached or has no RWF_NOWAIT: no cold read to test")
    finally:
        os.close(fd)


def _advised(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        ahead = hashing._ReadAhead(fd, os.fstat(fd).st_size)
        ahead.at(0)
        return ahead.advised
    finally:
        os.close(fd)


def test_cold_windows_are_advised_and_cached_ones_are_not(tmp_path, small_windows):
    p = _shard(tmp_path / "model_world_size_1_rank_0.pt")
    assert os.path.getsize(p) > 4 * SLICE
    _evict(p)
    assert _advised(p) > 0  # the window being hashed and those ahead of it (a probe may have read one itself)
    p.read_bytes()
    assert _advised(p) == 0  # cached: nothing asked for, so a warm read pays only the probe


def test_cold_read_gives_the_warm_digest_and_catches_a_flipped_byte(tmp_path, small_windows):
    p = _shard(tmp_path / "model_world_size_1_rank_0.pt")
    warm = hashing.digest_file(p)
    assert warm.crc_ok is True and warm.entries_checked >= 3
    assert warm.hash == xxhash.xxh3_128(p.read_bytes()).hexdigest()
    _evict(p)
    assert hashing.digest_file(p) == warm

    entry = open_archive(p).get("data/0")
    assert entry is not None
    fd = os.open(p, os.O_RDWR)
    try:
        off = payload_offset(fd, entry) + entry.compressed_size // 2
        b = os.pread(fd, 1, off)
        os.pwrite(fd, bytes([b[0] ^ 1]), off)
    finally:
        os.close(fd)
    _evict(p)
    bad = hashing.digest_file(p)
    assert bad.crc_ok is False and bad.crc_bad_entries == (entry.name,) and bad.hash != warm.hash


def test_cold_mapped_read_gives_the_read_digest(tmp_path, monkeypatch):
    p = _shard(tmp_path / "optim_world_size_1_rank_0.pt")
    old = os.stat(p).st_mtime - 3600
    os.utime(p, (old, old))
    monkeypatch.setattr(hashing, "MAP_SLICE", SLICE)
    monkeypatch.setattr(hashing, "AHEAD", 2 * SLICE)
    warm = hashing.digest_file(p)  # read() path: the file is below MAP_MIN_BYTES
    monkeypatch.setattr(hashing, "MAP_MIN_BYTES", 1)
    assert hashing._mappable(os.stat(p))
    _evict(p)
    assert hashing.digest_file(p) == warm


def test_a_file_truncated_during_a_cold_read_is_a_short_read(tmp_path, small_windows, monkeypatch):
    p = _shard(tmp_path / "model_world_size_1_rank_0.pt")
    size = os.path.getsize(p)
    at = hashing._ReadAhead.at

    def truncate_midway(self, pos):  # the truncation lands between two reads, while windows ahead are advised
        if pos >= size // 2 and os.path.getsize(p) == size:
            os.truncate(p, size // 3)
        at(self, pos)

    monkeypatch.setattr(hashing._ReadAhead, "at", truncate_midway)
    _evict(p)
    d = hashing.digest_file(p)
    assert d.changed_during_read and d.size_bytes < size and d.stat_size == size
    assert d.crc_ok is not True


def test_no_read_ahead_while_another_file_streams(tmp_path, small_windows, monkeypatch):
    p = _shard(tmp_path / "model_world_size_1_rank_0.pt")
    assert hashing.digest_file(p).crc_ok is True and hashing._streams == 0  # each read gives its count back
    _evict(p)
    monkeypatch.setattr(hashing, "_streams", 2)  # as while a second worker thread reads its file
    assert _advised(p) == 0
    monkeypatch.setattr(hashing, "_streams", 1)
    assert _advised(p) > 0
