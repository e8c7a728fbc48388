"""The mapped hashing path (large files unmodified for a while): same hash, same CRC verdicts as the read() path."""

from __future__ import annotations

import os
import zipfile

import xxhash

from ckpt_audit.readers import hashing


def _big_zip(path, n: int) -> None:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("m/data.pkl", b"\x80\x02}q\x00.")
        z.writestr("m/data/0", os.urandom(n))
        z.writestr("m/version", "3\n")


def test_a_large_settled_file_is_mapped_and_hashes_as_read(tmp_path, monkeypatch):
    p = tmp_path / "model_world_size_1_rank_0.pt"
    _big_zip(p, hashing.MAP_MIN_BYTES + 12345)
    old = os.stat(p).st_mtime - 3600
    os.utime(p, (old, old))
    assert hashing._mappable(os.stat(p))
    mapped = hashing.digest_file(p)
    assert mapped.hash == xxhash.xxh3_128(p.read_bytes()).hexdigest() and mapped.crc_ok is True
    middle = hashing.MAP_MIN_BYTES // 2
    monkeypatch.setattr(hashing, "MAP_MIN_BYTES", 1 << 62)  # the read() path, for comparison
    assert hashing.digest_file(p) == mapped

    with open(p, "r+b") as fh:  # one flipped payload byte, mtime put back: the mapped pass catches it by CRC
        fh.seek(middle)
        b = fh.read(1)
        fh.seek(middle)
        fh.write(bytes([b[0] ^ 1]))
    os.utime(p, (old, old))
    monkeypatch.undo()
    bad = hashing.digest_file(p)
    assert bad.crc_ok is False and bad.crc_bad_entries == ("m/data/0",) and bad.hash != mapped.hash


def test_a_recently_written_file_is_not_mapped(tmp_path):
    p = tmp_path / "x.pt"
    _big_zip(p, hashing.MAP_MIN_BYTES)
    assert not hashing._mappable(os.stat(p))  # may still be rewritten in place: a truncation would be SIGBUS
