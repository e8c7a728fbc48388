"""digest_file / digest_files and ptzip on real torch.save files, one corruption per test."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
import torch
import xxhash

from ckpt_audit.readers import hashing
from ckpt_audit.readers.hashing import digest_file, digest_files
from ckpt_audit.readers.ptzip import ZipFormatError, open_archive, payload_offset


@pytest.fixture(scope="session")
def pt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pt")
    g = torch.Generator().manual_seed(0)
    torch.save(
        {
            "model.embed.weight": torch.randn(300, 64, generator=g),
            "model.norm.weight": torch.ones(64),
            "lm_head.weight": torch.randn(300, 64, generator=g).bfloat16(),
        },
        d / "model_world_size_1_rank_0.pt",
    )
    # an optimizer-like nested dict, saved from a real AdamW step
    lin = torch.nn.Linear(16, 8)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-3)
    lin(torch.randn(4, 16, generator=g)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), d / "optim_world_size_1_rank_0.pt")
    # a tensor larger than one read chunk, so entry CRCs span chunk boundaries
    torch.save({"big": torch.randn(3 * hashing.CHUNK // 4 + 123, generator=g)}, d / "big.pt")
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"w": torch.randn(100, generator=g)}, d / "nocrc.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    (d / "fsdp_config.json").write_text('{\n    "FSDP_version": 1,\n    "world_size": 1\n}')
    return d


def _copy(src: Path, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes())
    return dst


def _payload_at(path: Path, record: str) -> tuple[int, int]:
    arch = open_archive(path)
    entry = arch.get(record)
    assert entry is not None
    fd = os.open(path, os.O_RDONLY)
    try:
        return payload_offset(fd, entry), entry.compressed_size
    finally:
        os.close(fd)


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def test_hash_is_xxh3_128_of_the_file_bytes(pt_dir: Path) -> None:
    for p in sorted(pt_dir.iterdir()):
        d = digest_file(p)
        assert d.hash == xxhash.xxh3_128(p.read_bytes()).hexdigest(), p.name
        assert d.size_bytes == p.stat().st_size


def test_clean_shard_checks_every_entry_crc(pt_dir: Path) -> None:
    p = pt_dir / "model_world_size_1_rank_0.pt"
    d = digest_file(p)
    n_entries = len(zipfile.ZipFile(p).infolist())
    assert (d.crc_ok, d.crc_bad_entries, d.zip_error, d.is_zip) == (True, (), None, True)
    assert d.entries_checked == n_entries
    assert d.prefix == "model_world_size_1_rank_0"
    assert not d.changed_during_read
    st = p.stat()
    assert (d.mtime_ns, d.inode, d.stat_size) == (st.st_mtime_ns, st.st_ino, st.st_size)


def test_ptzip_matches_zipfile(pt_dir: Path) -> None:
    p = pt_dir / "optim_world_size_1_rank_0.pt"
    arch = open_archive(p)
    ref = {i.filename: (i.header_offset, i.file_size, i.CRC) for i in zipfile.ZipFile(p).infolist()}
    assert {e.name: (e.header_offset, e.size, e.crc) for e in arch.entries} == ref
    assert arch.prefix == "optim_world_size_1_rank_0"
    assert arch.has_data_pkl and arch.has_byteorder and arch.has_version and arch.has_format_version
    assert set(arch.data_entries) == {n.rsplit("/", 1)[1] for n in ref if "/data/" in n and "/.data/" not in n}
    assert arch.torch_problems == ()


def test_flipped_payload_byte_fails_crc_naming_the_entry(pt_dir: Path, tmp_path: Path) -> None:
    p = _copy(pt_dir / "model_world_size_1_rank_0.pt", tmp_path / "model_world_size_1_rank_0.pt")
    at, size = _payload_at(p, "data/1")
    _flip(p, at + size // 2)
    d = digest_file(p)
    assert d.crc_ok is False
    assert d.crc_bad_entries == ("model_world_size_1_rank_0/data/1",)
    assert d.zip_error is None


def test_flipped_byte_in_data_pkl_fails_crc(pt_dir: Path, tmp_path: Path) -> None:
    p = _copy(pt_dir / "optim_world_size_1_rank_0.pt", tmp_path / "o.pt")
    at, _ = _payload_at(p, "data.pkl")
    _flip(p, at + 3)
    d = digest_file(p)
    assert d.crc_ok is False and d.crc_bad_entries == ("optim_world_size_1_rank_0/data.pkl",)


def test_crc_spanning_many_chunks_and_split_headers(pt_dir: Path, tmp_path: Path, monkeypatch) -> None:
    # An odd, tiny chunk size puts local headers across chunk boundaries; a flip deep in the big entry must show.
    monkeypatch.setattr(hashing, "CHUNK", 4099)
    clean = digest_file(pt_dir / "big.pt")
    assert clean.crc_ok is True and clean.entries_checked == len(open_archive(pt_dir / "big.pt").entries)
    p = _copy(pt_dir / "big.pt", tmp_path / "big.pt")
    at, size = _payload_at(p, "data/0")
    _flip(p, at + size - 5)
    assert digest_file(p).crc_bad_entries == ("big/data/0",)


def test_crc_disabled_at_save_is_none_not_corruption(pt_dir: Path) -> None:
    d = digest_file(pt_dir / "nocrc.pt")
    assert all(e.crc == 0 for e in open_archive(pt_dir / "nocrc.pt").entries)
    assert (d.crc_ok, d.crc_disabled, d.zip_error, d.crc_bad_entries) == (None, True, None, ())


def test_truncated_shard_is_a_zip_error_and_still_hashed(pt_dir: Path, tmp_path: Path) -> None:
    src = (pt_dir / "model_world_size_1_rank_0.pt").read_bytes()
    p = tmp_path / "model_world_size_1_rank_0.pt"
    p.write_bytes(src[: len(src) * 2 // 3])
    d = digest_file(p)
    assert d.zip_error is not None and d.zip_error.code == "truncated" and d.zip_error.message.startswith("truncated")
    assert d.crc_ok is None and d.is_zip
    assert d.hash == xxhash.xxh3_128(p.read_bytes()).hexdigest()


def test_garbage_named_pt_is_not_a_zip(tmp_path: Path) -> None:
    p = tmp_path / "model_world_size_2_rank_1.pt"
    p.write_bytes(os.urandom(5000).replace(b"PK", b"pk"))
    d = digest_file(p)
    assert d.zip_error is not None and d.zip_error.code == "not-a-zip"
    assert d.zip_error.message.startswith("not a zip archive")
    assert (d.crc_ok, d.is_zip) == (None, False)


def test_zero_byte_shard(tmp_path: Path) -> None:
    p = tmp_path / "optim_world_size_2_rank_0.pt"
    p.touch()
    d = digest_file(p)
    assert d.zip_error is not None and d.zip_error.code == "zero-byte" and d.zip_error.message.startswith("empty file")
    assert (d.size_bytes, d.hash) == (0, xxhash.xxh3_128(b"").hexdigest())


def test_legacy_torch_format_is_named(tmp_path: Path) -> None:
    p = tmp_path / "old.pt"
    torch.save({"w": torch.ones(3)}, p, _use_new_zipfile_serialization=False)
    d = digest_file(p)
    assert d.zip_error is not None and d.zip_error.code == "legacy-pickle-format"
    assert d.zip_error.message.startswith("legacy torch pickle format")


def test_json_is_hashed_without_zip_checks(pt_dir: Path) -> None:
    d = digest_file(pt_dir / "fsdp_config.json")
    assert (d.is_zip, d.zip_error, d.crc_ok) == (False, None, None)


def test_missing_central_directory_entry_record(pt_dir: Path, tmp_path: Path) -> None:
    # Keep the end record but point it at a directory that is not there: a damaged, not a truncated, archive.
    src = bytearray((pt_dir / "nocrc.pt").read_bytes())
    eocd = src.rfind(b"PK\x05\x06")
    src[eocd + 16 : eocd + 20] = (10).to_bytes(4, "little")
    p = tmp_path / "nocrc.pt"
    p.write_bytes(bytes(src))
    with pytest.raises(ZipFormatError, match="damaged") as raised:
        open_archive(p)
    assert raised.value.problem.code == "bad-zip"
    d = digest_file(p)
    assert d.zip_error is not None and d.zip_error.code == "bad-zip" and d.zip_error.message.startswith("damaged")


def test_zip64_records_are_read(tmp_path: Path, monkeypatch) -> None:
    # torch switches to zip64 past 4 GiB; stdlib zipfile writes the same records once its limit is lowered.
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 100)
    p = tmp_path / "z64.pt"
    payload = os.urandom(5000)
    with zipfile.ZipFile(p, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("z64/data.pkl", b"\x80\x02}q\x00.")
        z.writestr("z64/data/0", payload)
        z.writestr("z64/version", b"3\n")
    arch = open_archive(p)
    assert [e.size for e in arch.entries] == [6, 5000, 2]
    assert arch.prefix == "z64"
    assert digest_file(p).crc_ok is True


def test_file_growing_while_read_is_flagged(tmp_path: Path, monkeypatch) -> None:
    # A separate writer process appends all the time; on a loaded 2-core box it may be descheduled for a whole
    # read, so up to 20 reads are tried. A digest that never notices the growth fails the test.
    monkeypatch.setattr(hashing, "CHUNK", 4096)
    p = tmp_path / "growing.pt"
    p.write_bytes(b"\0" * (8 << 20))
    code = "import sys\nf = open(sys.argv[1], 'ab', buffering=0)\nwhile True: f.write(b'x' * 512)\n"
    writer = subprocess.Popen([sys.executable, "-c", code, str(p)])
    try:
        size0 = p.stat().st_size
        for _ in range(500):
            if p.stat().st_size > size0:
                break
            threading.Event().wait(0.01)
        seen = False
        for _ in range(20):
            if digest_file(p).changed_during_read:
                seen = True
                break
    finally:
        writer.kill()
        writer.wait()
    assert seen
    assert digest_file(p).changed_during_read is False  # once the writer is gone, the file reads as stable


def test_digest_files_yields_every_path_and_oserrors(pt_dir: Path, tmp_path: Path) -> None:
    good = sorted(str(p) for p in pt_dir.iterdir())
    missing = str(tmp_path / "gone.pt")
    a_dir = str(tmp_path)
    fifo = str(tmp_path / "pipe.pt")
    os.mkfifo(fifo)  # must be refused at once, not block waiting for a writer
    out = dict(digest_files([*good, missing, a_dir, fifo], workers=2))
    assert set(out) == {*good, missing, a_dir, fifo}
    assert isinstance(out[missing], FileNotFoundError)
    assert isinstance(out[a_dir], IsADirectoryError)
    assert isinstance(out[fifo], OSError) and "not a regular file" in str(out[fifo])
    for p in good:
        assert out[p] == digest_file(p)


def test_check_crc_false_skips_only_the_crc(pt_dir: Path, tmp_path: Path) -> None:
    p = _copy(pt_dir / "model_world_size_1_rank_0.pt", tmp_path / "model_world_size_1_rank_0.pt")
    at, size = _payload_at(p, "data/0")
    _flip(p, at + size // 3)
    d = digest_file(p, check_crc=False)
    assert (d.crc_ok, d.entries_checked, d.zip_error, d.prefix) == (None, 0, None, "model_world_size_1_rank_0")
    assert digest_file(p).crc_ok is False


def test_archive_comment_holding_the_end_signature(tmp_path: Path) -> None:
    p = tmp_path / "c.pt"
    with zipfile.ZipFile(p, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("c/data.pkl", b"\x80\x02}q\x00.")
        z.writestr("c/version", b"3\n")
        z.comment = b"xx PK\x05\x06 decoy " + b"\0" * 30
    assert [e.name for e in open_archive(p).entries] == ["c/data.pkl", "c/version"]
    assert digest_file(p).crc_ok is True


def test_store_checksums_are_the_stores_values(tmp_path):
    """CRC-32 and CRC-32C of the one read pass equal independent implementations' (zlib, google-crc32c), in the
    base64 big-endian form S3's headers use; off by default (scan --store-checksums)."""
    import base64
    import zlib

    import google_crc32c  # the test extra installs it (and awscrt, with the s3 extra)

    data = os.urandom(3 * hashing.CHUNK + 12345)
    p = tmp_path / "shard.bin"
    p.write_bytes(data)
    assert hashing.digest_file(p).checksums == ()
    sums = dict(hashing.digest_file(p, store_checksums=True).checksums)
    assert sums["crc32"] == base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
    assert sums["crc32c"] == base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()
    assert len(base64.b64decode(sums["crc64nvme"])) == 8  # checked against S3's own value in test_remote.py
