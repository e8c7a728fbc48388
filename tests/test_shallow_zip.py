"""Issue 26: the shallow scan checks what torch.load and DCP's load read, through the real CLI on trees written by
the reference trainer (verl_run) and by torch.distributed.checkpoint (dcp_trees).

- One flipped bit in a zip central-directory size field: torch.load refuses the file (miniz: "invalid header or
  archive is corrupted", a stored entry whose sizes differ), so the checkpoint is `corrupt` (`bad-zip`) and `latest`
  passes over it. Before, the scan left it `complete`.
- The same inside a `.distcp`: DCP's load torch.loads each item's byte range and refuses it: `distcp-item-invalid`.
- A `.distcp` bytes item whose pickle calls os.system: DCP's DefaultLoadPlanner.load_bytes runs
  `torch.load(weights_only=False)` on it, so the checkpoint is `unsafe` under scan and verify, `latest --verified`
  does not name it, and the payload never runs here.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed.tensor  # noqa: F401 - the shards hold DTensors, which torch.load needs registered
from cli_proc import ckpt_audit

pytestmark = pytest.mark.slow  # trainer- and DCP-written trees


def _cli(*args: str, catalog: Path) -> tuple[int, str, str]:
    proc = ckpt_audit(*args, "--catalog", catalog, timeout=600)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return proc.returncode, proc.stdout, proc.stderr


def _scan(root: Path, catalog: Path, command: str = "scan") -> dict:
    code, out, _ = _cli(command, "--json", str(root), catalog=catalog)
    assert code in (0, 1), out
    return json.loads(out)


def _checkpoints(doc: dict) -> dict[str, dict]:
    return {c["path"]: c for r in doc["runs"] for c in r["checkpoints"]}


def _codes(ck: dict) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in [*ck["findings"], *(f for comp in ck["components"] for f in comp["findings"])]:
        out.setdefault(f["code"], []).append(f["message"])
    return out


def _central_records(raw: bytes, start: int = 0) -> dict[str, int]:
    """name -> offset of its central-directory record, for the first zip's directory at or after `start`."""
    pos = raw.index(b"PK\x01\x02", start)
    out = {}
    while raw[pos : pos + 4] == b"PK\x01\x02":
        nlen, xlen, clen = struct.unpack_from("<HHH", raw, pos + 28)
        out[raw[pos + 46 : pos + 46 + nlen].decode()] = pos
        pos += 46 + nlen + xlen + clen
    return out


def _flip_size_bit(raw: bytearray, record: int) -> None:
    raw[record + 24] ^= 0x01  # the uncompressed size of a stored entry: now differs from its stored size


def test_one_flipped_bit_in_a_central_directory_size_makes_the_checkpoint_corrupt(copy_run, verl_run, tmp_path):
    run = copy_run(verl_run)
    newest = max(run.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    shard = next((newest / "actor").glob("model_world_size_*_rank_0.pt"))
    raw = bytearray(shard.read_bytes())
    [(name, record)] = [(n, o) for n, o in _central_records(raw).items() if n.endswith("/data/0")]
    _flip_size_bit(raw, record)
    stat = shard.stat()
    shard.write_bytes(raw)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    # what the loader does: torch.load refuses the whole file
    with pytest.raises(RuntimeError, match="invalid header or archive is corrupted"):
        torch.load(shard, weights_only=True)

    doc = _scan(run, tmp_path / "c.db")
    ck = _checkpoints(doc)[str(newest)]
    assert ck["status"] == "corrupt"
    [message] = _codes(ck)["bad-zip"]
    assert name in message and "uncompressed" in message
    code, out, _ = _cli("latest", str(run), catalog=tmp_path / "c.db")
    assert code == 0 and out.strip() != str(newest)


def test_a_local_header_that_disagrees_with_the_directory_is_a_warning(copy_run, verl_run, tmp_path):
    """torch.load reads names and sizes from the central directory only, so a damaged local name still loads: the
    scan warns (the bytes were rewritten or rotted) and the checkpoint stays complete, as the load says."""
    run = copy_run(verl_run)
    newest = max(run.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    shard = next((newest / "actor").glob("model_world_size_*_rank_0.pt"))
    raw = bytearray(shard.read_bytes())
    [(name, record)] = [(n, o) for n, o in _central_records(raw).items() if n.endswith("/data/0")]
    (local,) = struct.unpack_from("<I", raw, record + 42)
    raw[local + 30 + len(name) - 1] ^= 0x01  # the local header's copy of the name: ".../data/1"
    stat = shard.stat()
    shard.write_bytes(raw)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    torch.load(shard, weights_only=True)  # loads

    ck = _checkpoints(_scan(run, tmp_path / "c.db"))[str(newest)]
    assert ck["status"] == "complete"
    assert "zip-local-header-mismatch" in _codes(ck)
    [message] = _codes(ck)["zip-local-header-mismatch"]
    assert name in message


def _dcp_copy(dcp_trees, tmp_path: Path) -> Path:
    step = dcp_trees["dcp"]
    root = tmp_path / "tree"
    shutil.copytree(step.parent.parent, root / step.parent.parent.name, symlinks=True)
    return root / step.parent.parent.name / step.parent.name / step.name


def test_a_damaged_zip_inside_a_distcp_makes_the_checkpoint_corrupt(dcp_trees, tmp_path):
    step = _dcp_copy(dcp_trees, tmp_path)
    data = step / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    record = next(o for n, o in _central_records(raw).items() if n.endswith("/data.pkl"))  # the first item
    _flip_size_bit(raw, record)
    data.write_bytes(raw)
    # what DCP's load does with that item: FileSystemReader torch.loads its byte range, which refuses it
    end = raw.index(b"PK\x05\x06", record) + 22
    with pytest.raises(RuntimeError, match="invalid header or archive is corrupted"):
        torch.load(io.BytesIO(bytes(raw[:end])), weights_only=True)

    doc = _scan(step.parent.parent, tmp_path / "c.db")
    ck = _checkpoints(doc)[str(step)]
    assert ck["status"] == "corrupt"
    assert "distcp-item-invalid" in _codes(ck)


class _Payload:
    """Pickles as os.system('touch MARKER'); the test process never unpickles it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant_bytes_item(step: Path, marker: Path) -> str:
    """Append a torch.save of the payload to __0_0.distcp and point one bytes item of .metadata at it, as DCP would
    have written it (a torch.save blob in the file, its byte range in .metadata)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta = FileSystemReader(str(step)).read_metadata()
    fqn = next(k for k, v in sorted(meta.state_dict_metadata.items()) if isinstance(v, BytesStorageMetadata))
    [index] = [i for i in meta.storage_data if i.fqn == fqn]
    blob = io.BytesIO()
    torch.save(_Payload(marker), blob)
    data = step / "__0_0.distcp"
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(blob.getvalue())
    meta.storage_data[index] = _StorageInfo(relative_path=data.name, offset=offset, length=len(blob.getvalue()))
    with open(step / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    return fqn


def test_a_pickle_payload_in_a_distcp_bytes_item_makes_the_checkpoint_unsafe(dcp_trees, tmp_path):
    step = _dcp_copy(dcp_trees, tmp_path)
    marker = tmp_path / "payload-ran"
    _plant_bytes_item(step, marker)
    root, catalog = step.parent.parent, tmp_path / "c.db"

    for command in ("scan", "verify", "scan"):  # the second scan reuses the catalog's rows: still unsafe
        ck = _checkpoints(_scan(root, catalog, command))[str(step)]
        assert ck["status"] == "unsafe", (command, _codes(ck))
        [message] = _codes(ck)["unsafe-pickle"]
        assert "system" in message
    code, out, err = _cli("latest", "--verified", str(step.parent), catalog=catalog)
    assert (code, out) == (1, ""), err  # its only checkpoint is unsafe: nothing to resume from
    assert not marker.exists()
